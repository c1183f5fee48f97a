"""The checks of ``bench/gpu_check.py``; each runs in a process of its own.

A check returns its figures when it passed and raises when it did not: ``CheckFailed`` for a
result outside its bounds, ``CheckSkipped`` when it cannot run here (reported as a FAIL), any
other exception for a crash. Only the standard library is imported at module level: the rest
may come from the wheels the runner installed.

Checks, in order (``Sizes`` holds the sizes of the full run and of the dry run):

- ``device``: torch, transformers and the accelerator the checks run on.
- ``sft``: LoRA SFT in bf16 on the tiny model; finite losses, a valid metrics file, the merged
  model reloads with plain ``from_pretrained``.
- ``grpo``: GRPO in bf16 with the HF rollout engine, from the SFT model; the same three.
- ``bf16-numerics``: the policy's next-token log-probs (full vocabulary) and GRPO's response
  token log-probs in bf16 against fp32, within the bf16 tolerance of the Megatron precision
  check (``trainer.megatron.verify.TOLERANCES``).
- ``planner`` (``bench/gpu_check_planner.py``): a model with gpt-oss-20b's layer shapes but
  fewer layers (random weights), HF rollouts (tokens/s), then GRPO updates with the settings
  of a one-GPU layout; the peak memory of the measured update against the planner's estimate
  for that layout.
- ``deepspeed``: GRPO through DeepSpeed ZeRO-2 under torchrun, one process.
- ``sft-zero3``: SFT as the gpt-oss-20b preset runs it, DeepSpeed ZeRO-3 with LoRA on
  attention and experts, under torchrun (one process): the model loads partitioned (its log
  line), trains, merges, and the merged model reloads.
- ``mxfp4``: a tiny GPT-OSS in the hub's MXFP4 layout (``tests/mxfp4_checkpoint.py``) loads
  unpacked to bf16 on the device, equal to the matrices it packs, even where transformers
  would keep it packed (its figures say whether ``kernels`` and triton are there).
- ``sync-check``: the weight-sync check calibrated by its noise floor, on the GPU's kernels
  (an HF engine in bf16 beside an fp32 policy): the floor learned before the first sync,
  faithful syncs within the bounds, a sync that leaves the experts stale stopped.
- ``collective-timeout``: the process groups a step creates (torchrun's world, the training
  group of a job with dedicated engines) get the configured timeout, not NCCL's 10 minutes.
- ``routing-replay``: an engine in bf16 on the device's kernels beside the fp32 policy (the HF
  engine; vLLM with ``enable_return_routed_experts`` where vLLM is installed, which the GPU
  image is not): one update without and with ``algorithm.router_replay: rollout``; replaying
  the engine's expert choices must lower ``rollout_kl``.
- the first-GPU checks of issue #39 (``bench/gpu_check_first.py``, ``--first``): ``stack``,
  ``vllm-engine-sync``, ``sync-floor``, ``zero3-parity``, ``megatron-convert`` (in the Megatron
  env).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

from gpu_check_base import Check, CheckFailed, CheckSkipped, DryRunSkip, Sizes, finite
from gpu_check_first import (
    check_megatron_convert,
    check_stack,
    check_sync_floor,
    check_vllm_engine_sync,
    check_zero3_parity,
    zero3_sft_config,
)
from gpu_check_fixtures import (
    checked_metrics,
    deepspeed_version,
    fixtures,
    sft_config,
    torchrun_step,
)
from gpu_check_planner import check_planner

log = logging.getLogger("gpu_check")

ROOT = Path(__file__).resolve().parents[1]


def _reloads(model_dir: str | Path) -> int:
    """Parameters of the exported model, reloaded with plain ``from_pretrained``."""
    from trainer.export_hf import check_loadable

    return check_loadable(model_dir)[1]


def check_device(sizes: Sizes, work: Path) -> dict:
    import torch
    import transformers

    figures = {"torch": torch.__version__, "transformers": transformers.__version__}
    if sizes.device == "cpu":
        return {**figures, "threads": torch.get_num_threads()}
    if not torch.cuda.is_available():
        raise CheckFailed(f"torch {torch.__version__}: torch.cuda.is_available() is False")
    free, total = torch.cuda.mem_get_info()
    return {
        **figures,
        "gpu": torch.cuda.get_device_name(0),
        "cuda": torch.version.cuda,
        "memory_gib": round(total / 2**30, 1),
        "free_gib": round(free / 2**30, 1),
    }


def check_sft(sizes: Sizes, work: Path) -> dict:
    from trainer.sft.recipe import run_sft

    model, data = fixtures(sizes, work)
    cfg = sft_config(sizes)
    started = time.monotonic()
    result = run_sft(
        cfg, model, data / "train.jsonl", data / "eval.jsonl", work / "sft", work / "sft-work"
    )
    seconds = time.monotonic() - started
    lines = checked_metrics(result.metrics_file, sizes.sft_steps)
    losses = [line["loss"] for line in lines if "loss" in line]
    if len(losses) != sizes.sft_steps:
        raise CheckFailed(f"{len(losses)} loss lines for {sizes.sft_steps} steps")
    if result.merge.get("dtype") != sizes.dtype:
        raise CheckFailed(f"merged model dtype {result.merge.get('dtype')}, not {sizes.dtype}")
    return {
        "dtype": sizes.dtype,
        "steps": sizes.sft_steps,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "s_per_step": seconds / sizes.sft_steps,
        "reloaded_params": _reloads(result.model_dir),
    }


def _policy_dir(sizes: Sizes, work: Path) -> tuple[Path, str]:
    """The SFT check's model when it ran, else the tiny model."""
    if (work / "sft" / "config.json").is_file():
        return work / "sft", "sft"
    return fixtures(sizes, work)[0], "tiny"


