"""The eval's engine for a model location: for a URL, the OpenAI-compatible endpoint client of
the API ``EvalConfig.endpoint.api`` names (chat or completions), else the Hugging Face or vLLM
engine ``EvalConfig.engine`` names. The engines themselves are the
project's one family (``generation.engines``), shared with GRPO's rollouts."""

from __future__ import annotations

from collections.abc import Callable

from eval.eval_config import EvalConfig
from generation.engines import Engine, HFEngine, VLLMEngine, is_endpoint


def _hf_engine(location: str, config: EvalConfig) -> Engine:
    return HFEngine(location, config.device, config.dtype, config.batch_size)


def _vllm_engine(location: str, config: EvalConfig) -> Engine:
    return VLLMEngine(
        location,
        config.dtype,
        config.vllm_gpu_memory_utilization,
        config.vllm_max_num_batched_tokens,
    )


DIRECTORY_ENGINES: dict[str, Callable[[str, EvalConfig], Engine]] = {
    "hf": _hf_engine,
    "vllm": _vllm_engine,
}
"""``EvalConfig.engine`` → the engine that generates with a model directory."""


def make_engine(location: str, config: EvalConfig, served_model: str | None = None) -> Engine:
    """The engine for a model location: an endpoint URL (its ``config.endpoint.api``), or a
    directory with ``config.engine``.

    Raises:
        ModelNotFoundError: A directory that does not exist.
    """
    if is_endpoint(location):
        from generation.endpoint import ENDPOINT_APIS

        return ENDPOINT_APIS[config.endpoint.api](location, served_model, config.endpoint)
    return DIRECTORY_ENGINES[config.engine](location, config)
