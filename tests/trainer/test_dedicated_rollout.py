"""Dedicated (non-hybrid) rollout engines: rollout-only processes driven over
torch.distributed (trainer/grpo/remote.py), on CPU with gloo and the HF engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from tests_helpers_trainer import small_grpo_config

from trainer.distributed import DistInfo
from trainer.grpo.config import GRPOConfig
from trainer.grpo.recipe import run_placement
from trainer.grpo.remote import _flat, _unflat, buckets, engine_slots
from trainer.launch import torchrun_command
from trainer.metrics import METRICS_FILE, read_metrics
from trainer.placement import PlacementError

ROOT = Path(__file__).resolve().parents[2]
DEDICATED = {"rollout": {"n_samples": 4, "max_new_tokens": 16, "colocate": False, "num_engines": 1}}


def test_prompt_slots_tile_the_engines():
    shares = [list(engine_slots(10, 3, e)) for e in range(3)]
    assert shares == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert [len(engine_slots(2, 3, e)) for e in range(3)] == [1, 1, 0]


def test_weight_buckets_are_bounded_ordered_and_round_trip():
    tensors = [
        ("a", torch.arange(6, dtype=torch.float32).view(2, 3)),
        ("b", torch.ones(3, dtype=torch.bfloat16)),
        ("c", torch.arange(40, dtype=torch.float32)),  # 160 bytes: a bucket of its own
        ("d", torch.tensor([7], dtype=torch.int64)),
    ]
    out = list(buckets(iter(tensors), bucket_bytes=64))
    assert [[name for name, _ in b] for b in out] == [["a", "b"], ["c"], ["d"]]
    back = [item for bucket in out for item in _unflat(*_flat(bucket, torch.device("cpu")))]
    assert [n for n, _ in back] == ["a", "b", "c", "d"]
    for (_, want), (_, got) in zip(tensors, back, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)


def _info(world: int) -> DistInfo:
    return DistInfo(0, world, 0, torch.device("cpu"))


def test_dedicated_placement_and_what_is_refused(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    cfg = GRPOConfig.model_validate(
        small_grpo_config(rollout={**DEDICATED["rollout"], "num_engines": 2})
    )
    assert (cfg.nproc, cfg.rollout_processes) == (1, 2)
    plan = run_placement(cfg, _info(3))
    assert plan.training_ranks == (0,) and plan.rollout_only_ranks == (1, 2)
    assert [e.ranks for e in plan.engines] == [(1,), (2,)]
    with pytest.raises(PlacementError, match="leave 2 training processes"):
        run_placement(cfg, _info(4))
    # vLLM engines too (each started by its rollout process: tests/vllm_engines)
    vllm = small_grpo_config(rollout={**DEDICATED["rollout"], "engine": "vllm", "num_engines": 2})
    plan = run_placement(GRPOConfig.model_validate(vllm), _info(3))
    assert plan.rollout_only_ranks == (1, 2) and [e.ranks for e in plan.engines] == [(1,), (2,)]
    # an engine of TP 2 beside the one trainer would cross a node (engines are TP-aligned)
    vllm["rollout"] |= {"num_engines": 1, "tensor_parallel_size": 2}
    with pytest.raises(PlacementError, match="the first dedicated engine would cross a node"):
        run_placement(GRPOConfig.model_validate(vllm), _info(3))
    ds = small_grpo_config(**DEDICATED, optim={"backend": "deepspeed"})
    with pytest.raises(PlacementError, match="optim.backend=deepspeed with dedicated"):
        run_placement(GRPOConfig.model_validate(ds), _info(2))


def _launch(tmp_path, name, cfg, model, data, nproc) -> subprocess.Popen:
    GRPOConfig.model_validate(cfg)
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps(cfg))
    args = ["--config", str(config), "--sft-model", str(model)]
    args += ["--train", str(data / "train.jsonl"), "--eval", str(data / "eval.jsonl")]
    args += ["--model-output", str(tmp_path / name / "model")]
    args += ["--work-dir", str(tmp_path / name / "work")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.Popen(
        torchrun_command("trainer.grpo", args, nproc),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _losses(tmp_path, name):
    lines = read_metrics(tmp_path / name / "work" / METRICS_FILE)
    return [m for m in lines if "loss" in m]


def test_one_trainer_and_one_engine_process_train_like_one_process(
    tmp_path, tiny_model_dir, prepared_data
):
    steps = {"max_steps": 2, "checkpoint_every": 0}
    alone = _launch(tmp_path, "alone", small_grpo_config(**steps), tiny_model_dir, prepared_data, 1)
    assert alone.wait(timeout=600) == 0, alone.stdout.read()[-3000:]
    cfg = small_grpo_config(**steps, **DEDICATED)
    split = _launch(tmp_path, "split", cfg, tiny_model_dir, prepared_data, 2)
    assert split.wait(timeout=600) == 0, split.stdout.read()[-3000:]
    ours, theirs = _losses(tmp_path, "split"), _losses(tmp_path, "alone")
    assert [m["step"] for m in ours] == [1, 2]
    # the same seeds on a copy of the same weights: the same rollouts, the same updates
    for a, b in zip(ours, theirs, strict=True):
        assert a["mean_reward"] == b["mean_reward"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    # the engine's copy matches the policy after every sync (float32: bit-for-bit forwards)
    assert all(m["sync_logprob_max_diff"] < 1e-5 for m in ours)
    assert (tmp_path / "split" / "model" / "config.json").exists()


def _rank_pid(root: int, rank: int) -> int | None:
    """The pid of torchrun's worker ``rank`` among ``root``'s descendants (its environment
    says RANK=rank)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    family, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in family} - family
        family |= more
        grew = bool(more)
    for pid in sorted(family - {root}):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    return None


def test_a_killed_engine_process_ends_the_job_non_zero(tmp_path, tiny_model_dir, prepared_data):
    cfg = small_grpo_config(max_steps=50, checkpoint_every=0, **DEDICATED)
    job = _launch(tmp_path, "killed", cfg, tiny_model_dir, prepared_data, 2)
    metrics = tmp_path / "killed" / "work" / METRICS_FILE
    deadline = time.monotonic() + 300
    while not (metrics.exists() and _losses(tmp_path, "killed")):
        assert job.poll() is None and time.monotonic() < deadline, "no step in 300 s"
        time.sleep(1)
    engine = _rank_pid(job.pid, 1)
    assert engine is not None
    os.kill(engine, signal.SIGKILL)
    killed = time.monotonic()
    assert job.wait(timeout=120) != 0  # torchrun ends the trainer too
    assert time.monotonic() - killed < 120