def _grpo_config(sizes: Sizes, **optim):
    from trainer.grpo.config import GRPOConfig

    return GRPOConfig.model_validate(
        {
            "rollout": {"n_samples": 4, "max_new_tokens": 16},
            "prompts_per_step": 4,
            "mini_batch_size": 16,
            "micro_batch_size": 8,
            "max_steps": sizes.grpo_steps,
            "eval_every": sizes.grpo_steps,
            "eval_prompts": 4,
            "eval_samples": 1,
            "dtype": sizes.dtype,
            "device": sizes.device,
            **({"optim": optim} if optim else {}),
        }
    )


def _grpo_figures(lines: list[dict], steps: int) -> dict:
    train = [line for line in lines if "loss" in line]
    if [line["step"] for line in train] != list(range(1, steps + 1)):
        raise CheckFailed(f"update steps {[line['step'] for line in train]}, not 1..{steps}")
    finite([line["grad_norm"] for line in train], "grad_norm")
    last = train[-1]
    return {
        "steps": steps,
        "loss": last["loss"],
        "grad_norm": last["grad_norm"],
        "mean_reward": last["mean_reward"],
        "rollout_s": last["rollout_time_s"],
        "train_s": last["train_time_s"],
        "tokens_per_s": last["tokens_per_s"],
    }


def check_grpo(sizes: Sizes, work: Path) -> dict:
    from trainer.grpo.recipe import run_grpo

    policy, source = _policy_dir(sizes, work)
    data = fixtures(sizes, work)[1]
    result = run_grpo(
        _grpo_config(sizes),
        policy,
        data / "train.jsonl",
        data / "eval.jsonl",
        work / "grpo",
        work / "grpo-work",
    )
    figures = _grpo_figures(
        checked_metrics(result.metrics_file, sizes.grpo_steps), sizes.grpo_steps
    )
    return {"from": source, **figures, "reloaded_params": _reloads(result.model_dir)}


