"""The ``planner`` check of ``bench/gpu_check.py``: the capacity planner against measured memory.

A model with the layer shapes of a planner preset (gpt-oss-20b on the GPU, the tiny preset
in the dry run) but fewer layers, random bf16 weights built on the device; HF rollouts
(tokens/s); then GRPO updates (``trainer.grpo.update.policy_update`` on ``TorchBackend``) with the
settings of a one-GPU layout. The second update is measured (the first creates the Adam
states): ``torch.cuda.max_memory_allocated`` on CUDA, torch's CPU allocator peak on CPU,
against the planner's tensor terms for the same shapes, layers and layout.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from gpu_check_base import CheckFailed, Sizes, finite

log = logging.getLogger("gpu_check")


def _planner_layout(sizes: Sizes):
    """One training GPU (or CPU process), plain PyTorch (ZeRO-0), bf16, the check's shapes."""
    from capacity.layouts import Layout
    from cluster.nodes import H200_GIB

    return Layout(
        name="gpu-check-one-device",
        device=sizes.device,
        nodes=1,
        gpus_per_node=1,
        gpu_memory_gib=H200_GIB,
        host_memory_gib=128.0 if sizes.device == "cuda" else 24.0,
        backend="deepspeed",
        zero_stage=0,
        training_gpus=1,
        rollout_gpus=0,
        dtype="bf16",
        micro_train_batch_size=sizes.micro_batch,
        prompt_max_len=sizes.prompt_len,
        generate_max_len=sizes.generate_len,
        gradient_checkpointing=True,
        attn_implementation="eager",
        kl=False,
    )


