"""``lingo eval``'s call: its options become an ``EvalConfig`` (a value out of range is named
by its option), then ``eval.runner.run_eval``."""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from core.errors import describe_validation_error
from eval.eval_config import EvalConfig
from eval.runner import run_eval
from generation.endpoint import DEFAULT_MAX_REPLY_BYTES


class EvalSettingsError(ValueError):
    """A ``lingo eval`` option out of range (named by its option)."""


CLI_OPTIONS = {
    "engine": "--engine",
    "sampling.temperature": "--temperature",
    "sampling.top_p": "--top-p",
    "sampling.seed": "--seed",
    "sampling.max_tokens": "--max-tokens",
    "sampling.n": "--samples",
    "limit": "--limit",
    "endpoint.api": "--api",
    "endpoint.timeout_s": "--timeout",
    "endpoint.connect_timeout_s": "--connect-timeout",
    "endpoint.request_timeout_s": "--request-timeout",
    "endpoint.run_timeout_s": "--run-timeout",
    "endpoint.max_retries": "--retries",
    "endpoint.max_reply_bytes": "--max-reply-bytes",
}
"""``EvalConfig`` fields → the ``lingo eval`` options that set them (for error messages)."""


def run_eval_cli(
    models: list[str],
    output_dir: str | Path,
    *,
    engine: str = "hf",
    temperature: float = 0.7,
    top_p: float = 0.95,
    max_tokens: int = 512,
    seed: int = 0,
    samples: int = 1,
    batch_size: int = 8,
    device: str = "auto",
    limit: int | None = None,
    languages: list[str] | None = None,
    api: str = "chat",
    timeout_s: float = 120.0,
    connect_timeout_s: float = 10.0,
    request_timeout_s: float = 300.0,
    run_timeout_s: float | None = 3600.0,
    max_retries: int = 3,
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES,
    concurrency: int = 8,
    api_key_env: str = "OPENAI_API_KEY",
    max_failure_fraction: float = 0.1,
) -> Path:
    """What ``lingo eval --model DIR|URL …`` calls: evaluate and return the report's path.

    Args:
        models: ``[label=]DIR`` or ``[label=]URL[#served-name]``, in order (first = baseline).
        output_dir: Where results.json, report.md and report.html go.
        engine: ``hf`` or ``vllm`` for directories (URLs always use the endpoint client).
        temperature: Sampling temperature (0: greedy).
        top_p: Nucleus sampling mass.
        max_tokens: New tokens per response.
        seed: Base seed.
        samples: Samples per question.
        batch_size: HF batch size.
        device: HF device (``auto``, ``cpu``, ``cuda``).
        limit: Only the first N questions.
        languages: Only these languages.
        api: Endpoints: ``chat`` or ``completions`` (``EndpointSettings.api``).
        timeout_s: Endpoint read timeout per attempt.
        connect_timeout_s: Endpoint connect timeout per attempt.
        request_timeout_s: Bound on one endpoint request, its retries included.
        run_timeout_s: Bound on all of a model's endpoint requests (``None``: none).
        max_retries: Endpoint retries per request.
        max_reply_bytes: Largest endpoint reply read; a larger one is that response's failure.
        concurrency: Endpoint requests in flight.
        api_key_env: Environment variable with the endpoint's API key.
        max_failure_fraction: Fail when more responses of a model failed.

    Returns:
        The path of ``report.md``.

    Raises:
        EvalSettingsError: a value out of range, named by its ``lingo eval`` option.
    """
    settings = {
        "engine": engine,
        "sampling": {
            "temperature": temperature,
            "top_p": top_p,
            "max_tokens": max_tokens,
            "seed": seed,
            "n": samples,
        },
        "endpoint": {
            "api": api,
            "timeout_s": timeout_s,
            "connect_timeout_s": connect_timeout_s,
            "request_timeout_s": request_timeout_s,
            "run_timeout_s": run_timeout_s,
            "max_retries": max_retries,
            "max_reply_bytes": max_reply_bytes,
            "concurrency": concurrency,
            "api_key_env": api_key_env,
        },
        "batch_size": batch_size,
        "device": device,
        "limit": limit,
        "languages": languages,
        "max_failure_fraction": max_failure_fraction,
    }
    try:
        config = EvalConfig.model_validate(settings)
    except ValidationError as exc:
        raise EvalSettingsError(describe_validation_error(exc, CLI_OPTIONS)) from None
    run_eval(models, config, output_dir)
    return Path(output_dir) / "report.md"
