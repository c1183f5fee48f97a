"""The engines of an OpenAI-compatible endpoint (a vLLM or KServe server), one per API
(``EndpointSettings.api``, ``ENDPOINT_APIS``):

* ``chat``: ``POST {base}/v1/chat/completions`` with ``messages = [system(instructions),
  user(question)]``; the server renders the prompt. gpt-oss servers give the reasoning back as
  ``reasoning_content`` (older vLLM) or ``reasoning`` (newer vLLM) beside ``content``, or leave
  it inside ``content`` in harmony form; all are handled (see ``Generation.parsed``).
* ``completions``: ``POST {base}/v1/completions`` with the harmony prompt the in-process
  engines get (``core.harmony.render_prompt``), which the server tokenizes with the model's
  own tokenizer, and vLLM's extra parameters that make it answer as they do: special tokens
  kept in the text and the stop token's text at its end, so its channels are parsed as theirs
  are. For a gpt-oss model whose tokenizer is not gpt-oss's (the tiny demo model's): vLLM's
  chat endpoint renders gpt-oss chats with o200k_harmony whatever the model's tokenizer
  (docs/serving.md).

Each request is retried on timeouts, connection errors, HTTP 429 and 5xx, with exponential
backoff (``backoff_s · 2^k``, capped, honouring a numeric ``Retry-After``); other HTTP errors
and malformed bodies are not retried; redirects are not followed (a ``307`` to another host
would send it the question). A reply is read up to ``max_reply_bytes`` and each of its fields
checked (``read_reply``): a bad reply is that response's failure, never the model's. Every
wait is bounded (``EndpointSettings``): an attempt's connect and read timeouts, the request's
total (attempts, backoff and reading the answer) and the model's whole run. A request that
still fails, or that a bound stopped, comes back as a ``Generation`` with ``error`` set. At
most ``concurrency`` requests are in flight.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import requests
from pydantic import ConfigDict, Field

from core.config_model import ConfigModel
from core.harmony import neutralize_control_tokens
from generation.requests import Generation, GenerationRequest, SamplingParams
from generation.vllm import vllm_sampling_kwargs

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
DEFAULT_MAX_REPLY_BYTES = 8 << 20
"""8 MiB: a chat completion of 100k tokens is well under 1 MiB."""


class EndpointSettings(ConfigModel):
    """Client settings for OpenAI-compatible endpoints (vLLM, KServe).

    Every wait is bounded: an attempt by ``connect_timeout_s`` (connecting) and ``timeout_s``
    (each wait for data), a request (its attempts, the waits between them and the reading of
    its answer) by ``request_timeout_s``, and a model's whole run by ``run_timeout_s``: a
    request not answered by then fails with an error that names the bound (the responses
    already in are kept; the eval then fails past ``EvalConfig.max_failure_fraction``).

    Attributes:
        api: ``chat`` (``/v1/chat/completions``: the server renders the chat) or
            ``completions`` (``/v1/completions``: the harmony prompt rendered here, tokenized
            by the model's own tokenizer; vLLM's extra parameters; ``lingo eval --api``).
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
        max_reply_bytes: Largest reply body read (after decompression); a larger one is that
            response's failure, read no further (``--max-reply-bytes``), so that a reply
            cannot take the client's memory (``concurrency`` of them at once at most).
        api_key_env: Environment variable holding the API key (sent as a Bearer token when
            set and non-empty).
        reasoning_effort: Sent as ``reasoning_effort`` when set (vLLM gpt-oss reads it);
            ``None`` leaves the server's default. Chat only: a completions prompt carries
            ``EvalConfig.reasoning_effort`` in its system message.
    """

    model_config = ConfigDict(extra="forbid")

    api: Literal["chat", "completions"] = "chat"
    timeout_s: float = Field(120.0, gt=0)
    connect_timeout_s: float = Field(10.0, gt=0)
    request_timeout_s: float = Field(300.0, gt=0)
    run_timeout_s: float | None = Field(3600.0, gt=0)
    max_retries: int = Field(3, ge=0)
    backoff_s: float = Field(1.0, ge=0)
    max_backoff_s: float = Field(30.0, ge=0)
    concurrency: int = Field(8, ge=1)
    max_reply_bytes: int = Field(DEFAULT_MAX_REPLY_BYTES, ge=1024)
    api_key_env: str = "OPENAI_API_KEY"
    reasoning_effort: Literal["low", "medium", "high"] | None = None


class EndpointError(RuntimeError):
    """The endpoint cannot be used at all (e.g. its model list cannot be read)."""


class _Retryable(Exception):
    """A failure worth retrying: ``args = (message, retry_after_seconds | None)``."""


class _Fatal(Exception):
    """A failure that a retry would repeat (4xx, malformed body)."""


def api_base(url: str) -> str:
    """``http://host:8000``, ``…/v1``, ``…/v1/``, ``…/v1/chat/completions`` or
    ``…/v1/completions`` → ``http://host:8000/v1``."""
    url = url.rstrip("/")
    for path in ("/chat/completions", "/completions"):
        if url.endswith(path):
            url = url[: -len(path)]
            break
    return url if url.endswith("/v1") else url + "/v1"


