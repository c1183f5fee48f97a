"""Dedicated (non-hybrid) rollout engines: rollout-only processes driven over
torch.distributed (trainer/grpo/remote.py), on CPU with gloo and the HF engine."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tests_helpers_trainer import (
    grpo_cli_args,
    grpo_step_lines,
    kill_job,
    small_grpo_config,
    subprocess_env,
)

from cluster.torchrun import torchrun_command
from trainer.distributed import DistInfo
from trainer.grpo.config import GRPOConfig
from trainer.grpo.remote import _unflat, buckets, engine_slots, flatten_bucket
from trainer.metrics import METRICS_FILE
from trainer.placement import PlacementError, run_placement

DEDICATED = {"rollout": {"n_samples": 4, "max_new_tokens": 16, "colocate": False, "num_engines": 1}}
ASYNC = {"rollout": {**DEDICATED["rollout"], "async_steps": 1}}


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
    back = [
        item for bucket in out for item in _unflat(*flatten_bucket(bucket, torch.device("cpu")))
    ]
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
    with pytest.raises(PlacementError, match="leave 2 training processes, not nproc=1"):
        run_placement(cfg, _info(4))
    two = GRPOConfig.model_validate(
        small_grpo_config(**DEDICATED, nproc=2, micro_batch_size=4, optim={"backend": "deepspeed"})
    )
    plan = run_placement(two, _info(3))  # several training processes: DeepSpeed's world
    assert plan.training_ranks == (0, 1) and plan.rollout_only_ranks == (2,)
    # vLLM engines too (each started by its rollout process: tests/vllm_engines)
    vllm = small_grpo_config(rollout={**DEDICATED["rollout"], "engine": "vllm", "num_engines": 2})
    plan = run_placement(GRPOConfig.model_validate(vllm), _info(3))
    assert plan.rollout_only_ranks == (1, 2) and [e.ranks for e in plan.engines] == [(1,), (2,)]
    # an engine of TP 2 beside the one trainer would cross a node (engines are TP-aligned)
    vllm["rollout"] |= {"num_engines": 1, "tensor_parallel_size": 2}
    with pytest.raises(PlacementError, match="the first dedicated engine would cross a node"):
        run_placement(GRPOConfig.model_validate(vllm), _info(3))
    # beside two trainers it fits: ranks 2 and 3 of the node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    vllm |= {"nproc": 2, "micro_batch_size": 4, "optim": {"backend": "deepspeed"}}
    plan = run_placement(GRPOConfig.model_validate(vllm), _info(4))
    assert [e.ranks for e in plan.engines] == [(2, 3)]
    # Megatron trains on the first processes: its parallel state is built over the training
    # processes' default group (tests/megatron/test_megatron_dedicated_rollout.py runs it)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    megatron = {"backend": "megatron", "megatron": {"layout": "tiny-cpu"}}
    mc = small_grpo_config(**DEDICATED, optim=megatron)
    plan = run_placement(GRPOConfig.model_validate(mc), _info(2))
    assert plan.training_ranks == (0,) and plan.rollout_only_ranks == (1,)


def _launch(tmp_path, name, cfg, model, data, nproc) -> subprocess.Popen:
    return subprocess.Popen(
        torchrun_command("trainer.grpo", grpo_cli_args(tmp_path, name, cfg, model, data), nproc),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _trained(tmp_path, name, cfg, model, data, nproc) -> list[dict]:
    """Run the job to its end; its step lines."""
    job = _launch(tmp_path, name, cfg, model, data, nproc)
    assert job.wait(timeout=600) == 0, job.stdout.read()[-3000:]
    return grpo_step_lines(tmp_path, name)


def test_one_trainer_and_one_engine_process_train_like_one_process(
    tmp_path, tiny_model_dir, prepared_data
):
    steps = {"max_steps": 2, "checkpoint_every": 0}
    theirs = _trained(
        tmp_path, "alone", small_grpo_config(**steps), tiny_model_dir, prepared_data, 1
    )
    cfg = small_grpo_config(**steps, **DEDICATED)
    ours = _trained(tmp_path, "split", cfg, tiny_model_dir, prepared_data, 2)
    assert [m["step"] for m in ours] == [1, 2]
    # the same seeds on a copy of the same weights: the same rollouts, the same updates
    for a, b in zip(ours, theirs, strict=True):
        assert a["mean_reward"] == b["mean_reward"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    # the engine's copy matches the policy after every sync (float32: bit-for-bit forwards)
    assert all(m["sync_logprob_max_diff"] < 1e-5 for m in ours)
    assert (tmp_path / "split" / "model" / "config.json").exists()


ZERO3_TWO_TRAINERS = {
    "max_steps": 2,
    "checkpoint_every": 0,
    "nproc": 2,
    "micro_batch_size": 4,
    "optim": {"backend": "deepspeed", "zero_stage": 3},
}
"""Two DeepSpeed ZeRO-3 training processes, 2 steps."""


SLOW_ENGINE = """
import os, runpy, sys, time
from datetime import timedelta

