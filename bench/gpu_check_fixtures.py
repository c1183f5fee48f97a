"""What the checks of ``bench/gpu_check.py`` share (``gpu_checks``, ``gpu_check_first``): the
tiny model and the bundled data of a work dir, the SFT checks' config, the metrics file as the
Kubeflow SDK reads it, DeepSpeed's presence, and one training step under torchrun. Only the
standard library is imported at module level."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpu_check_base import CheckFailed, CheckSkipped, Sizes, finite

ROOT = Path(__file__).resolve().parents[1]


def fixtures(sizes: Sizes, work: Path) -> tuple[Path, Path]:
    """The tiny model and the prepared bundled data, built once per work dir."""
    from data_prep.config import DataPrepConfig
    from data_prep.prepare import prepare_dataset

    data = work / "data"
    if not (data / "eval.jsonl").is_file():
        tmp = work / ".data.partial"
        tmp.mkdir(parents=True, exist_ok=True)
        config = DataPrepConfig(workers=1)
        prepare_dataset(config, tmp / "train.jsonl", tmp / "eval.jsonl", tmp / "quarantine.jsonl")
        os.replace(tmp, data)
    return tiny_model(work), data


def tiny_model(work: Path) -> Path:
    """The tiny GPT-OSS (``trainer.tiny_model.SMALLEST``), built once per work dir."""
    from trainer.tiny_model import SMALLEST, build_tiny_model

    model = work / "tiny-model"
    if not (model / "config.json").is_file():
        os.replace(build_tiny_model(work / ".tiny-model.partial", SMALLEST), model)
    return model


def checked_metrics(path: str | Path, max_steps: int) -> list[dict]:
    """The metrics file as the Kubeflow SDK reads it: every line with step, max_steps, epoch,
    cumulative wall_time_s; the last step is max_steps; every loss finite."""
    from trainer.metrics import read_metrics

    lines = read_metrics(path)
    if not lines:
        raise CheckFailed(f"{path}: no metrics")
    for number, line in enumerate(lines, 1):
        missing = [k for k in ("step", "max_steps", "epoch", "wall_time_s") if k not in line]
        if missing:
            raise CheckFailed(f"{path}:{number}: lacks {missing}")
    walls = [line["wall_time_s"] for line in lines]
    if walls != sorted(walls):
        raise CheckFailed(f"{path}: wall_time_s goes backwards: {walls}")
    if lines[-1]["step"] != max_steps or lines[-1]["max_steps"] != max_steps:
        raise CheckFailed(f"{path}: last line {lines[-1]} is not step {max_steps} of {max_steps}")
    finite([line["loss"] for line in lines if "loss" in line], f"{path}: loss")
    return lines


def sft_config(sizes: Sizes, **fields):
    """The SFT checks' config: ``sizes``' steps and dtype, 2 examples a micro-batch, a short
    eval and merge check; ``fields`` on top."""
    from trainer.sft.config import SFTConfig

    return SFTConfig.model_validate(
        {
            "max_steps": sizes.sft_steps,
            "micro_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "dtype": sizes.dtype,
            "device": sizes.device,
            "merge_check_prompts": 2,
            "eval_max_examples": 8,
            **fields,
        }
    )


def deepspeed_version() -> tuple[str, dict]:
    """DeepSpeed's version and ``installed_ops``; a skip (a FAIL) when it cannot be imported."""
    try:
        from deepspeed.git_version_info import installed_ops, version
    except ImportError as missing:
        raise CheckSkipped(
            f"DeepSpeed cannot be imported ({missing}): its wheel was not carried "
            "(tools/build_gpu_wheels.py builds it without ops)"
        ) from missing
    return version, installed_ops


def torchrun_step(
    sizes: Sizes, module: str, cfg, base_flag: str, base: Path, out: Path
) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 1 -m <module>`` (``trainer.sft`` / ``trainer.grpo``) with
    ``cfg`` from ``base`` on the bundled data into ``out``; its output goes to this check's
    log and comes back."""
    data = fixtures(sizes, out.parent)[1]
    config = out.with_suffix(".json")
    config.write_text(cfg.model_dump_json())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", "1", "-m", module, "--config", str(config)]
    command += [base_flag, str(base), "--train", str(data / "train.jsonl")]
    command += ["--eval", str(data / "eval.jsonl"), "--model-output", str(out / "model")]
    command += ["--work-dir", str(out / "work")]
    env = {**os.environ, "DS_ACCELERATOR": sizes.device, "DS_BUILD_OPS": "0"}
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        raise CheckFailed(f"torchrun -m {module} exited {done.returncode}")
    return done
