"""vLLM, in one place for every engine that runs it (the eval's, GRPO's colocated and
dedicated rollout engines): the lazy import with the extra to install, the engine's model
and scheduler arguments, the stop tokens, one request's sampling arguments, and the text of a
completion.

``vllm`` is imported inside the functions that need it: the base install is CPU-only
without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from core.harmony import stop_token_ids
from core.modeling import load_generation_config
from generation.requests import SamplingParams


def import_llm(hint: str):
    """``vllm.LLM``, or an ``ImportError`` that says what to install (``hint``: which engine
    setting needs it and what to use instead)."""
    try:
        from vllm import LLM
    except ImportError as exc:
        raise ImportError(hint) from exc
    return LLM


def on_cpu() -> bool:
    """vLLM runs on its CPU build here (``current_platform``)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


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


def vllm_model_kwargs(
    model_dir: str | Path,
    dtype: str,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int | None,
    sequence_len: int,
    cpu: bool,
) -> dict[str, object]:
    """The ``vllm.LLM`` arguments every engine gives: the model, its dtype, vLLM's share of
    GPU memory and the scheduler's (``vllm_scheduling_kwargs`` for sequences of
    ``sequence_len`` tokens)."""
    kwargs: dict[str, object] = {
        "model": str(model_dir),
        "dtype": dtype,
        "gpu_memory_utilization": gpu_memory_utilization,
    }
    return kwargs | vllm_scheduling_kwargs(max_num_batched_tokens, sequence_len, cpu)


def vllm_stop_ids(tokenizer, model_dir: str | Path) -> list[int]:
    """The stop tokens of a vLLM engine serving ``model_dir`` (``core.harmony.stop_token_ids``
    with the model's saved generation config, which vLLM reads too; vLLM would otherwise stop
    on its generation config's eos ids only)."""
    return stop_token_ids(tokenizer, load_generation_config(model_dir))


def vllm_sampling_kwargs(
    sampling: SamplingParams,
    seed: int,
    stop_ids: Sequence[int],
    *,
    logprobs: bool = False,
    stop_text: bool = False,
) -> dict[str, object]:
    """``vllm.SamplingParams`` keyword arguments of one request: one response (``n=1``) with
    its own seed (``SamplingParams(n=k, seed=s)`` would seed sample ``i`` as ``s + i``, so one
    seed for every prompt would make sample ``i`` of all prompts share a stream), the stop
    tokens, special tokens kept.

    Args:
        sampling: Temperature, nucleus mass, token limit.
        seed: The request's seed (``core.seeds.sample_seed``).
        stop_ids: The engine's stop tokens (``vllm_stop_ids``).
        logprobs: Return the sampled token's own log-prob, of what the engine's
            ``logprobs_mode`` says (rollout engines: ``processed_logprobs``, the tempered
            distribution, ``trainer.grpo.vllm_rollout.VLLM_BEHAVIOUR_LOGPROBS``): rollouts
            record the behaviour policy's.
        stop_text: Keep the stop token's text in the output text (the eval reads text).
    """
    kwargs: dict[str, object] = {
        "n": 1,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
        "seed": seed,
        "stop_token_ids": list(stop_ids),
        "skip_special_tokens": False,
    }
    if stop_text:
        kwargs["include_stop_str_in_output"] = True
    if logprobs:
        kwargs["logprobs"] = 0
    return kwargs


def completion_text(completion, tokenizer, stop_ids: Sequence[int]) -> str:
    """A completion's text, ending with its stop token's text when it stopped on one and the
    text does not already end with it (the eval reads the stop token from the text)."""
    text = completion.text
    if completion.finish_reason == "stop" and completion.token_ids:
        last = completion.token_ids[-1]
        if last in stop_ids and not text.endswith(tokenizer.decode([last])):
            text += tokenizer.decode([last])
    return text


class VLLMGenerator:
    """A vLLM engine this process drives (the eval's ``VLLMEngine``, GRPO's rollout engines):
    the engine, its tokenizer and stop tokens, and one call that samples a response per seed.

    Args:
        llm: The ``vllm.LLM`` (built from ``vllm_model_kwargs`` and the caller's own).
        model_dir: The model it serves (its generation config gives stop tokens).
        tokenizer: The tokenizer prompts are encoded with (None: the engine's own).
    """

    def __init__(self, llm, model_dir: str | Path, tokenizer=None) -> None:
        self.llm = llm
        self.model_dir = str(model_dir)
        self.tokenizer = llm.get_tokenizer() if tokenizer is None else tokenizer
        self.stop_ids = vllm_stop_ids(self.tokenizer, model_dir)
        self.quantization = llm.llm_engine.model_config.quantization
        """``model_config.quantization`` (vLLM reads it from the model's
        ``quantization_config``; ``mxfp4`` for the hub's gpt-oss), None when unquantized."""

    def complete(
        self,
        prompts: Sequence[Sequence[int]],
        seeds: Sequence[int],
        sampling: SamplingParams,
        *,
        logprobs: bool = False,
        stop_text: bool = False,
    ) -> list:
        """One completion (``vllm.CompletionOutput``) per prompt, prompt ``i`` sampled with
        ``seeds[i]`` (``vllm_sampling_kwargs``: ``logprobs``, ``stop_text``), in order."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
        params = [
            VLLMSamplingParams(
                **vllm_sampling_kwargs(
                    sampling, seed, self.stop_ids, logprobs=logprobs, stop_text=stop_text
                )
            )
            for seed in seeds
        ]
        results = self.llm.generate(requests, params, use_tqdm=False)
        return [result.outputs[0] for result in results]
