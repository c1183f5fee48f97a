"""Settings of the 50-question eval: sampling, engines, endpoint client, failure threshold.

One typed model, validated once at the edge (CLI, component, notebook); its defaults are the
reference recipe's sampling parameters.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from core.config_model import ConfigModel

DEFAULT_PERSONA = "You are a helpful assistant who solves word problems."
"""The fixed persona line after ``reasoning language: <Name>`` in the developer instructions."""


class SamplingSettings(ConfigModel):
    """Sampling parameters, recorded with the results.

    Attributes:
        temperature: 0 means greedy decoding.
        top_p: Nucleus sampling mass.
        max_tokens: New tokens per response (analysis + final).
        seed: Base seed; sample ``k`` of question ``q`` uses its own seed
            ``core.seeds.sample_seed(seed, "eval", q, k)`` (vLLM and endpoints per request,
            HF with one generator per row), never shared by two responses.
        n: Samples per question (for variance).
    """

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(0.7, ge=0.0, le=2.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    max_tokens: int = Field(512, ge=1)
    seed: int = 0
    n: int = Field(1, ge=1)


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


class EvalConfig(ConfigModel):
    """Everything an eval run needs besides the models.

    Attributes:
        engine: Engine for model directories (``hf`` or ``vllm``); URLs always use the
            OpenAI-compatible endpoint client.
        sampling: Sampling parameters.
        endpoint: Endpoint client settings.
        batch_size: Prompts per ``generate`` call (HF engine).
        device: ``auto`` (CUDA when present), ``cpu`` or ``cuda[:i]`` (HF engine).
        dtype: ``auto`` (bf16 on a GPU that has it, else fp32), ``float32`` or ``bfloat16``.
        persona: The persona line of the developer instructions.
        reasoning_effort: The harmony system message's ``Reasoning:`` level (rendered prompts).
        questions: A JSONL file in the eval_50 schema; ``None``: the bundled eval_50.jsonl.
        languages: Only questions in these languages; ``None``: all.
        limit: Only the first ``limit`` questions (after the language filter); ``None``: all.
        max_failure_fraction: The run fails when a model's failed responses exceed this share.
        vllm_gpu_memory_utilization: vLLM's share of GPU memory.
        vllm_max_num_batched_tokens: vLLM's cap on the tokens of one scheduler step
            (``None``: vLLM's default; on vLLM's CPU build at least the model's length, as
            prompts are never split there: ``core.vllm_scheduling.vllm_scheduling_kwargs``).
    """

    model_config = ConfigDict(extra="forbid")

    engine: Literal["hf", "vllm"] = "hf"
    sampling: SamplingSettings = Field(default_factory=SamplingSettings)
    endpoint: EndpointSettings = Field(default_factory=EndpointSettings)
    batch_size: int = Field(8, ge=1)
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    persona: str = DEFAULT_PERSONA
    reasoning_effort: Literal["low", "medium", "high"] = "medium"
    questions: str | None = None
    languages: list[str] | None = None
    limit: int | None = Field(None, ge=1)
    max_failure_fraction: float = Field(0.1, ge=0.0, le=1.0)
    vllm_gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    vllm_max_num_batched_tokens: int | None = Field(None, ge=16)
