"""vLLM scheduler arguments that the eval's vLLM engine and GRPO's vLLM rollout share."""

from __future__ import annotations


def vllm_scheduling_kwargs(
    max_num_batched_tokens: int | None, max_model_len: int, cpu: bool
) -> dict[str, object]:
    """``vllm.LLM`` scheduler arguments: the step's token cap when set, and on vLLM's CPU
    build prompts that are never split.

    There a seeded request that chunked prefill splits crashes the engine ("CPU Generator
    does not use offset": the sampler rewinds the request's generator, which CPU generators
    cannot do), and every request here is seeded. So on CPU chunked prefill is off and a step
    holds at least one whole ``max_model_len`` sequence (vLLM requires it then).
    """
    if cpu:
        budget = max(max_num_batched_tokens or 0, max_model_len)
        return {"enable_chunked_prefill": False, "max_num_batched_tokens": budget}
    return (
        {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    )
