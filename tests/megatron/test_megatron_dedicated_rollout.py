"""A whole GRPO run on the Megatron backend with a dedicated rollout engine, one step off-policy
(``rollout.colocate: false``, ``async_steps: 1``): one Megatron training process and one HF
engine process in one torchrun job (gloo, CPU). The trainers' default group holds only the
training processes, so Megatron-Core's parallel state is built over them alone; the engine
is driven over a channel of its own (``trainer.grpo.remote``) and takes the weights streamed
from ``AutoBridge.export_hf_weights``.

Needs the Megatron env (``bash tools/run_megatron_tests.sh``); elsewhere it skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tests_helpers_trainer import grpo_cli_args, grpo_step_lines, small_grpo_config

from trainer.megatron.layout import MegatronLayout

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def megatron_run_inputs(megatron_bridge, tiny_models, tmp_path) -> tuple[Path, Path, Path]:
    """The tiny model, its one-rank ``torch_dist`` checkpoint and prepared data."""
    from cpu_patches import cpu_patches

    from data_prep.config import DataPrepConfig
    from data_prep.prepare import prepare_dataset
    from trainer.megatron import bridge

    hf_dir = tiny_models["default"]
    checkpoint = tmp_path / "megatron"
    with cpu_patches():
        layout = MegatronLayout(name="tiny", params_dtype="fp32")
        bridge.convert_hf_to_megatron(str(hf_dir), str(checkpoint), layout)
    data = tmp_path / "data"
    data.mkdir()
    prepare_dataset(
        DataPrepConfig(workers=1),
        data / "train.jsonl",
        data / "eval.jsonl",
        data / "quarantine.jsonl",
    )
    return hf_dir, checkpoint, data


def test_megatron_with_a_dedicated_engine_one_step_off_policy(megatron_run_inputs, tmp_path):
    hf_dir, checkpoint, data = megatron_run_inputs
    cfg = small_grpo_config(
        max_steps=3,
        checkpoint_every=0,
        eval_every=3,
        micro_batch_size=8,
        rollout={
            "n_samples": 4,
            "max_new_tokens": 16,
            "colocate": False,
            "num_engines": 1,
            "async_steps": 1,
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
    worker = Path(__file__).with_name("grpo_run_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", str(worker)]
    command += grpo_cli_args(tmp_path, "split", cfg, hf_dir, data)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = grpo_step_lines(tmp_path, "split")
    print(json.dumps(lines, indent=1))
    assert [m["staleness"] for m in lines] == [0, 1, 1]
    # on-policy first step: the engine holds the policy's weights, every ratio is 1
    assert lines[0]["importance_ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert lines[0]["tis_clipped_fraction"] == 0 and lines[0]["rollout_kl"] < 1e-9
    for m in lines[1:]:  # sampled one update ago: the decoupled loss and its weights
        assert m["rollout_kl"] > lines[0]["rollout_kl"]
        assert 0.5 < m["importance_ratio_mean"] < 2.0
        assert m["importance_ratio_max"] >= m["importance_ratio_mean"]
        # the engine took the Megatron weights (float32: the same forward)
        assert m["sync_logprob_max_diff"] < 1e-5
    assert "eval_mean_reward" in lines[-1]
    for m in lines:
        assert m["rollout_idle_s"] >= 0 and m["rollout_wait_s"] >= 0
        assert m["rollout_time_s"] > 0 and m["train_time_s"] > 0
    # the Megatron backend's GRPO output: a torch_dist checkpoint (export_hf makes it HF)
    assert (tmp_path / "split" / "model" / "latest_checkpointed_iteration.txt").exists()
