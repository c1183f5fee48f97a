"""Whole GRPO runs on the Megatron backend with a dedicated rollout engine, one step
off-policy (``rollout.colocate: false``, ``async_steps: 1``): Megatron training processes and
one HF engine process in one torchrun job (gloo, CPU). The trainers' default group holds only
the training processes, so Megatron-Core's parallel state is built over them alone; the engine
is driven over a channel of its own (``trainer.grpo.remote``) and takes the weights streamed
from ``AutoBridge.export_hf_weights``.

- one trainer + one engine: the decoupled loop's metrics;
- killed with a batch in flight after a checkpoint, then resumed: the same steps as a run
  never interrupted;
- two trainers (data-parallel 2, or two pipeline stages) + one engine: the same run as one
  trainer (the engine's prompt shares, the weight stream every training rank draws).

Needs the Megatron env (``bash tools/run_megatron_tests.sh``); elsewhere it skips.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests_helpers_trainer import grpo_cli_args, grpo_step_lines, kill_job, small_grpo_config

from trainer.megatron.layout import MegatronLayout
from trainer.metrics import METRICS_FILE

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("grpo_run_worker.py")


def _inputs(hf_dir: Path, root: Path) -> tuple[Path, Path, Path]:
    """``hf_dir``'s one-rank ``torch_dist`` checkpoint and prepared data, under ``root``."""
    from cpu_patches import cpu_patches

    from data_prep.config import DataPrepConfig
    from data_prep.prepare import prepare_dataset
    from trainer.megatron import bridge

    checkpoint = root / "megatron"
    with cpu_patches():
        layout = MegatronLayout(name="tiny", params_dtype="fp32")
        bridge.convert_hf_to_megatron(str(hf_dir), str(checkpoint), layout)
    data = root / "data"
    data.mkdir()
    prepare_dataset(
        DataPrepConfig(workers=1),
        data / "train.jsonl",
        data / "eval.jsonl",
        data / "quarantine.jsonl",
    )
    return hf_dir, checkpoint, data


@pytest.fixture(scope="module")
def shared_run_inputs(megatron_bridge, tiny_models, tmp_path_factory) -> tuple[Path, Path, Path]:
    """The tiny model, its one-rank ``torch_dist`` checkpoint and prepared data, made once
    for the module's runs."""
    return _inputs(tiny_models["default"], tmp_path_factory.mktemp("megatron-runs"))


def _megatron_config(checkpoint: Path, layout="tiny-cpu", nproc: int = 1, **fields) -> dict:
    """A small Megatron GRPO config with one dedicated HF engine, one step off-policy."""
    return small_grpo_config(
        **{"max_steps": 3, "checkpoint_every": 0, "micro_batch_size": 8, "nproc": nproc} | fields,
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
                "layout": layout,
                "checkpoint": str(checkpoint),
                # Megatron-Core's DistributedOptimizer takes CUDA parameters only
                # (distrib_optimizer.py:477): the GPU layouts use it
                "use_distributed_optimizer": False,
            },
        },
    )


