"""The first-GPU checks of ``bench/gpu_check.py`` (issue #39): what a reviewer runs first on
one GPU, each within 4 minutes on an H100 (``python3 bench/gpu_check.py --first``).

- ``stack``: the node's NVIDIA driver against the R580 that vllm 0.33's ``_C``
  (``libcudart.so.13``) needs (``core.image_checks.driver_problem``), the GPU image's own
  checks (``core.image_checks.check_gpu_image``), a one-GPU NCCL all-reduce, and one
  DeepSpeed CPU Adam step timed at ``OMP_NUM_THREADS`` 1 and 16 (each in a process of its
  own: the op's OpenMP reads the variable when it starts).
- ``vllm-engine-sync``: a dedicated vLLM engine (``trainer.grpo.vllm_dedicated``) with CUDA
  graphs and torch.compile on (vLLM's default, ``enforce_eager=False``); every weight group
  of the policy perturbed and synced through the project's transfer, twice; the engine's
  log-probs of a 256-token probe must leave the policy's while stale and come back within the
  sync check's bounds (``trainer.grpo.weight_sync.sync_engine``).
- ``sync-floor``: the sync check's noise floor of the HF policy in bf16 with eager attention
  (the trainer's GPT-OSS kernel) against vLLM in bf16, on a 256-token probe of the eval split,
  against ``trainer.grpo.sync_check.FLOOR_CEILING``: the floor a run learns before step 1.
- ``zero3-parity``: SFT with LoRA on attention and experts under DeepSpeed ZeRO-3 at
  DeepSpeed's default ``stage3_param_persistence_threshold`` (torchrun, one process) against
  the same SFT without ZeRO (plain PyTorch): step losses and grad norms agree.
- ``megatron-convert``: in the Megatron env, a 2-layer GPT-OSS of gpt-oss-20b's dimensions
  (attention sinks, sliding window) converted with ``convert_hf_to_megatron`` and checked with
  ``trainer.megatron.verify.verify_conversion``.

Where the library cannot run on a CPU (NCCL, vLLM's CUDA graphs) the dry run reports the part
or the check as ``skipped: needs CUDA`` (``NeedsCuda``); each check's decision is a pure
function of its figures, tested in ``tests/bench/test_gpu_check_first.py``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from gpu_check_base import CheckFailed, CheckSkipped, NeedsCuda, NeedsMegatronEnv, Sizes, finite

log = logging.getLogger("gpu_check")

ROOT = Path(__file__).resolve().parents[1]

MIN_ADAM_SPEEDUP = 2.0
"""The least speed-up of a CPU Adam step at 16 OpenMP threads over 1 that shows the
variable reaches the op (a 16-core node gives ~8×; 1× means the threads do not help)."""
PROBE_TOKENS = 256


# --- 1. the stack ----------------------------------------------------------------------------


def driver_verdict(found: tuple[str, str] | None, minimum: int) -> tuple[str, str | None]:
    """``(what was found, problem or None)`` for the node's driver: ``core.image_checks``'s
    rule, and no driver at all is a problem here (the check runs on a GPU)."""
    from core.image_checks import driver_problem

    if found is None:
        return "none", "no NVIDIA driver found (/proc/driver/nvidia/version, nvidia-smi, NVML)"
    return f"{found[0]} ({found[1]})", driver_problem(found, minimum)


def adam_speedup_problem(one: float, many: float, threads: int, cpus: int) -> str | None:
    """Why CPU Adam's step at ``threads`` OpenMP threads (``many`` s) against 1 (``one`` s) is
    wrong; None when fine. The speed-up is held to ``MIN_ADAM_SPEEDUP`` only where the node
    has the cores (``cpus`` ≥ ``threads`` ≥ 8)."""
    if not (math.isfinite(one) and math.isfinite(many) and one > 0 and many > 0):
        return f"CPU Adam step times not positive and finite: {one}, {many}"
    if threads >= 8 and cpus >= threads and one / many < MIN_ADAM_SPEEDUP:
        return (
            f"CPU Adam at OMP_NUM_THREADS={threads} is only {one / many:.2f}× faster than at 1 "
            f"({many:.3g} s vs {one:.3g} s, {cpus} CPUs): OpenMP's threads do not reach the op"
        )
    return None


_ADAM_SCRIPT = """
import json, sys, time, torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
n, steps = int(sys.argv[1]), int(sys.argv[2])
param = torch.nn.Parameter(torch.randn(n, generator=torch.Generator().manual_seed(0)))
param.grad = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-3
adam = DeepSpeedCPUAdam([param], lr=1e-3, adamw_mode=True)
adam.step()  # builds the states
times = []
for _ in range(steps):
    started = time.perf_counter()
    adam.step()
    times.append(time.perf_counter() - started)