class EndpointEngine:
    """Client of an OpenAI-compatible endpoint: the requests, their retries and bounds; the
    API (``path``, the request body, the reply) is the subclass's.

    Args:
        url: Base URL of the server (with or without ``/v1``).
        model: Served model name; ``None``: the only model listed by ``GET /v1/models``.
        settings: Timeouts, retries, concurrency, API key variable.

    Raises:
        EndpointError: ``model`` is ``None`` and the model list is unreadable or ambiguous.
    """

    path = ""
    """The API's path under ``…/v1``."""

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

    def _body(self, request: GenerationRequest, sampling: SamplingParams) -> dict:
        """The JSON body of ``request``."""
        raise NotImplementedError

    def _reply(self, data: object) -> Reply:
        """The checked reply of a parsed 200 body (raises as ``read_reply`` does)."""
        raise NotImplementedError

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
            f"{self.base}/{self.path}",
            json=body,
            headers=self.headers,
            timeout=timeout,
            stream=True,
            allow_redirects=False,  # a 307 would send the question (and body) to another host
        )
        with contextlib.closing(response):
            content = _read_by(response, deadline, self.settings.max_reply_bytes)
        if response.status_code in RETRY_STATUS:
            raise _Retryable(
                f"HTTP {response.status_code}: {_excerpt(content)}",
                _retry_after(response.headers.get("Retry-After")),
            )
        if response.status_code >= 400:
            raise _Fatal(f"HTTP {response.status_code}: {_excerpt(content)}")
        if response.status_code != 200:  # 1xx/2xx/3xx other than 200: no completion in it
            raise _Fatal(f"HTTP {response.status_code} is not a completion: {_excerpt(content)}")
        try:
            reply = self._reply(json.loads(content))
        except (ValueError, KeyError, IndexError, TypeError, RecursionError) as err:
            raise _Fatal(
                f"malformed response ({type(err).__name__}: {err}): {_excerpt(content)}"
            ) from None
        return Generation(
            text=reply.text,
            reasoning=reply.reasoning,
            finish_reason=reply.finish_reason,
            completion_tokens=reply.completion_tokens,
            latency_s=time.perf_counter() - began,
            attempts=attempts,
        )

    def close(self) -> None:
        """Nothing to free (sessions close with their threads)."""


class ChatEndpointEngine(EndpointEngine):
    """Client of an OpenAI-compatible ``/v1/chat/completions`` endpoint: the server renders
    ``request.messages`` (``EndpointEngine`` for the arguments)."""

    path = "chat/completions"

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

    def _reply(self, data: object) -> Reply:
        return read_reply(data)