def _planner_model(sizes: Sizes):
    """The preset's layer shapes with ``planner_layers`` layers, random bf16 weights on the
    device (built here: nothing is downloaded)."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    from capacity.model_presets import MODEL_PRESETS

    layers = sizes.planner_layers
    config = {
        **MODEL_PRESETS[sizes.planner_model],
        "num_hidden_layers": layers,
        "layer_types": [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
        ],
    }
    hf_fields = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype")}
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(sizes.device):
            model = GptOssForCausalLM(GptOssConfig(**hf_fields, attn_implementation="eager"))
    finally:
        torch.set_default_dtype(default)
    model.generation_config.eos_token_id = config["vocab_size"] - 1
    model.gradient_checkpointing_enable()
    return config, model.train()


def _random_ids(generator, count: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    ids = torch.randint(1, vocab - 1, (count, length), generator=generator)
    return ids.tolist()


def _synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def check_planner(sizes: Sizes, work: Path) -> dict:
    import torch

    from capacity.estimate import estimate
    from capacity.measured import cpu_allocator_peak, tensor_bytes
    from capacity.quantities import GIB
    from core.seeds import group_seeds
    from trainer.backends import TorchBackend
    from trainer.grpo.config import GRPOConfig, RolloutConfig
    from trainer.grpo.prompts import Prompt
    from trainer.grpo.rollout import HFRolloutEngine, Rollout
    from trainer.grpo.update import Batch, policy_update

    config, model = _planner_model(sizes)
    layout = _planner_layout(sizes)
    planned = estimate(config, layout)
    params = sum(p.numel() for p in model.parameters())
    if params != planned.parameters.total:
        raise CheckFailed(
            f"model has {params} parameters, the planner counts {planned.parameters.total}"
        )
    vocab, generator = config["vocab_size"], torch.Generator().manual_seed(0)

    # HF rollouts: tokens/s of the engine GRPO uses without vLLM
    tokenizer = type(
        "Ids", (), {"pad_token_id": 0, "eos_token_id": vocab - 1, "get_vocab": lambda self: {}}
    )()
    engine = HFRolloutEngine(
        model,
        tokenizer,
        RolloutConfig(n_samples=sizes.rollout_samples, max_new_tokens=sizes.rollout_new_tokens),
    )
    prompts = _random_ids(generator, sizes.rollout_prompts, sizes.prompt_len, vocab)
    _synchronize(sizes.device)
    started = time.monotonic()
    seeds = group_seeds(0, "gpu-check", range(len(prompts)), sizes.rollout_samples)
    sampled = engine.generate(prompts, seeds)
    _synchronize(sizes.device)
    rollout_s = time.monotonic() - started
    rollout_tokens = sum(len(r.response_ids) for r in sampled)
    del engine, sampled

    # GRPO updates with the layout's settings: micro-batches of full-length rows
    m = sizes.micro_batch
    cfg = GRPOConfig.model_validate(
        {
            # the update takes the batch built below (its own advantages); n_samples only
            # has to be a valid group size (>= 2) dividing into mini_batch_size
            "rollout": {"n_samples": 2, "max_new_tokens": sizes.generate_len},
            "algorithm": {"filter_no_signal_groups": False},
            "prompts_per_step": m,
            "mini_batch_size": m,
            "micro_batch_size": m,
            "max_steps": 2,
            "dtype": "bfloat16",
            "device": sizes.device,
            "gradient_checkpointing": True,
        }
    )
    backend = TorchBackend(model, cfg.optim, total_steps=2)

    def batch() -> Batch:
        ids = _random_ids(generator, 2 * m, sizes.prompt_len, vocab)
        prompts = [Prompt(ids=row, label="en", text="") for row in ids[:m]]
        rollouts = [Rollout(i, row[: sizes.generate_len], False) for i, row in enumerate(ids[m:])]
        advantages = torch.tensor([1.0 if i % 2 else -1.0 for i in range(m)])
        return Batch(prompts, rollouts, advantages.clone(), advantages, torch.ones(m), [])

    first = policy_update(cfg, backend, batch(), 0, 0)  # creates the Adam states: steady state next
    measured_batch = batch()
    state = tensor_bytes(model.parameters()) + tensor_bytes(
        v for s in backend.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    grads = tensor_bytes(p for p in model.parameters() if p.requires_grad)
    stats: dict = {}

    def update() -> None:
        stats.update(policy_update(cfg, backend, measured_batch, 0, 1))

    if sizes.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        started = time.monotonic()
        update()
        torch.cuda.synchronize()
        update_s = time.monotonic() - started
        peak = torch.cuda.max_memory_allocated()
        reserved = torch.cuda.max_memory_reserved()
    else:
        started = time.monotonic()
        peak = state + cpu_allocator_peak(update)
        update_s = time.monotonic() - started
        reserved = peak
    finite([first["loss"], stats["loss"], stats["grad_norm"]], "update loss / grad norm")

    rank = planned.resource("training_gpu")
    overhead = ("cuda_runtime", "fragmentation", "process")
    tensors = [t for t in rank.terms if t.key not in overhead]
    low = sum(t.bytes.low for t in tensors)
    expected = sum(t.bytes.expected for t in tensors)
    high = sum(t.bytes.high for t in tensors)
    planned_state = sum(
        t.bytes.expected for t in tensors if t.key in ("weights", "gradients", "optimizer")
    )
    figures = {
        "model": f"{sizes.planner_model} shapes, {sizes.planner_layers} layers",
        "params_b": round(params / 1e9, 3),
        "tokens": f"{m}x({sizes.prompt_len}+{sizes.generate_len})",
        "peak_gib": peak / GIB,
        "planner_gib": f"{low / GIB:.2f}/{expected / GIB:.2f}/{high / GIB:.2f}",
        "ratio": peak / expected,
        "state_gib": (state + grads) / GIB,
        "planner_state_gib": planned_state / GIB,
        "transient_gib": (peak - state - grads) / GIB,
        "planner_transient_gib": (expected - planned_state) / GIB,
        "reserved_gib": reserved / GIB,
        "planner_total_gib": rank.total.expected / GIB,
        "rollout_tokens_per_s": rollout_tokens / rollout_s,
        "update_tokens_per_s": m * (sizes.prompt_len + sizes.generate_len) / update_s,
    }
    log.info("planner check: %s", figures)
    if peak > high:
        raise CheckFailed(
            f"measured peak {peak / GIB:.2f} GiB above the planner's high bound "
            f"{high / GIB:.2f} GiB (ratio {peak / expected:.2f}): the planner underestimates"
        )
    return figures