print(json.dumps({"s": sorted(times)[len(times) // 2], "finite": bool(param.isfinite().all())}))
"""


def _time_cpu_adam(threads: int, elements: int, steps: int) -> float:
    """The median seconds of one DeepSpeed CPU Adam step over ``elements`` fp32 parameters, in
    a process started with ``OMP_NUM_THREADS=threads``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "DS_ACCELERATOR": "cpu"}
    command = [sys.executable, "-c", _ADAM_SCRIPT, str(elements), str(steps)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CheckFailed(f"CPU Adam at OMP_NUM_THREADS={threads}: exit {done.returncode}: {tail}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["finite"]:
        raise CheckFailed(f"CPU Adam at OMP_NUM_THREADS={threads}: non-finite parameters")
    return float(result["s"])


def _nccl_all_reduce(megabytes: int) -> dict:
    """A one-rank NCCL group on GPU 0: ``megabytes`` of fp32 all-reduced (sum over one rank
    is the tensor itself), timed."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group(
        "nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60),
        device_id=torch.device("cuda", 0),
    )  # fmt: skip
    try:
        tensor = torch.arange(megabytes * 2**18, dtype=torch.float32, device="cuda")
        expected = tensor.clone()
        dist.all_reduce(tensor)  # warm-up: the communicator is built here
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(5):
            dist.all_reduce(tensor)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - started) / 5
        if not torch.equal(tensor, expected):
            raise CheckFailed("NCCL all-reduce over one rank changed the tensor")
        return {"nccl": torch.cuda.nccl.version(), "nccl_all_reduce_ms": seconds * 1e3}
    finally:
        dist.destroy_process_group()


def check_stack(sizes: Sizes, work: Path) -> dict:
    if sizes.device != "cuda":
        raise NeedsCuda(
            "the driver and NCCL; DeepSpeed's cpu_adam op is compiled just in time, over 10 "
            "minutes on a 2-core runner"
        )
    from core.image_checks import MIN_DRIVER_FOR_CUDA, check_gpu_image, nvidia_driver_version

    if not _importable("deepspeed"):
        raise CheckSkipped("DeepSpeed cannot be imported: its wheel was not carried")
    problems: list[str] = []
    minimum = MIN_DRIVER_FOR_CUDA[13]
    driver, problem = driver_verdict(nvidia_driver_version(), minimum)
    figures: dict = {"driver": driver, "driver_needed": f"R{minimum}"}
    problems += [problem] if problem else []
    image = check_gpu_image()
    figures["image_checks"] = "passed" if not image else f"{len(image)} problems"
    problems += [f"core.image_checks gpu: {p}" for p in image]
    figures |= _nccl_all_reduce(256)
    threads, elements = 16, 200_000_000
    one = _time_cpu_adam(1, elements, 3)
    many = _time_cpu_adam(threads, elements, 3)
    figures |= {
        "adam_params_m": elements / 1e6,
        "adam_s_omp1": one,
        f"adam_s_omp{threads}": many,
        "adam_speedup": one / many,
        "cpus": os.cpu_count(),
    }
    problem = adam_speedup_problem(one, many, threads, os.cpu_count() or 1)
    problems += [problem] if problem else []
    if problems:
        raise CheckFailed("; ".join(problems))
    return figures


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# --- 2. and 3. vLLM ---------------------------------------------------------------------------


def engine_mode_problems(enforce_eager: bool, cudagraph_mode: str, compile_mode: str) -> list[str]:
    """Why a vLLM engine does not run as the rollouts do (CUDA graphs and torch.compile on)."""
    problems = []
    if enforce_eager:
        problems.append("enforce_eager=True: the engine runs without CUDA graphs")
    if cudagraph_mode.upper().endswith("NONE"):
        problems.append(f"cudagraph_mode {cudagraph_mode}: no CUDA graphs")
    if compile_mode.upper().endswith("NONE"):
        problems.append(f"compilation mode {compile_mode}: no torch.compile")
    return problems


def follow_problems(rounds: list[dict], p95_limit: float) -> list[str]:
    """Why the engine did not follow the policy: each round's ``stale_p95`` (perturbed policy,
    engine not yet synced) must be past ``p95_limit`` (else the round proves nothing) and its
    ``synced_p95`` within it."""
    problems = []
    for number, gaps in enumerate(rounds, 1):
        if not gaps["stale_p95"] > p95_limit:
            problems.append(
                f"round {number}: the perturbed policy is only {gaps['stale_p95']:.3g} nats "
                f"(p95) from the stale engine, within the bound {p95_limit:.3g}: the probe "
                "cannot see a sync"
            )
        if not gaps["synced_p95"] <= p95_limit:
            problems.append(
                f"round {number}: after the sync the engine is {gaps['synced_p95']:.3g} nats "
                f"(p95) from the policy, past the bound {p95_limit:.3g}: it did not take "
                "the weights"
            )
    return problems


def floor_verdict(mean: float, p95: float, tokens: int, dtype: str) -> tuple[float, str | None]:
    """``(ceiling, problem or None)``: the sync check's own rule for a floor learned before
    step 1 (``SyncCheck.learn_floor``: mean and p95 within ``FLOOR_CEILING`` dtype floors)."""
    import torch

    from trainer.grpo.sync_check import FLOOR_CEILING, SyncCheck, SyncGap, WeightSyncError

    check = SyncCheck(getattr(torch, dtype))
    ceiling = FLOOR_CEILING * check.allowance
    try:
        check.learn_floor(SyncGap(mean, p95, max(mean, p95), tokens), "vLLM")
    except WeightSyncError as error:
        return ceiling, str(error)
    return ceiling, None


def _require_vllm_on_cuda(sizes: Sizes) -> None:
    if sizes.device != "cuda":
        raise NeedsCuda("vLLM with CUDA graphs and torch.compile")
    if not _importable("vllm"):
        raise CheckSkipped("vLLM is not installed: run this check in the GPU image")


def _vllm_fixtures(sizes: Sizes, work: Path):
    """The tiny GPT-OSS with 64-wide heads (vLLM's attention kernels), its tokenizer, a
    256-token probe of the eval split."""
    _require_vllm_on_cuda(sizes)
    from gpu_check_fixtures import fixtures
    from transformers import AutoTokenizer

    from trainer.grpo.prompts import load_prompts
    from trainer.grpo.sync_check import sync_probe
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    data = fixtures(sizes, work)[1]
    model = work / "vllm-tiny-model"
    if not (model / "config.json").is_file():
        shape = TinyModelConfig(head_dim=64, num_attention_heads=2, num_key_value_heads=1)
        os.replace(build_tiny_model(work / ".vllm-tiny-model.partial", shape), model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = load_prompts(data / "eval.jsonl", tokenizer, 1024, "all")
    return model, tokenizer, sync_probe([p.ids for p in prompts], PROBE_TOKENS)


def _policy_backend(model: Path, dtype, info):
    """The policy as the trainer holds it: HF, eager attention, on the device, in a
    ``TorchBackend`` (whose ``hf_weights`` a sync sends and ``log_probs`` the probe reads)."""
    from transformers import AutoModelForCausalLM

    from trainer.backends import OptimConfig, make_backend

    policy = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="eager")
    return make_backend(policy.to(info.device), OptimConfig(), 4, info, 1, 1)


def _engine_mode(llm) -> dict:
    """How the engine runs, from its resolved ``VllmConfig`` (``LLM.llm_engine.vllm_config``):
    eager or not, and the names of its CUDA-graph and compilation modes (enums)."""
    config = llm.llm_engine.vllm_config
    graphs, compiled = config.compilation_config.cudagraph_mode, config.compilation_config.mode
    return {
        "enforce_eager": bool(config.model_config.enforce_eager),
        "cudagraph_mode": getattr(graphs, "name", str(graphs)),
        "compile_mode": getattr(compiled, "name", str(compiled)),
    }


def check_vllm_engine_sync(sizes: Sizes, work: Path) -> dict:
    model, tokenizer, probe = _vllm_fixtures(sizes, work)
    import torch

    from trainer.distributed import DistInfo
    from trainer.grpo.config import RolloutConfig
    from trainer.grpo.sync_check import SyncCheck
    from trainer.grpo.vllm_dedicated import DedicatedVLLMEngine
    from trainer.grpo.weight_sync import probe_gap, sync_engine

    info = DistInfo(0, 1, 0, torch.device(sizes.device))
    backend = _policy_backend(model, torch.bfloat16, info)
    cfg = RolloutConfig(max_new_tokens=16, gpu_memory_utilization=0.3)
    started = time.monotonic()
    engine = DedicatedVLLMEngine(str(model), tokenizer, cfg, dtype="bfloat16")
    # one GPU holds the sender and the engine's worker, and NCCL refuses two ranks of one
    # communicator on one GPU: the weights go over the project's gloo transport (lingo_gloo,
    # ``weight_transfer.GlooSender``), as from a trainer without vLLM (``select_transfer``)
    engine.transport = "gloo"
    figures = {"engine_start_s": time.monotonic() - started, **_engine_mode(engine.llm)}
    figures["transport"] = "lingo_gloo"
    try:
        problems = engine_mode_problems(
            figures["enforce_eager"], figures["cudagraph_mode"], figures["compile_mode"]
        )
        check, pad = SyncCheck(torch.bfloat16), tokenizer.pad_token_id
        sync_engine(engine, backend, probe, check, pad, info, 0)
        rounds = []
        for step in (1, 2):
            generator = torch.Generator(device=info.device).manual_seed(step)
            with torch.no_grad():  # every weight group: embeddings … experts, sinks, head
                for param in backend.module.parameters():
                    noise = torch.randn(param.shape, generator=generator, device=info.device)
                    param.add_(noise.to(param.dtype) * 0.05)
            stale = probe_gap(engine, backend, probe, pad, info)
            sent = engine.sync_weights(backend.hf_weights())
            synced = probe_gap(engine, backend, probe, pad, info)
            rounds.append({"stale_p95": stale.p95, "synced_p95": synced.p95, "bytes": sent})
        problems += follow_problems(rounds, check.limits()[1])
    finally:
        engine.close()
    if problems:
        raise CheckFailed("; ".join(problems))
    return {
        **figures,
        "probe_tokens": probe.tokens,
        "floor_p95": check.floor.p95,
        "p95_bound": check.limits()[1],
        "stale_p95": [round(r["stale_p95"], 4) for r in rounds],
        "synced_p95": [round(r["synced_p95"], 4) for r in rounds],
        "sync_mib": rounds[-1]["bytes"] / 2**20,
    }


def check_sync_floor(sizes: Sizes, work: Path) -> dict:
    model, tokenizer, probe = _vllm_fixtures(sizes, work)
    import torch

    from trainer.distributed import DistInfo
    from trainer.grpo.config import RolloutConfig
    from trainer.grpo.sync_check import FLOOR_CEILING
    from trainer.grpo.vllm_rollout import VLLMRolloutEngine
    from trainer.grpo.weight_sync import probe_gap

    info = DistInfo(0, 1, 0, torch.device(sizes.device))
    backend = _policy_backend(model, torch.bfloat16, info)
    cfg = RolloutConfig(max_new_tokens=16, gpu_memory_utilization=0.3)
    engine = VLLMRolloutEngine(str(model), tokenizer, cfg, dtype="bfloat16")
    gap = probe_gap(engine, backend, probe, tokenizer.pad_token_id, info)
    ceiling, problem = floor_verdict(gap.mean, gap.p95, gap.tokens, "bfloat16")
    if problem:
        raise CheckFailed(problem)
    return {
        "probe_tokens": gap.tokens,
        "hf_attention": backend.module.config._attn_implementation,
        "floor_mean": gap.mean,
        "floor_p95": gap.p95,
        "floor_max": gap.max,
        "ceiling": ceiling,
        "ceiling_rule": f"FLOOR_CEILING {FLOOR_CEILING:g} x bf16 tolerance",
        **_engine_mode(engine.llm),
    }


# --- 4. ZeRO-3 against no ZeRO -----------------------------------------------------------------


def parity_problems(
    reference: list[dict], zero3: list[dict], loss_rtol: float, grad_rtol: float
) -> list[str]:
    """Where the ZeRO-3 run's step losses and grad norms leave the reference run's (metrics
    lines with ``step``, ``loss``, ``grad_norm``) by more than the relative tolerances."""
    problems = []
    ref = {line["step"]: line for line in reference if "loss" in line}
    got = {line["step"]: line for line in zero3 if "loss" in line}
    if sorted(ref) != sorted(got) or not ref:
        return [f"steps differ: reference {sorted(ref)}, ZeRO-3 {sorted(got)}"]
    for step in sorted(ref):
        for key, rtol in (("loss", loss_rtol), ("grad_norm", grad_rtol)):
            a, b = ref[step][key], got[step][key]
            if not (math.isfinite(a) and math.isfinite(b)) or abs(a - b) > rtol * abs(a):
                problems.append(f"step {step} {key}: ZeRO-3 {b:.6g}, without ZeRO {a:.6g}")
    return problems


def zero3_sft_config(sizes: Sizes, backend: str = "deepspeed"):
    """SFT as the gpt-oss-20b preset runs it, small: LoRA r 8 on attention and experts,
    ZeRO-3 (``backend`` deepspeed) or plain PyTorch (``torch``), one example a step."""
    from gpu_check_fixtures import sft_config

    optim = {"backend": backend, "learning_rate": 1e-3}
    if backend == "deepspeed":
        optim["zero_stage"] = 3
    return sft_config(
        sizes,
        lora={"r": 8, "alpha": 16, "experts": True},
        optim=optim,
        gradient_accumulation_steps=1,
    )


def persistence_threshold(cfg, base: Path) -> int:
    """The ``stage3_param_persistence_threshold`` DeepSpeed runs the SFT step's ZeRO-3 at: the
    trainer's ``zero_optimization`` (``deepspeed_config`` with ``gather_windows``) parsed by
    DeepSpeed's own ``DeepSpeedZeroConfig``; it must be DeepSpeed's default (not set)."""
    import torch
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from trainer.backends.deepspeed import deepspeed_config
    from trainer.zero3 import gather_windows

    zero = deepspeed_config(cfg.optim, torch.device("cpu"), 1, 1, False, gather_windows(base))
    zero = zero["zero_optimization"]
    if "stage3_param_persistence_threshold" in zero:
        value = zero["stage3_param_persistence_threshold"]
        raise CheckFailed(f"stage3_param_persistence_threshold is set ({value}), not the default")
    return int(DeepSpeedZeroConfig(**zero).param_persistence_threshold)


def check_zero3_parity(sizes: Sizes, work: Path) -> dict:
    from gpu_check_fixtures import checked_metrics, deepspeed_version, fixtures, torchrun_step

    from trainer.sft.recipe import run_sft

    deepspeed_version()
    base, data = fixtures(sizes, work)
    zero3 = work / "sft-zero3"  # the sft-zero3 check's run, when it ran with this config
    cfg = zero3_sft_config(sizes)
    config_file = zero3.with_suffix(".json")
    ran = config_file.is_file() and config_file.read_text() == cfg.model_dump_json()
    if not (ran and (zero3 / "work" / "training_metrics.jsonl").is_file()):
        zero3 = work / "zero3-parity"
        torchrun_step(sizes, "trainer.sft", cfg, "--base-model", base, zero3)
    threshold = persistence_threshold(cfg, base)
    reference = work / "sft-no-zero"
    done = run_sft(
        zero3_sft_config(sizes, "torch"), base, data / "train.jsonl", None,
        reference / "model", reference / "work",
    )  # fmt: skip
    steps = sizes.sft_steps
    ref_lines = checked_metrics(done.metrics_file, steps)
    zero_lines = checked_metrics(zero3 / "work" / "training_metrics.jsonl", steps)
    bf16 = sizes.dtype == "bfloat16"
    loss_rtol, grad_rtol = (2e-2, 5e-2) if bf16 else (1e-4, 1e-3)
    problems = parity_problems(ref_lines, zero_lines, loss_rtol, grad_rtol)
    if problems:
        raise CheckFailed("; ".join(problems))
    ref = {line["step"]: line for line in ref_lines if "loss" in line}
    zero = {line["step"]: line for line in zero_lines if "loss" in line}
    losses = [(ref[step]["loss"], zero[step]["loss"]) for step in sorted(ref)]
    grads = [(ref[step]["grad_norm"], zero[step]["grad_norm"]) for step in sorted(ref)]
    finite([v for pair in losses + grads for v in pair], "losses and grad norms")
    return {
        "steps": steps,
        "persistence_threshold": threshold,
        "loss_no_zero": [round(a, 5) for a, _ in losses],
        "loss_zero3": [round(b, 5) for _, b in losses],
        "grad_norm_no_zero": [round(a, 5) for a, _ in grads],
        "grad_norm_zero3": [round(b, 5) for _, b in grads],
    }


# --- 5. the Megatron image's conversion ---------------------------------------------------------


def _megatron_source(sizes: Sizes, work: Path) -> tuple[Path, dict]:
    """The HF model to convert: on the GPU gpt-oss-20b's dimensions with 2 layers (one sliding,
    one full attention, sinks in both; random bf16 weights built on the GPU), in the dry run
    the tiny GPT-OSS; the tiny model's tokenizer beside it."""
    import shutil

    import torch
    from gpu_check_fixtures import tiny_model
    from transformers import AutoTokenizer, GptOssConfig, GptOssForCausalLM

    from capacity.model_presets import MODEL_PRESETS

    tiny = tiny_model(work)
    keys = ("num_hidden_layers", "hidden_size", "num_local_experts", "sliding_window")
    if sizes.dry_run:
        config = json.loads((tiny / "config.json").read_text())
        return tiny, {k: config[k] for k in keys}
    out = work / "megatron-source"
    preset = {**MODEL_PRESETS["gpt-oss-20b"], "num_hidden_layers": 2}
    preset["layer_types"] = ["sliding_attention", "full_attention"]
    fields = {k: v for k, v in preset.items() if k not in ("architectures", "torch_dtype")}
    if not (out / "config.json").is_file():
        shutil.rmtree(out, ignore_errors=True)
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("cuda"):
                model = GptOssForCausalLM(GptOssConfig(**fields))
        finally:
            torch.set_default_dtype(default)
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
        del model
        torch.cuda.empty_cache()
    return out, {k: preset[k] for k in keys}


def check_megatron_convert(sizes: Sizes, work: Path) -> dict:
    import contextlib
    import importlib.util
    import shutil

    if importlib.util.find_spec("megatron") is None:
        raise NeedsMegatronEnv("megatron-core cannot be imported in this Python")
    import torch

    patches = contextlib.nullcontext()
    if sizes.device == "cpu":  # the round-trip tests' CPU patches (tests/megatron/cpu_patches.py)
        sys.path.insert(0, str(ROOT / "tests" / "megatron"))
        import cpu_patches

        cpu_patches.import_megatron_bridge()
        patches = cpu_patches.cpu_patches()
    from trainer.megatron.bridge import convert_hf_to_megatron
    from trainer.megatron.layout import MegatronLayout
    from trainer.megatron.verify import verify_conversion

    hf_dir, shape = _megatron_source(sizes, work)
    dtype = "fp32" if sizes.dry_run else "bf16"
    out = work / "megatron-converted"
    shutil.rmtree(out, ignore_errors=True)
    with patches:
        started = time.monotonic()
        convert_hf_to_megatron(str(hf_dir), str(out), MegatronLayout(params_dtype=dtype))
        converted = time.monotonic() - started
        report = verify_conversion(
            hf_dir, out, dtype=dtype, report_path=work / "megatron-verification.md",
            device=sizes.device,
        )  # fmt: skip
    return {
        **shape,
        "dtype": dtype,
        "transformer_engine": _version("transformer-engine") or "none",
        "gpu": torch.cuda.get_device_name(0) if sizes.device == "cuda" else "cpu",
        "convert_s": converted,
        "max_abs_diff": report.max_abs_diff,
        "mean_abs_diff": report.mean_abs_diff,
        "top1": report.top1_agreement,
    }


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None