class CompletionsEndpointEngine(EndpointEngine):
    """Client of vLLM's ``/v1/completions``: the prompt is ``request.prompt``, the harmony
    text the in-process engines encode (``core.harmony.render_prompt``), and the server
    tokenizes it with the model's own tokenizer; the reply's text is parsed as theirs is
    (``EndpointEngine`` for the arguments).

    Besides OpenAI's parameters (the same sampling and per-request seed as the chat client's),
    the body carries vLLM's ``add_special_tokens: false`` (the prompt is encoded as the
    in-process engines encode it, nothing added in front), ``skip_special_tokens: false`` and
    ``include_stop_str_in_output: true`` (the harmony channel tokens and the stop token stay
    in the text, as ``generation.vllm.vllm_sampling_kwargs`` asks of the in-process engine).
    The server stops on the model's stop tokens: its tokenizer's eos and its generation
    config's (``<|return|>``, ``<|call|>``), what ``core.harmony.stop_token_ids`` gives the
    in-process engines."""

    path = "completions"

    def __init__(
        self, url: str, model: str | None = None, settings: EndpointSettings | None = None
    ) -> None:
        super().__init__(url, model, settings)
        self.description = f"endpoint:{self.base}/completions (model {self.model})"

    def _body(self, request: GenerationRequest, sampling: SamplingParams) -> dict:
        # the in-process engine's own request (no stop ids of ours: the server's are the model's)
        kwargs = vllm_sampling_kwargs(sampling, request.seed, (), stop_text=True)
        return {
            "model": self.model,
            "prompt": request.prompt,
            "add_special_tokens": False,
            **kwargs,
        }

    def _reply(self, data: object) -> Reply:
        return read_completion_reply(data)


ENDPOINT_APIS: dict[str, type[EndpointEngine]] = {
    "chat": ChatEndpointEngine,
    "completions": CompletionsEndpointEngine,
}
"""``EndpointSettings.api`` → its engine."""


@dataclass(frozen=True)
class Reply:
    """What a completion says, checked: every field its documented type."""

    text: str
    reasoning: str | None
    finish_reason: str | None
    completion_tokens: int | None


def read_reply(data: object) -> Reply:
    """The one choice of a parsed ``/chat/completions`` body, each field checked.

    A reply is the server's (a model's) text, not structure: lone surrogates (which JSON
    allows and UTF-8 cannot hold) become U+FFFD; when the server split the reasoning off
    (``reasoning_content``/``reasoning``), harmony control tokens in the reasoning and the
    answer are neutralised (``core.harmony.neutralize_control_tokens``), so text cannot
    forge a channel; without that split, ``content`` is the raw harmony text and its channels
    are parsed (``Generation.parsed``).

    Raises:
        TypeError, ValueError, KeyError, IndexError: the body is not a chat completion with
            exactly one choice (the request asks for ``n = 1``), a string or null
            ``content``, an object ``usage`` with an integer ``completion_tokens``…; the
            message names the field.
    """
    choice, finish_reason, tokens = _one_choice(data)
    if not isinstance(choice.get("message"), dict):
        raise TypeError("'choices[0].message' is not an object")
    message = choice["message"]
    content = _text_field(message, "content")
    reasoning = _text_field(message, "reasoning_content") or _text_field(message, "reasoning")
    text = _valid_unicode(content or "")
    if reasoning is not None and reasoning.strip():
        reasoning = neutralize_control_tokens(_valid_unicode(reasoning))
        text = neutralize_control_tokens(text)
    else:
        reasoning = None
    return Reply(text, reasoning, finish_reason, tokens)


def read_completion_reply(data: object) -> Reply:
    """The one choice of a parsed ``/completions`` body, each field checked.

    Its ``text`` is the model's own harmony text, special tokens kept (what
    ``CompletionsEndpointEngine`` asks for), as the in-process engines return it: its channels
    are parsed (``Generation.parsed``); lone surrogates become U+FFFD.

    Raises:
        TypeError, ValueError, KeyError, IndexError: the body is not a text completion with
            exactly one choice, a string ``text``, an object ``usage`` with an integer
            ``completion_tokens``…; the message names the field.
    """
    choice, finish_reason, tokens = _one_choice(data)
    text = choice["text"]
    if not isinstance(text, str):
        raise TypeError(f"'choices[0].text' is a {type(text).__name__}, not a string")
    return Reply(_valid_unicode(text), None, finish_reason, tokens)