from trainer.grpo import channels, engines, remote

build = engines.rollout_only_engine


def slow(*args, **kwargs):  # an engine that starts late (vLLM at 20B: minutes)
    store = channels.job_store()
    channels.wait_until_ready(store, [0], timedelta(minutes=10), "trainers")  # they wait now
    time.sleep(float(os.environ["SLOW_ENGINE_S"]))
    return build(*args, **kwargs)


engines.rollout_only_engine = slow
sys.argv[0] = "trainer.grpo"
runpy.run_module("trainer.grpo", run_name="__main__")
"""


@pytest.fixture(scope="module")
def two_trainers_and_a_slow_engine(tmp_path_factory, tiny_model_dir, prepared_data):
    """Two ZeRO-3 trainers and one dedicated engine (``torchrun --nproc_per_node 3``) with
    15-s collective timeouts, the engine starting to build 25 s after the trainers are ready;
    and the same two trainers colocated (each sampling its share itself). One run of each
    serves both tests below: the run directory, the dedicated job's stderr, and the step
    lines of the dedicated run and of the colocated one."""
    pytest.importorskip("deepspeed")
    run_dir = tmp_path_factory.mktemp("two-trainers")
    colocated = small_grpo_config(**ZERO3_TWO_TRAINERS)
    theirs = _trained(run_dir, "colocated", colocated, tiny_model_dir, prepared_data, 2)
    cfg = small_grpo_config(
        **ZERO3_TWO_TRAINERS,
        collective_timeout_s=15,
        rollout={**DEDICATED["rollout"], "start_timeout_s": 300},
    )
    script = run_dir / "slow_engine.py"
    script.write_text(SLOW_ENGINE)
    args = grpo_cli_args(run_dir, "split", cfg, tiny_model_dir, prepared_data)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=3", str(script), *args]
    done = subprocess.run(
        command,
        env={**subprocess_env(), "SLOW_ENGINE_S": "25"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir, done.stderr, grpo_step_lines(run_dir, "split"), theirs


def test_two_deepspeed_training_processes_and_one_engine_train_like_colocated(
    two_trainers_and_a_slow_engine,
):
    """Several training processes with dedicated engines: the trainers' default group holds
    only them (DeepSpeed ZeRO-3 partitions over 2), the coordinator drives the engine over
    a channel of its own and hands each trainer its share; the same seeds give the same
    rollouts as each trainer sampling its share itself, so the same updates (a late engine
    and shorter collective timeouts change when, not what)."""
    run_dir, _, ours, theirs = two_trainers_and_a_slow_engine
    assert [m["step"] for m in ours] == [1, 2]
    for a, b in zip(ours, theirs, strict=True):
        assert a["mean_reward"] == pytest.approx(b["mean_reward"], abs=1e-6)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
    assert all(m["sync_logprob_max_diff"] < 1e-5 for m in ours)
    assert (run_dir / "split" / "model" / "config.json").exists()


def test_a_slow_starting_engine_does_not_time_the_trainers_out(two_trainers_and_a_slow_engine):
    """Two ZeRO-3 trainers, 15-s collective timeouts, and an engine that starts building 25 s
    after the trainers are ready. The coordinator's first message waits for the engine; had
    the other trainer gone on, it would have sat in a ZeRO-3 gather with the coordinator past
    its group's timeout and died. Both wait in the job's store, outside every collective,
    for longer than that timeout, and the run trains."""
    _, stderr, ours, _ = two_trainers_and_a_slow_engine
    waits = re.findall(r"waited ([0-9.]+) s for rollout processes", stderr)
    assert len(waits) == 2 and min(float(w) for w in waits) > 15  # both, past the timeout
    assert [m["step"] for m in ours] == [1, 2]


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


@pytest.mark.parametrize(
    ("placement", "killed_rank"),
    [(DEDICATED, 1), (ASYNC, 1), (ASYNC, 0)],
    ids=["engine-sync", "engine-async", "trainer-async"],
)
def test_a_killed_process_ends_the_job_non_zero(
    tmp_path, tiny_model_dir, prepared_data, placement, killed_rank
):
    """Either side dying mid-run (the engine, or the trainer with a request in flight) ends
    the whole job, non-zero, within a bounded time: nobody waits forever on the other."""
    cfg = small_grpo_config(max_steps=50, checkpoint_every=0, **placement)
    job = _launch(tmp_path, "killed", cfg, tiny_model_dir, prepared_data, 2)
    metrics = tmp_path / "killed" / "work" / METRICS_FILE
    deadline = time.monotonic() + 300
    while not (metrics.exists() and grpo_step_lines(tmp_path, "killed")):
        assert job.poll() is None and time.monotonic() < deadline, "no step in 300 s"
        time.sleep(1)
    victim = _rank_pid(job.pid, killed_rank)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    assert job.wait(timeout=120) != 0  # torchrun ends the other side too
    assert time.monotonic() - killed < 120


def test_a_trainer_failing_before_the_engines_are_ready_ends_the_job(
    tmp_path, tiny_model_dir, prepared_data
):
    """The trainer fails while the engine process still waits in the store for it (here: a
    train file that is not JSON). The job ends at once, non-zero, with the trainer's error;
    it used to wait forever: the trainer's way out told the engines to stop with a
    collective on the channel, which the engine process, not yet in one, never joined."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("not json\n")
    (data / "eval.jsonl").write_text((prepared_data / "eval.jsonl").read_text())
    cfg = small_grpo_config(max_steps=2, checkpoint_every=0, **ASYNC)
    job = _launch(tmp_path, "bad", cfg, tiny_model_dir, data, 2)
    try:
        out, _ = job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        kill_job(job)
        job.wait()
        pytest.fail("the job still runs 120 s after its trainer failed")
    assert job.returncode != 0
    assert "train.jsonl" in out, out[-3000:]


