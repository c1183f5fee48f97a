"""SFT as separate processes: DeepSpeed ZeRO-3 under torchrun, and kill-and-resume."""

import json
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from cluster.torchrun import torchrun_command
from trainer.metrics import read_metrics

pytest.importorskip("deepspeed")

BASE = {
    "lora": {"r": 4, "alpha": 8, "experts": True},
    "max_seq_len": 512,
    "micro_batch_size": 2,
    "merge_check_prompts": 2,
}


def _args(tmp, name, cfg, tiny_model_dir, data):
    config = tmp / f"{name}.json"
    config.write_text(json.dumps(cfg))
    return [
        "--config",
        str(config),
        "--base-model",
        str(tiny_model_dir),
        "--train",
        str(data / "train.jsonl"),
        "--eval",
        str(data / "eval.jsonl"),
        "--model-output",
        str(tmp / name / "model"),
        "--work-dir",
        str(tmp / name / "work"),
    ]


def _losses(tmp, name):
    return [
        (m["step"], m["loss"])
        for m in read_metrics(tmp / name / "work" / "training_metrics.jsonl")
        if "loss" in m
    ]


def _planned_load_per_rank(model_dir, cfg: dict, processes: int) -> float:
    """The capacity check's figure for the parameters an SFT rank holds once loaded."""
    from capacity.model_spec import count_parameters, load_model_spec
    from capacity.training_memory import loaded_parameters
    from trainer.capacity_check import sft_layout
    from trainer.sft.config import SFTConfig

    sft = SFTConfig.model_validate({**cfg, "nproc": processes, "device": "cpu"})
    layout = sft_layout("tiny-cpu", sft, nodes=1, gpus_per_node=processes)
    spec = load_model_spec(model_dir)
    return loaded_parameters(spec, count_parameters(spec), layout)


@pytest.fixture(scope="module")
def wide_experts_dir(tmp_path_factory):
    """A tiny GPT-OSS whose expert weights (4 × 64 × 1024 and 4 × 512 × 64) are larger than
    DeepSpeed's ``stage3_param_persistence_threshold`` (10⁵): ZeRO-3 gathers and releases
    them on every forward, as it does gpt-oss-20b's (the smallest model's stay gathered)."""
    from trainer.tiny_model import SMALLEST, build_tiny_model

    config = SMALLEST.model_copy(update={"intermediate_size": 512})
    return build_tiny_model(tmp_path_factory.mktemp("wide") / "model", config)


def test_deepspeed_zero3_two_processes_follow_the_single_process_run(
    tmp_path, wide_experts_dir, prepared_data
):
    tiny_model_dir = wide_experts_dir  # LoRA on experts that ZeRO-3 fetches every forward
    steps = {"max_steps": 4, "optim": {"learning_rate": 1e-2}}
    single = {**BASE, **steps, "gradient_accumulation_steps": 2}
    zero3 = {
        **BASE,
        **steps,
        "gradient_accumulation_steps": 1,
        "optim": {**steps["optim"], "backend": "deepspeed", "zero_stage": 3},
    }
    subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.sft",
            *_args(tmp_path, "single", single, tiny_model_dir, prepared_data),
        ],
        check=True,
    )
    run = subprocess.run(
        torchrun_command(
            "trainer.sft", _args(tmp_path, "zero3", zero3, tiny_model_dir, prepared_data), 2
        ),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    # each rank loaded its partition only, which is what the capacity check plans for SFT
    loads = re.findall(r"rank (\d): model loaded (\w+): (\d+) of (\d+) parameters", run.stderr)
    planned = _planned_load_per_rank(tiny_model_dir, zero3, 2)
    tensors = len(load_file(tiny_model_dir / "model.safetensors"))
    assert sorted(rank for rank, *_ in loads) == ["0", "1"], run.stderr[-3000:]
    for _, how, held, total in loads:
        assert how == "partitioned" and int(held) < int(total)
        # DeepSpeed pads each tensor's partition: at most one element a tensor on 2 ranks
        assert abs(int(held) - planned) <= tensors, (held, planned)
    a, b = _losses(tmp_path, "single"), _losses(tmp_path, "zero3")
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3, 4]
    for (_, x), (_, y) in zip(a, b, strict=True):
        assert abs(x - y) <= 1e-4 * abs(x), (a, b)
    wa = load_file(tmp_path / "single" / "model" / "model.safetensors")
    wb = load_file(tmp_path / "zero3" / "model" / "model.safetensors")
    for key in wa:
        assert torch.allclose(wa[key], wb[key], atol=1e-4), key
    # only global rank 0 wrote the metrics: one line per step, the final eval merged onto it
    lines = read_metrics(tmp_path / "zero3" / "work" / "training_metrics.jsonl")
    assert [m["step"] for m in lines] == [1, 2, 3, 4] and "eval_loss" in lines[-1]


def test_kill_and_resume_gives_the_same_metrics_as_an_uninterrupted_run(
    tmp_path, tiny_model_dir, prepared_data
):
    cfg = {
        **BASE,
        "gradient_accumulation_steps": 4,
        "max_steps": 8,
        "checkpoint_every": 2,
        "keep_checkpoints": 2,
        "optim": {"learning_rate": 5e-3, "warmup_steps": 2},
    }
    whole = _args(tmp_path, "whole", cfg, tiny_model_dir, prepared_data)
    subprocess.run([sys.executable, "-m", "trainer.sft", *whole], check=True)

    killed = _args(tmp_path, "killed", cfg, tiny_model_dir, prepared_data)
    metrics = tmp_path / "killed" / "work" / "training_metrics.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "trainer.sft", *killed])
    deadline = time.monotonic() + 300  # was 120: at load ~11 main's run passed it unkilled
    while time.monotonic() < deadline and proc.poll() is None:
        if len([m for m in read_metrics(metrics) if "loss" in m]) >= 5:
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (tmp_path / "killed" / "model").exists()
    checkpoints = sorted(p.name for p in (tmp_path / "killed" / "work" / "checkpoints").iterdir())
    assert checkpoints[-1] in ("step-4", "step-6") and len(checkpoints) <= 2
    subprocess.run([sys.executable, "-m", "trainer.sft", *killed], check=True)  # resumes

    expected, resumed = _losses(tmp_path, "whole"), _losses(tmp_path, "killed")
    assert [s for s, _ in resumed] == list(range(1, 9))  # lines after the checkpoint were replaced
    for (_, x), (_, y) in zip(expected, resumed, strict=True):
        assert abs(x - y) <= 1e-6 * abs(x)
    lrs = [m["learning_rate"] for m in read_metrics(metrics) if "loss" in m]
    assert lrs == [
        m["learning_rate"]
        for m in read_metrics(tmp_path / "whole" / "work" / "training_metrics.jsonl")
        if "loss" in m
    ]
    walls = [m["wall_time_s"] for m in read_metrics(metrics)]
    assert walls == sorted(walls)