def _one_choice(data: object) -> tuple[dict, str | None, int | None]:
    """``(choice, finish_reason, usage.completion_tokens)`` of a body with one choice."""
    if not isinstance(data, dict):
        raise TypeError(f"the body is a JSON {type(data).__name__}, not an object")
    choices = data["choices"]
    if not isinstance(choices, list) or len(choices) != 1:
        shown = f"{len(choices)} choices" if isinstance(choices, list) else type(choices).__name__
        raise ValueError(f"'choices' holds {shown}; 1 was asked for (n=1)")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise TypeError("'choices[0]' is not an object")
    finish_reason = choice.get("finish_reason")
    if finish_reason is not None and not isinstance(finish_reason, str):
        raise TypeError(f"'finish_reason' is a {type(finish_reason).__name__}, not a string")
    usage = data.get("usage")
    if usage is not None and not isinstance(usage, dict):
        raise TypeError(f"'usage' is a {type(usage).__name__}, not an object")
    tokens = (usage or {}).get("completion_tokens")
    if tokens is not None and (
        isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0
    ):
        raise TypeError(f"'usage.completion_tokens' is {tokens!r}, not a count")
    return choice, finish_reason and _valid_unicode(finish_reason), tokens


def _text_field(message: dict, key: str) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise TypeError(f"'message.{key}' is a {type(value).__name__}, not a string")
    return value


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _valid_unicode(text: str) -> str:
    """``text`` with lone surrogates replaced by U+FFFD (JSON's ``\\ud800`` is no character)."""
    return _SURROGATE.sub("\ufffd", text)


def _excerpt(content: bytes, limit: int = 200) -> str:
    """The start of a reply body for an error message: decoded, valid Unicode, one line
    (an HTML error page's lines joined)."""
    return " ".join(content[:limit].decode("utf-8", errors="replace").split())


def _read_by(response: requests.Response, deadline: float, max_bytes: int) -> bytes:
    """The body of a streamed response, read by ``deadline`` (a server that trickles its
    answer cannot hold a request past its bound; each read also waits at most the read
    timeout) and up to ``max_bytes`` (decompressed). ``read1`` returns what has arrived, so
    the deadline and the size are checked as bytes come.

    Raises:
        requests.Timeout: the deadline or a read timeout passed before the body was whole.
        requests.ConnectionError: the connection broke off.
        _Fatal: the body is larger than ``max_bytes`` (announced or read).
    """
    import urllib3

    announced = response.headers.get("Content-Length", "")
    if announced.isdigit() and int(announced) > max_bytes:
        raise _Fatal(_too_large(f"announced {int(announced):,} bytes", max_bytes))
    chunks = []
    size = 0
    try:
        while chunk := response.raw.read1(1 << 16, decode_content=True):
            size += len(chunk)
            if size > max_bytes:
                raise _Fatal(_too_large(f"more than {max_bytes:,} bytes", max_bytes))
            chunks.append(chunk)
            if time.monotonic() > deadline:
                raise requests.Timeout("the answer was still coming in when the bound was reached")
    except urllib3.exceptions.ReadTimeoutError as err:
        raise requests.Timeout(str(err)) from err
    except (urllib3.exceptions.ProtocolError, urllib3.exceptions.DecodeError) as err:
        raise requests.ConnectionError(str(err)) from err
    return b"".join(chunks)


def _too_large(what: str, max_bytes: int) -> str:
    return (
        f"reply too large: {what}, the limit is max_reply_bytes={max_bytes:,} "
        "(--max-reply-bytes); read no further"
    )


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None