def check_bf16_numerics(sizes: Sizes, work: Path) -> dict:
    import torch

    from core.modeling import load_causal_lm, load_tokenizer
    from trainer.grpo.micro_batch import micro_log_probs as _log_probs
    from trainer.grpo.micro_batch import sequences as _sequences
    from trainer.grpo.prompts import Prompt
    from trainer.grpo.rollout import Rollout
    from trainer.megatron.verify import (
        TOLERANCES,
        VERIFICATION_PROMPTS,
        compare_logits,
        encode_prompts,
    )

    policy, source = _policy_dir(sizes, work)
    device = torch.device(sizes.device)
    tokenizer = load_tokenizer(policy)
    encoded = encode_prompts(tokenizer, VERIFICATION_PROMPTS)
    # the last 8 tokens of each prompt stand for a response: GRPO's token log-probs of them
    prompts = [Prompt(ids=ids[:-8], label="en", text="") for ids in encoded]
    rollouts = [Rollout(i, ids[-8:], True) for i, ids in enumerate(encoded)]
    micro = _sequences(prompts, rollouts, tokenizer.pad_token_id, device)
    next_token, tokens = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_causal_lm(policy, dtype, device).eval()
        with torch.no_grad():
            rows = [
                model(input_ids=torch.tensor([ids], device=device), logits_to_keep=1).logits[0, -1]
                for ids in encoded
            ]
            next_token[dtype] = torch.log_softmax(torch.stack(rows).float(), dim=-1).cpu()
            tokens[dtype] = _log_probs(model, micro, False)[0].float().cpu()
        del model
    report = compare_logits(
        next_token[torch.float32],
        next_token[torch.bfloat16],
        "bf16",
        names=[p.name for p in VERIFICATION_PROMPTS],
        tokens=[len(ids) for ids in encoded],
    )
    tolerance = TOLERANCES["bf16"]
    mask = micro.mask.cpu() > 0
    token_diff = (tokens[torch.float32] - tokens[torch.bfloat16]).abs()[mask]
    failures = list(report.failures)
    if float(token_diff.max()) > tolerance.max_abs_diff:
        failures.append(f"token log-prob max diff {float(token_diff.max()):.3g}")
    if float(token_diff.mean()) > tolerance.mean_abs_diff:
        failures.append(f"token log-prob mean diff {float(token_diff.mean()):.3g}")
    if failures:
        raise CheckFailed("; ".join(failures))
    return {
        "model": source,
        "next_token_max_abs": report.max_abs_diff,
        "next_token_mean_abs": report.mean_abs_diff,
        "top1": report.top1_agreement,
        "top5": report.topk_agreement,
        "token_logprob_max_abs": float(token_diff.max()),
        "token_logprob_mean_abs": float(token_diff.mean()),
        "tolerance": f"max {tolerance.max_abs_diff} mean {tolerance.mean_abs_diff}",
    }


def check_deepspeed(sizes: Sizes, work: Path) -> dict:
    version, installed_ops = deepspeed_version()
    policy, source = _policy_dir(sizes, work)
    cfg = _grpo_config(sizes, backend="deepspeed", zero_stage=2, learning_rate=1e-6)
    out = work / "grpo-deepspeed"
    torchrun_step(sizes, "trainer.grpo", cfg, "--sft-model", policy, out)
    lines = checked_metrics(out / "work" / "training_metrics.jsonl", sizes.grpo_steps)
    return {
        "deepspeed": version,
        "ops_prebuilt": sum(bool(v) for v in installed_ops.values()),
        "zero_stage": 2,
        "from": source,
        **_grpo_figures(lines, sizes.grpo_steps),
        "reloaded_params": _reloads(out / "model"),
    }


def check_sft_zero3(sizes: Sizes, work: Path) -> dict:
    deepspeed_version()
    cfg = zero3_sft_config(sizes)  # zero3-parity compares this run with one without ZeRO
    out = work / "sft-zero3"
    done = torchrun_step(sizes, "trainer.sft", cfg, "--base-model", fixtures(sizes, work)[0], out)
    loaded = re.findall(r"model loaded (\w+): (\d+) of (\d+) parameters", done.stderr)
    if [how for how, *_ in loaded] != ["partitioned"]:
        raise CheckFailed(f"the model did not load partitioned: {loaded or 'no load line'}")
    lines = checked_metrics(out / "work" / "training_metrics.jsonl", sizes.sft_steps)
    losses = [line["loss"] for line in lines if "loss" in line]
    return {
        "dtype": sizes.dtype,
        "loaded": f"{loaded[0][1]} of {loaded[0][2]}",
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "reloaded_params": _reloads(out / "model"),
    }