def _job(run_dir: Path, name: str, cfg: dict, hf_dir: Path, data: Path) -> list[str]:
    """The torchrun command of the run: ``nproc`` Megatron trainers and one engine process."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={cfg['nproc'] + 1}", str(WORKER)]
    return command + grpo_cli_args(run_dir, name, cfg, hf_dir, data)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    return env


def _run(run_dir: Path, name: str, cfg: dict, hf_dir: Path, data: Path) -> list[dict]:
    """Run the job to its end; its step lines."""
    command = _job(run_dir, name, cfg, hf_dir, data)
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return grpo_step_lines(run_dir, name)


UNINTERRUPTED = {"max_steps": 5, "checkpoint_every": 2, "max_ckpt_num": 2, "eval_every": 3}
"""The one-trainer run: 5 steps, a checkpoint after steps 2 and 4, a held-out eval after steps
3 and 5 (after every update the first 3 steps could touch)."""


@pytest.fixture(scope="module")
def one_trainer_run(shared_run_inputs, tmp_path_factory) -> tuple[Path, list[dict]]:
    """One Megatron trainer and one engine (``UNINTERRUPTED``), run once for the module: the
    decoupled loop's metrics, the run the killed and resumed one must match, and the run
    several trainers must match (over as many steps: the learning rate follows a cosine over
    the run's length). Its run directory (the run is ``one`` in it), its step lines."""
    hf_dir, checkpoint, data = shared_run_inputs
    run_dir = tmp_path_factory.mktemp("one-trainer")
    cfg = _megatron_config(checkpoint, **UNINTERRUPTED)
    return run_dir, _run(run_dir, "one", cfg, hf_dir, data)


def test_megatron_with_a_dedicated_engine_one_step_off_policy(one_trainer_run):
    run_dir, lines = one_trainer_run
    print(json.dumps(lines, indent=1))
    assert [m["staleness"] for m in lines] == [0, 1, 1, 1, 1]
    # on-policy first step: the engine holds the policy's weights, every ratio is 1
    assert lines[0]["importance_ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert lines[0]["tis_clipped_fraction"] == 0 and lines[0]["rollout_kl"] < 1e-9
    for m in lines[1:]:  # sampled one update ago: the decoupled loss and its weights
        assert m["rollout_kl"] > lines[0]["rollout_kl"]
        assert 0.5 < m["importance_ratio_mean"] < 2.0
        assert m["importance_ratio_max"] >= m["importance_ratio_mean"]
    # the engine took the Megatron weights (float32: the same forward) before it sampled each
    # step; the held-out eval after step 3 put update 3 in it, so step 4 had nothing to send
    synced = [m for m in lines if "sync_bytes" in m]
    assert [m["step"] for m in synced] == [2, 3, 5]
    assert all(m["sync_logprob_max_diff"] < 1e-5 and m["sync_bytes"] > 0 for m in synced)
    assert [m["step"] for m in lines if "eval_mean_reward" in m] == [3, 5]
    for m in lines:
        assert m["rollout_idle_s"] >= 0 and m["rollout_wait_s"] >= 0
        assert m["rollout_time_s"] > 0 and m["train_time_s"] > 0
    # the Megatron backend's GRPO output: a torch_dist checkpoint (export_hf makes it HF)
    assert (run_dir / "one" / "model" / "latest_checkpointed_iteration.txt").exists()


COMPARED = (
    "loss",
    "grad_norm",
    "entropy",
    "learning_rate",
    "importance_ratio_mean",
    "importance_ratio_max",
    "rollout_kl",
    "mean_reward",
    "response_length_mean",
    "staleness",
)
"""Step-line fields that say the same rollouts were trained on the same way: the update's
(loss, gradient norm before clipping, the policy's entropy), the decoupled loss's correction
(the policy's old log-probs against the engine's), and the rollouts themselves."""


def _gaps(ours: list[dict], theirs: list[dict]) -> dict[str, float]:
    """The largest absolute difference of each ``COMPARED`` field over the steps."""
    assert [m["step"] for m in ours] == [m["step"] for m in theirs]
    pairs = list(zip(ours, theirs, strict=True))
    return {key: max(abs(a[key] - b[key]) for a, b in pairs) for key in COMPARED}


def test_kill_and_resume_with_a_batch_in_flight_matches_an_uninterrupted_run(
    shared_run_inputs, one_trainer_run, tmp_path
):
    """``async_steps: 1``, a checkpoint every 2 steps: the checkpoint at step 2 holds step 3's
    rollouts (sampled by the engine while step 2 trained, before the checkpoint's weights).
    The whole job is killed (SIGKILL, as a node loss) after step 3; the resumed job loads the
    Megatron model and optimizer (``torch_dist``) and the RNG, gives its new engine process the
    resumed policy's weights (the first sync), trains step 3 on the saved batch and goes on.
    Every step matches the run never interrupted (``one_trainer_run``, the same config), bit
    for bit (float32 on a CPU: the same operations on the same values)."""
    hf_dir, checkpoint, data = shared_run_inputs
    cfg = _megatron_config(checkpoint, **UNINTERRUPTED)
    _, theirs = one_trainer_run
    job = subprocess.Popen(
        _job(tmp_path, "killed", cfg, hf_dir, data),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 400
    metrics = tmp_path / "killed" / "work" / METRICS_FILE
    while job.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and len(grpo_step_lines(tmp_path, "killed")) >= 3:
            kill_job(job)  # every process of the job, Megatron's writers with them
            break
        time.sleep(0.05)
    job.wait(timeout=60)
    killed = grpo_step_lines(tmp_path, "killed")
    assert 3 <= len(killed) < 5, "the run was not killed between steps 3 and 5"
    saved = json.loads(
        (tmp_path / "killed" / "work" / "checkpoints" / "step-2" / "trainer_state.json").read_text()
    )
    assert [batch["step"] for batch in saved["in_flight"]] == [2]  # step 3's (0-based 2)
    assert (tmp_path / "killed" / "work" / "checkpoints" / "step-2" / "megatron").is_dir()
    ours = _run(tmp_path, "killed", cfg, hf_dir, data)
    assert [m["step"] for m in ours] == [1, 2, 3, 4, 5]
    assert [m["staleness"] for m in ours] == [0, 1, 1, 1, 1]
    gaps = _gaps(ours, theirs)
    print(json.dumps(gaps))
    assert max(gaps.values()) == 0.0, gaps
    # the resumed job's new engine process (loaded from the SFT model) took the checkpoint's
    # weights before it sampled step 4: that sync's check is on step 3's line
    resumed = ours[2]
    assert resumed["sync_bytes"] > 0 and resumed["sync_logprob_max_diff"] < 1e-5
    assert [m.get("sync_bytes") for m in ours] == [m.get("sync_bytes") for m in theirs]
    assert ours[4]["sync_logprob_max_diff"] < 1e-5  # and the last update's, for the eval


@pytest.mark.parametrize(
    ("sizes", "tolerance"),
    [({"pp": 2}, 1e-5), ({}, 1e-5)],
    ids=["pipeline-2", "data-parallel-2"],
)
def test_two_megatron_trainers_and_one_engine_train_like_one_trainer(
    shared_run_inputs, one_trainer_run, tmp_path, sizes, tolerance
):
    """Two Megatron training processes (two pipeline stages, or two data-parallel replicas)
    and one engine process: ``torchrun --nproc_per_node 3``. The coordinator asks the engine
    for every data-parallel rank's prompts and hands each trainer the step's rollouts; each
    keeps its replica's share (``rank_slots`` by Megatron's data-parallel rank; both stages of
    one replica keep all of them). For the weight stream every training rank draws
    ``export_hf_weights`` in step (each tensor gathered over its stage), only the coordinator
    sends it. The same seeds on the same weights: the same rollouts and the same updates as
    one trainer, up to the order of float sums."""
    hf_dir, checkpoint, data = shared_run_inputs
    _, one_trainer = one_trainer_run
    layout = {"preset": "tiny-cpu", "gpus_per_node": 2, **sizes}
    steps = {"max_steps": UNINTERRUPTED["max_steps"], "eval_every": UNINTERRUPTED["eval_every"]}
    cfg = _megatron_config(checkpoint, layout, nproc=2, **steps)  # no checkpoints: none resumed
    ours = _run(tmp_path, "two", cfg, hf_dir, data)
    assert [m["staleness"] for m in ours] == [0, 1, 1, 1, 1]
    # the same rollouts: generated from the same prompts and seeds, on the same weights
    for a, b in zip(ours, one_trainer, strict=True):
        assert a["mean_reward"] == b["mean_reward"]
        assert a["response_length_mean"] == b["response_length_mean"]
    gaps = _gaps(ours, one_trainer)
    print(json.dumps(gaps))
    assert max(gaps.values()) < tolerance, gaps
    # the sync before step 3 put the policy's weights into the engine, the same bytes as
    # from one trainer (each tensor gathered whole before it is sent)
    assert ours[1]["sync_logprob_max_diff"] < 1e-5
    assert ours[1]["sync_bytes"] == one_trainer[1]["sync_bytes"]
