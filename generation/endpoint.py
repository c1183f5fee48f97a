"""The engine of any OpenAI-compatible chat endpoint (a vLLM or KServe server).

``POST {base}/v1/chat/completions`` with ``messages = [system(instructions), user(question)]``;
gpt-oss servers give the reasoning back as ``reasoning_content`` (older vLLM) or
``reasoning`` (newer vLLM) beside ``content``, or leave it inside ``content`` in harmony form;
all are handled (see ``Generation.parsed``).

Each request is retried on timeouts, connection errors, HTTP 429 and 5xx, with exponential
backoff (``backoff_s · 2^k``, capped, honouring a numeric ``Retry-After``); other HTTP errors
and malformed bodies are not retried. Every wait is bounded (``EndpointSettings``): an
attempt's connect and read timeouts, the request's total (attempts, backoff and reading the
answer) and the model's whole run. A request that still fails, or that a bound stopped, comes
back as a ``Generation`` with ``error`` set. At most ``concurrency`` requests are in flight.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import requests
from pydantic import ConfigDict, Field

from core.config_model import ConfigModel
from generation.requests import Generation, GenerationRequest, SamplingParams

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class EndpointSettings(ConfigModel):
    """Client settings for OpenAI-compatible chat endpoints (vLLM, KServe).

    Every wait is bounded: an attempt by ``connect_timeout_s`` (connecting) and ``timeout_s``
    (each wait for data), a request (its attempts, the waits between them and the reading of
    its answer) by ``request_timeout_s``, and a model's whole run by ``run_timeout_s``: a
    request not answered by then fails with an error that names the bound (the responses
    already in are kept; the eval then fails past ``EvalConfig.max_failure_fraction``).

    Attributes:
        timeout_s: Read timeout of one attempt: the longest wait for the next bytes of the
            answer (``lingo eval --timeout``).
        connect_timeout_s: Connect timeout of one attempt (``--connect-timeout``).
        request_timeout_s: Bound on one request, all its attempts and backoff waits included
            (``--request-timeout``).
        run_timeout_s: Bound on all of a model's requests (``--run-timeout``); ``None``: no
            bound beyond the requests' own.
        max_retries: Retries after the first attempt (timeouts, connection errors, 429, 5xx).
        backoff_s: First retry delay; doubles each retry (exponential backoff).
        max_backoff_s: Cap on one delay (also on a server's ``Retry-After``).
        concurrency: Requests in flight at once.
        api_key_env: Environment variable holding the API key (sent as a Bearer token when
            set and non-empty).
        reasoning_effort: Sent as ``reasoning_effort`` when set (vLLM gpt-oss reads it);
            ``None`` leaves the server's default.
    """

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(120.0, gt=0)
    connect_timeout_s: float = Field(10.0, gt=0)
    request_timeout_s: float = Field(300.0, gt=0)
    run_timeout_s: float | None = Field(3600.0, gt=0)
    max_retries: int = Field(3, ge=0)
    backoff_s: float = Field(1.0, ge=0)
    max_backoff_s: float = Field(30.0, ge=0)
    concurrency: int = Field(8, ge=1)
    api_key_env: str = "OPENAI_API_KEY"
    reasoning_effort: Literal["low", "medium", "high"] | None = None


class EndpointError(RuntimeError):
    """The endpoint cannot be used at all (e.g. its model list cannot be read)."""


class _Retryable(Exception):
    """A failure worth retrying: ``args = (message, retry_after_seconds | None)``."""


class _Fatal(Exception):
    """A failure that a retry would repeat (4xx, malformed body)."""


def api_base(url: str) -> str:
    """``http://host:8000``, ``…/v1`` or ``…/v1/`` → ``http://host:8000/v1``."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        url = url[: -len("/chat/completions")]
    return url if url.endswith("/v1") else url + "/v1"


class ChatEndpointEngine:
    """Client of an OpenAI-compatible ``/v1/chat/completions`` endpoint.

    Args:
        url: Base URL of the server (with or without ``/v1``).
        model: Served model name; ``None``: the only model listed by ``GET /v1/models``.
        settings: Timeouts, retries, concurrency, API key variable.

    Raises:
        EndpointError: ``model`` is ``None`` and the model list is unreadable or ambiguous.
    """

    def __init__(
        self, url: str, model: str | None = None, settings: EndpointSettings | None = None
    ) -> None:
        self.settings = settings or EndpointSettings()
        self.base = api_base(url)
        key = os.environ.get(self.settings.api_key_env, "")
        self.headers = {"Content-Type": "application/json"}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        self._local = threading.local()
        self._run_deadline = math.inf
        self.model = model or self._only_model()
        self.description = f"endpoint:{self.base} (model {self.model})"

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _only_model(self) -> str:
        try:
            response = self._session().get(
                f"{self.base}/models",
                headers=self.headers,
                timeout=(
                    min(self.settings.connect_timeout_s, self.settings.request_timeout_s),
                    min(self.settings.timeout_s, self.settings.request_timeout_s),
                ),
            )
            response.raise_for_status()
            names = [m["id"] for m in response.json()["data"]]
        except (requests.RequestException, ValueError, KeyError, TypeError) as err:
            raise EndpointError(
                f"{self.base}/models: cannot list the served models ({err}); "
                "pass the model name explicitly"
            ) from err
        if len(names) != 1:
            raise EndpointError(
                f"{self.base} serves {len(names)} models {names}; pass the model name explicitly"
            )
        return names[0]

    def generate(
        self, requests_: Sequence[GenerationRequest], sampling: SamplingParams
    ) -> list[Generation]:
        """Send every request (``concurrency`` at a time); results come back in order. All of
        them end within ``run_timeout_s`` (those not answered by then come back failed)."""
        run_timeout = self.settings.run_timeout_s
        self._run_deadline = time.monotonic() + run_timeout if run_timeout else math.inf
        with ThreadPoolExecutor(
            max_workers=self.settings.concurrency, thread_name_prefix="eval-endpoint"
        ) as pool:
            return list(pool.map(lambda r: self._complete(r, sampling), requests_))

    def _body(self, request: GenerationRequest, sampling: SamplingParams) -> dict:
        body: dict[str, object] = {
            "model": self.model,
            "messages": list(request.messages),
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
            "seed": request.seed,
            "n": 1,
        }
        if self.settings.reasoning_effort is not None:
            body["reasoning_effort"] = self.settings.reasoning_effort
        return body

    def _complete(self, request: GenerationRequest, sampling: SamplingParams) -> Generation:
        body = self._body(request, sampling)
        began = time.perf_counter()
        request_deadline = time.monotonic() + self.settings.request_timeout_s
        deadline = min(request_deadline, self._run_deadline)
        attempts = 0
        last_error = ""
        while True:
            if time.monotonic() >= deadline:  # a run's bound reached before this request
                last_error = self._bound_reached(request_deadline, last_error)
                break
            attempts += 1
            retry_after: float | None = None
            try:
                return self._post(body, began, attempts, deadline)
            except _Retryable as err:
                last_error, retry_after = err.args[0], err.args[1]
            except _Fatal as err:
                last_error = err.args[0]
                break
            except requests.RequestException as err:  # timeouts, connection resets, …
                last_error = f"{type(err).__name__}: {err}"
            if time.monotonic() >= deadline:  # this attempt ran into the bound
                last_error = self._bound_reached(request_deadline, last_error)
                break
            if attempts > self.settings.max_retries:
                break
            delay = min(self.settings.backoff_s * 2 ** (attempts - 1), self.settings.max_backoff_s)
            if retry_after is not None:
                delay = min(max(delay, retry_after), self.settings.max_backoff_s)
            if time.monotonic() + delay >= deadline:  # no time left for another attempt
                last_error = self._bound_reached(request_deadline, last_error)
                break
            log.warning(
                "%s: attempt %d failed (%s); retrying in %.2f s",
                request.key,
                attempts,
                last_error,
                delay,
            )
            time.sleep(delay)
        log.error("%s: giving up after %d attempt(s): %s", request.key, attempts, last_error)
        return Generation(
            text=None,
            latency_s=time.perf_counter() - began,
            attempts=attempts,
            error=last_error,
        )

    def _bound_reached(self, request_deadline: float, last_error: str) -> str:
        """The error of a request stopped by a bound: which one, and the last failure."""
        if self._run_deadline <= request_deadline:
            bound = (
                f"the run's bound run_timeout_s={self.settings.run_timeout_s:g} s (--run-timeout)"
            )
        else:
            bound = (
                f"the request's bound request_timeout_s={self.settings.request_timeout_s:g} s "
                "(--request-timeout)"
            )
        return f"no answer within {bound}" + (f"; last error: {last_error}" if last_error else "")

    def _post(self, body: dict, began: float, attempts: int, deadline: float) -> Generation:
        left = max(deadline - time.monotonic(), 1e-3)
        timeout = (min(self.settings.connect_timeout_s, left), min(self.settings.timeout_s, left))
        response = self._session().post(
            f"{self.base}/chat/completions",
            json=body,
            headers=self.headers,
            timeout=timeout,
            stream=True,
        )
        with contextlib.closing(response):
            content = _read_by(response, deadline)
        text = content.decode("utf-8", errors="replace")
        if response.status_code in RETRY_STATUS:
            raise _Retryable(
                f"HTTP {response.status_code}: {text[:200]}",
                _retry_after(response.headers.get("Retry-After")),
            )
        if response.status_code >= 400:
            raise _Fatal(f"HTTP {response.status_code}: {text[:200]}")
        try:
            data = json.loads(content)
            choice = data["choices"][0]
            message = choice["message"]
        except (ValueError, KeyError, IndexError, TypeError) as err:
            raise _Fatal(f"malformed response ({type(err).__name__}): {text[:200]}") from err
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        usage = data.get("usage") or {}
        return Generation(
            text=message.get("content") or "",
            reasoning=reasoning if isinstance(reasoning, str) else None,
            finish_reason=choice.get("finish_reason"),
            completion_tokens=usage.get("completion_tokens"),
            latency_s=time.perf_counter() - began,
            attempts=attempts,
        )

    def close(self) -> None:
        """Nothing to free (sessions close with their threads)."""


def _read_by(response: requests.Response, deadline: float) -> bytes:
    """The body of a streamed response, read by ``deadline`` (a server that trickles its
    answer cannot hold a request past its bound; each read also waits at most the read
    timeout). ``read1`` returns what has arrived, so the deadline is checked as bytes come.

    Raises:
        requests.Timeout: the deadline or a read timeout passed before the body was whole.
        requests.ConnectionError: the connection broke off.
    """
    import urllib3

    chunks = []
    try:
        while chunk := response.raw.read1(1 << 16, decode_content=True):
            chunks.append(chunk)
            if time.monotonic() > deadline:
                raise requests.Timeout("the answer was still coming in when the bound was reached")
    except urllib3.exceptions.ReadTimeoutError as err:
        raise requests.Timeout(str(err)) from err
    except (urllib3.exceptions.ProtocolError, urllib3.exceptions.DecodeError) as err:
        raise requests.ConnectionError(str(err)) from err
    return b"".join(chunks)


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