def _tests_module(name: str):
    """A helper module of the tests (``tests/<name>.py``), loaded by its path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_mxfp4(sizes: Sizes, work: Path) -> dict:
    import importlib.util

    import torch

    from core.modeling import load_causal_lm

    packer = _tests_module("mxfp4_checkpoint")
    out = work / "mxfp4-model"
    shutil.rmtree(out, ignore_errors=True)
    originals = packer.write_mxfp4_checkpoint(fixtures(sizes, work)[0], out)
    model = load_causal_lm(out, torch.bfloat16, torch.device(sizes.device))
    experts = type(model.model.layers[0].mlp.experts).__name__
    if experts != "GptOssExperts":
        raise CheckFailed(f"the experts loaded as {experts}, not unpacked (GptOssExperts)")
    state = model.state_dict()
    wrong = [n for n, t in originals.items() if not torch.equal(state[n].cpu(), t)]
    if wrong:
        raise CheckFailed(f"dequantized experts differ from the packed matrices: {wrong}")
    if getattr(model.config, "quantization_config", None) is not None:
        raise CheckFailed("the loaded model still carries a quantization_config")
    return {
        "experts": experts,
        "matrices": len(originals),
        "kernels_installed": importlib.util.find_spec("kernels") is not None,
        "triton_installed": importlib.util.find_spec("triton") is not None,
    }


def check_sync_noise(sizes: Sizes, work: Path) -> dict:
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.backends import OptimConfig, make_backend
    from trainer.distributed import DistInfo
    from trainer.grpo.config import RolloutConfig
    from trainer.grpo.prompts import load_prompts
    from trainer.grpo.rollout import HFRolloutEngine
    from trainer.grpo.sync_check import SyncCheck, WeightSyncError, sync_probe
    from trainer.grpo.weight_sync import sync_engine

    model, data = fixtures(sizes, work)
    device = torch.device(sizes.device)
    info = DistInfo(0, 1, 0, device)
    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device)
    backend = make_backend(policy, OptimConfig(learning_rate=1e-2), 4, info, 2, 1)
    engine_model = copy.deepcopy(policy).to(torch.bfloat16).requires_grad_(False)
    engine = HFRolloutEngine(engine_model, tokenizer, RolloutConfig())
    prompts = load_prompts(data / "eval.jsonl", tokenizer, 1024, "all")
    probe = sync_probe([p.ids for p in prompts], 256)
    check, pad = SyncCheck(torch.float32), tokenizer.pad_token_id
    sync_engine(engine, backend, probe, check, pad, info, 0)
    floor = check.floor
    generator = torch.Generator(device=device).manual_seed(0)
    worst = 0.0
    for step in (1, 2):
        with torch.no_grad():
            for param in backend.module.parameters():
                param.add_(torch.randn(param.shape, generator=generator, device=device) * 0.02)
        worst = max(worst, sync_engine(engine, backend, probe, check, pad, info, step).gap.p95)
    with torch.no_grad():
        for name, param in backend.module.named_parameters():
            if ".experts." in name:
                param.add_(torch.randn(param.shape, generator=generator, device=device) * 0.05)
    full = backend.hf_weights
    backend.hf_weights = lambda: ((n, t) for n, t in full() if ".experts." not in n)
    try:
        sync_engine(engine, backend, probe, check, pad, info, 3)
    except WeightSyncError:
        pass
    else:
        raise CheckFailed("a sync that left the experts stale passed the check")
    return {
        "probe_tokens": probe.tokens,
        "floor_mean": floor.mean,
        "floor_p95": floor.p95,
        "floor_max": floor.max,
        "faithful_p95": worst,
        "p95_bound": check.limits()[1],
    }


def check_collective_timeout(sizes: Sizes, work: Path) -> dict:
    import socket
    import textwrap

    script = textwrap.dedent(
        """
        import sys
        from datetime import timedelta
        import torch, torch.distributed as dist
        from trainer.distributed import init_distributed
        device, split, timeout = sys.argv[1], sys.argv[2] == "split", timedelta(seconds=77)
        if split:
            store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
            init_distributed(device, members=[0], store=store, timeout=timeout)
        else:
            init_distributed(device, timeout=timeout)
        backend = dist.group.WORLD._get_backend(torch.device(device))
        print(backend.options._timeout.total_seconds())
        dist.barrier()
        dist.destroy_process_group()
        """
    )
    figures = {}
    for split in ("world", "split"):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        command = [sys.executable, "-c", script, sizes.device, split]
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            raise CheckFailed(f"{split}: exit {done.returncode}: {done.stderr.strip()[-300:]}")
        figures[f"{split}_timeout_s"] = float(done.stdout.split()[-1])
    if set(figures.values()) != {77.0}:
        raise CheckFailed(f"group timeouts {figures}, configured 77 s")
    return figures


def _replay_figures(policy, batch, samples: int) -> dict:
    """``rollout_kl`` and ``router_mismatch_rate`` of one update without and with replay."""
    from routing_replay import update_stats

    out = {}
    for replay in ("off", "rollout"):
        stats = update_stats(policy, batch, replay, samples)
        out[f"rollout_kl_{replay}"] = stats["rollout_kl"]
        out[f"router_mismatch_rate_{replay}"] = stats["router_mismatch_rate"]
    return out


def check_routing_replay(sizes: Sizes, work: Path) -> dict:
    import copy
    import importlib.util

    import torch
    from routing_replay import sampled_batch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.grpo.config import RolloutConfig
    from trainer.grpo.prompts import load_prompts
    from trainer.grpo.rollout import HFRolloutEngine

    model, data = fixtures(sizes, work)
    device = torch.device(sizes.device)
    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device)
    samples = sizes.rollout_samples
    # the HF engine in bf16 on the device's kernels beside the fp32 policy: its routing flips
    engine_model = copy.deepcopy(policy).to(torch.bfloat16).requires_grad_(False)
    engine = HFRolloutEngine(engine_model, tokenizer, RolloutConfig(max_new_tokens=64))
    prompts = load_prompts(data / "eval.jsonl", tokenizer, 1024, "all")[:4]
    batch = sampled_batch(engine, prompts, samples)
    figures = {f"hf_{k}": v for k, v in _replay_figures(policy, batch, samples).items()}
    finite(list(figures.values()), "routing replay (HF engine)")
    if not figures["hf_rollout_kl_rollout"] < figures["hf_rollout_kl_off"]:
        raise CheckFailed(
            f"replaying the bf16 HF engine's routing did not lower rollout_kl: {figures}"
        )
    if importlib.util.find_spec("vllm") is None:
        # the vLLM path (tests/vllm_engines/test_vllm_routing.py, marked gpu) needs vLLM's GPU
        # wheel, which the GPU machine does not have and is too large to carry
        figures["vllm"] = "not installed: the vLLM routing path did not run"
        return figures
    from trainer.grpo.vllm_rollout import VLLMRolloutEngine

    vllm_engine = VLLMRolloutEngine(
        str(model),
        tokenizer,
        RolloutConfig(max_new_tokens=64, gpu_memory_utilization=0.3),
        dtype="bfloat16",
        record_routing=True,
    )
    batch = sampled_batch(vllm_engine, prompts, samples)
    del vllm_engine
    if any(r.routed_experts is None for r in batch.rollouts):
        raise CheckFailed("vLLM returned no routed experts with enable_return_routed_experts")
    vllm_figures = {f"vllm_{k}": v for k, v in _replay_figures(policy, batch, samples).items()}
    if not vllm_figures["vllm_rollout_kl_rollout"] < vllm_figures["vllm_rollout_kl_off"]:
        raise CheckFailed(f"replaying vLLM's bf16 routing did not lower rollout_kl: {vllm_figures}")
    return figures | vllm_figures


CHECKS: dict[str, Check] = {
    "device": Check(check_device, 60, 60),
    "sft": Check(check_sft, 90, 90),
    "grpo": Check(check_grpo, 90, 90),
    "bf16-numerics": Check(check_bf16_numerics, 60, 60),
    "planner": Check(check_planner, 180, 90),
    "deepspeed": Check(check_deepspeed, 120, 240),
    "sft-zero3": Check(check_sft_zero3, 120, 240),
    "mxfp4": Check(check_mxfp4, 60, 120),
    "sync-check": Check(check_sync_noise, 60, 90),
    "collective-timeout": Check(check_collective_timeout, 30, 30),
    "routing-replay": Check(check_routing_replay, 120, 120),
    # the first-GPU checks (issue #39, ``--first``): each within 4 minutes on one H100
    "stack": Check(check_stack, 240, 30),
    "vllm-engine-sync": Check(check_vllm_engine_sync, 240, 30),
    "sync-floor": Check(check_sync_floor, 180, 30),
    "zero3-parity": Check(check_zero3_parity, 240, 150),
    "megatron-convert": Check(check_megatron_convert, 240, 180, env="megatron"),
}
FIRST_CHECKS = ("stack", "vllm-engine-sync", "sync-floor", "zero3-parity", "megatron-convert")
"""What a reviewer runs first on one GPU (``bench/gpu_check.py --first``)."""


def run_check(name: str, sizes: Sizes, args) -> int:
    """Run one check in this process and write its outcome to ``args.result``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    status, figures, detail = "FAIL", {}, ""
    try:
        figures = CHECKS[name].run(sizes, args.work_dir)
        status = "PASS"
    except DryRunSkip as cannot:
        if sizes.device == "cuda":
            detail = f"skipped, which counts as a failure: {cannot}"
        else:  # the CPU dry run: the library cannot run here, and says so
            status, detail = "SKIP", f"skipped: {cannot}"
    except CheckSkipped as skipped:
        detail = f"skipped, which counts as a failure: {skipped}"
    except Exception as error:  # the check's crash is its result
        traceback.print_exc()
        first = (str(error).strip().splitlines() or [""])[0]
        detail = f"{type(error).__name__}: {first}"[:400]
    outcome = {
        "status": status,
        "figures": figures,
        "detail": detail,
    }
    tmp = args.result.with_name(f".{args.result.name}.tmp")
    tmp.write_text(json.dumps(outcome, indent=2))
    os.replace(tmp, args.result)
    return 0 if status == "PASS" else 1