def test_one_step_off_policy_overlaps_and_corrects_the_stale_batches(
    tmp_path, tiny_model_dir, prepared_data
):
    # with routing replay: the engine's routing crosses to the trainer with its rollouts
    replay = {"algorithm": {"router_replay": "rollout"}}
    cfg = small_grpo_config(max_steps=3, checkpoint_every=0, eval_every=3, **ASYNC, **replay)
    lines = _trained(tmp_path, "async", cfg, tiny_model_dir, prepared_data, 2)
    assert [m["staleness"] for m in lines] == [0, 1, 1]
    # on-policy: no correction (the engine holds the policy's weights: every ratio 1)
    assert lines[0]["importance_ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert lines[0]["tis_clipped_fraction"] == 0 and lines[0]["rollout_kl"] < 1e-9
    for m in lines:  # the engine's routing came back, and was compared and replayed
        assert 0 <= m["router_mismatch_rate"] < 0.05
    for m in lines[1:]:  # sampled one update ago: the decoupled loss and its weights
        assert m["rollout_kl"] > lines[0]["rollout_kl"]  # the one-update lag
        assert 0.5 < m["importance_ratio_mean"] < 2.0
        assert m["importance_ratio_max"] >= m["importance_ratio_mean"]
        assert 0.0 <= m["tis_clipped_fraction"] <= 1.0
        # the engine took each update's weights (float32: bit-for-bit forwards)
        assert m["sync_logprob_max_diff"] < 1e-5
    for m in lines:
        assert m["rollout_idle_s"] >= 0 and m["rollout_wait_s"] >= 0
        assert m["rollout_time_s"] > 0 and m["train_time_s"] > 0
    assert "eval_mean_reward" in lines[-1]
    assert (tmp_path / "async" / "model" / "config.json").exists()


@pytest.mark.slow  # ~2 min on a busy 2-core machine; test_producer covers the order of requests
def test_dynamic_sampling_with_one_step_off_policy(tmp_path, tiny_model_dir, prepared_data):
    """``async_steps: 1`` with DAPO's dynamic sampling: each step's rounds run on the dedicated
    engine before the next step starts (``RolloutProducer.resample``), and the stale batches,
    fresh groups mixed in, train with the rollout correction."""
    ds = {"algorithm": {"dynamic_sampling": {"enabled": True, "max_resample_rounds": 2}}}
    cfg = small_grpo_config(max_steps=3, checkpoint_every=0, **ASYNC, **ds)
    lines = _trained(tmp_path, "async-ds", cfg, tiny_model_dir, prepared_data, 2)
    assert [m["staleness"] for m in lines] == [0, 1, 1]
    for m in lines:
        rounds = m["dynamic_sampling/rounds"]
        assert m["dynamic_sampling/sampled_groups"] == 4 * (1 + rounds)
        assert m["no_signal_fraction"] == pytest.approx(m["dynamic_sampling/unfilled_groups"] / 4)
        assert math.isfinite(m["loss"])
    assert sum(m["dynamic_sampling/rounds"] for m in lines) > 0
    for m in lines[1:]:  # stale: the decoupled loss's weights; the engine took each update
        assert 0.5 < m["importance_ratio_mean"] < 2.0
        assert m["sync_logprob_max_diff"] < 1e-5


def test_kill_and_resume_with_a_batch_in_flight_matches_an_uninterrupted_run(
    tmp_path, tiny_model_dir, prepared_data
):
    """``async_steps: 1``: the checkpoint at step 2 holds step 3's rollouts (sampled before
    the checkpoint's weights); the resumed run trains on them, so every step matches."""
    cfg = small_grpo_config(max_steps=5, checkpoint_every=2, max_ckpt_num=2, **ASYNC)
    theirs = _trained(tmp_path, "whole", cfg, tiny_model_dir, prepared_data, 2)
    job = _launch(tmp_path, "killed", cfg, tiny_model_dir, prepared_data, 2)
    deadline = time.monotonic() + 300
    while job.poll() is None and time.monotonic() < deadline:
        metrics = tmp_path / "killed" / "work" / METRICS_FILE
        if metrics.exists() and len(grpo_step_lines(tmp_path, "killed")) >= 3:
            kill_job(job)  # the whole job, as a node loss would
            break
        time.sleep(0.05)
    job.wait(timeout=60)
    assert len(grpo_step_lines(tmp_path, "killed")) < 5, (
        "the run finished before it could be killed"
    )
    ours = _trained(tmp_path, "killed", cfg, tiny_model_dir, prepared_data, 2)
    assert [m["step"] for m in ours] == [1, 2, 3, 4, 5]
    for a, b in zip(ours, theirs, strict=True):
        for key in ("loss", "mean_reward", "response_length_mean", "staleness"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (key, a["step"])
