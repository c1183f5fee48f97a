"""Shared test inputs for the trainer tests: small texts for tokenizers, fixed GRPO rollouts,
and the command line of a GRPO run in a process of its own."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import torch

from trainer.grpo import algorithm as algo
from trainer.grpo import update
from trainer.grpo.config import GRPOConfig
from trainer.grpo.prompts import Prompt
from trainer.grpo.rollout import Rollout
from trainer.metrics import METRICS_FILE, read_metrics
from trainer.tiny_model import SMALLEST

ROOT = Path(__file__).resolve().parents[1]


VERL_MEGATRON_OVERRIDES = {
    # the gpt-oss-20b-verl preset's GRPO config as its Megatron branch runs it
    # (pipelines.presets.megatron_grpo_config): verl's TP 8 / EP 8 layout on its one training
    # node, the dedicated vLLM engines on the next
    "grpo.optim.backend": "megatron",
    "grpo.optim.offload_optimizer": "false",
    "grpo.optim.megatron": '{"layout": {"preset": "verl-gpt-oss-8x8-h100", "nodes": 1, "pp": 1}}',
    "grpo.gradient_checkpointing": "false",
}

VERL_COLOCATED_OVERRIDES = {
    # the gpt-oss-20b-verl preset with verl's hybrid engine: one vLLM engine per 4 training
    # GPUs, sleeping while they train
    "grpo.rollout.colocate": "true",
    "grpo.rollout.num_engines": "0",
    "grpo.rollout.async_steps": "0",  # colocated: nothing to overlap with
    "grpo.rollout.gpu_memory_utilization": "0.5",
}


def kill_job(job: subprocess.Popen) -> None:
    """SIGKILL a torchrun job and every process under it at once, as a node loss takes them
    all. Killing the launcher's process group is not that: torchrun starts each rank in a
    session of its own (torch.distributed.elastic's ``SubprocessHandler``,
    ``start_new_session=True``), so the ranks die later, on their own, and a rank's
    multiprocessing children outlive them (Megatron-Core's ``torch_dist`` save starts a
    write-results ``Manager``: one such process, ~540 MB, outlived every run of the Megatron
    kill-and-resume test). ``job`` was started with ``start_new_session=True``."""
    import psutil

    try:  # the tree before anything dies: a killed parent's children go to init
        tree = psutil.Process(job.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    os.killpg(job.pid, signal.SIGKILL)
    for process in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()


def small_grpo_config(**overrides) -> dict:
    """A GRPO config (as a dict for ``GRPOConfig.model_validate``) small enough for CPU tests:
    4 prompts × 4 samples a step, no held-out eval, a checkpoint every step, float32."""
    return {
        "rollout": {"n_samples": 4, "max_new_tokens": 16},
        "prompts_per_step": 4,
        "mini_batch_size": 16,
        "micro_batch_size": 8,
        "max_steps": 4,
        "eval_every": 0,
        "eval_prompts": 4,
        "eval_samples": 1,
        "checkpoint_every": 1,
        "max_ckpt_num": 5,
        "dtype": "float32",
        **overrides,
    }


def recipe_paths(model: Path, data: Path, out: Path) -> tuple[Path, Path, Path, Path, Path]:
    """A recipe's (``run_sft``, ``run_grpo``) arguments after its config: ``model``, the
    prepared ``data``'s train and eval files, and the model output and work dir under ``out``."""
    return model, data / "train.jsonl", data / "eval.jsonl", out / "model", out / "work"


def grpo_cli_args(run_dir: Path, name: str, cfg: dict, model: Path, data: Path) -> list[str]:
    """``python -m trainer.grpo``'s arguments for a run named ``name``: ``cfg`` validated and
    written to ``run_dir/<name>.json``, the prepared data's train and eval files, the model
    and the work dir under ``run_dir/<name>/``."""
    GRPOConfig.model_validate(cfg)
    config = run_dir / f"{name}.json"
    config.write_text(json.dumps(cfg))
    args = ["--config", str(config), "--sft-model", str(model)]
    args += ["--train", str(data / "train.jsonl"), "--eval", str(data / "eval.jsonl")]
    args += ["--model-output", str(run_dir / name / "model")]
    return args + ["--work-dir", str(run_dir / name / "work")]


def grpo_step_lines(run_dir: Path, name: str) -> list[dict]:
    """The step lines (those with a loss) of that run's ``training_metrics.jsonl``."""
    return [m for m in read_metrics(run_dir / name / "work" / METRICS_FILE) if "loss" in m]


def subprocess_env() -> dict[str, str]:
    """The environment for a run in a process of its own: the project and the tests' helpers
    importable from the checkout."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}


SMALL_CORPUS = [
    "<|start|>user<|message|>What is two plus two?<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Four.<|return|>",
    "Je réfléchis à la question, puis je réponds brièvement en français.",
    "Ich überlege kurz und antworte auf Deutsch, so klar wie möglich.",
    "Pienso en la pregunta y respondo en español de forma breve.",
    "Penso alla domanda e rispondo in italiano in modo chiaro.",
] * 20


SMALL_CORPUS_MODEL = SMALLEST.model_copy(
    update={"vocab_size": 400, "hidden_size": 32, "intermediate_size": 32, "head_dim": 16}
)
"""``SMALLEST`` (the ``tiny_model_dir`` fixture's) at half the width and a 400-token
vocabulary: small enough to build from ``SMALL_CORPUS`` in a test, and of another shape."""


def vllm_grpo_run(
    run_dir: Path, model: Path, data: Path, rollout: dict, *program: str
) -> subprocess.CompletedProcess:
    """``python -m trainer.grpo`` (or ``program``) with vLLM rollouts, 2 steps, in its own
    process (as the GRPO step runs it; vLLM's engine lives in that process); the run is named
    ``grpo`` under ``run_dir``."""
    cfg = small_grpo_config(
        max_steps=2, checkpoint_every=0, rollout={"engine": "vllm", "n_samples": 4, **rollout}
    )
    args = grpo_cli_args(run_dir, "grpo", cfg, model, data)
    return subprocess.run(
        [sys.executable, *(program or ("-m", "trainer.grpo")), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=subprocess_env(),
    )


def fixed_grpo_batch(vocab: int = 1000) -> update.Batch:
    """16 rollouts of 4 prompts (one longer than a 32-token sliding window), empty and unequal
    responses, one group without signal; token ids in ``[5, vocab)``, seeded (the Megatron
    backend's recorded numbers come from ``vocab=1000``)."""
    gen = torch.Generator().manual_seed(7)
    prompts = [
        Prompt(torch.randint(5, vocab, (n,), generator=gen).tolist(), "fr", f"p{n}")
        for n in (41, 12, 27, 35)
    ]
    rollouts, rewards = [], []
    for p in range(4):
        for s in range(4):
            length = [0, 3, 9, 16][(p + s) % 4] if (p, s) != (1, 2) else 0
            ids = torch.randint(5, vocab, (length,), generator=gen).tolist()
            rollouts.append(Rollout(p, ids, s % 2 == 0))
            rewards.append(float((p * 3 + s * 5) % 7) - 3.0)
    rewards = torch.tensor(rewards)
    rewards[4:8] = 1.0
    groups = torch.tensor([r.prompt_index for r in rollouts])
    advantages = algo.get_advantage_estimator("grpo")(rewards, groups)
    stats = algo.group_stats(rewards, groups)
    keep = (~stats.all_equal[stats.index]).float()
    return update.Batch(prompts, rollouts, rewards, advantages, keep, [None] * len(rollouts))


class AliveBytes:
    """A weight stream that records how many of its tensors' bytes are alive at once: each
    tensor is a fresh copy, counted until the last reference to it goes (``weakref``), so
    ``peak`` is the most the consumer (and whatever it hands them to) held at one time."""

    def __init__(self) -> None:
        self.alive = self.peak = self.largest = 0

    def _free(self, nbytes: int) -> None:
        self.alive -= nbytes

    def stream(self, named_tensors):
        for name, tensor in named_tensors:
            fresh = tensor.detach().clone()
            nbytes = fresh.numel() * fresh.element_size()
            weakref.finalize(fresh, self._free, nbytes)
            self.alive += nbytes
            self.peak = max(self.peak, self.alive)
            self.largest = max(self.largest, nbytes)
            yield name, fresh
            del fresh


def run_threads(*targets) -> None:
    """Run each of ``targets`` in a thread of its own (the members of one process group); raise
    the first error one raised, or fail when one is still running after 120 s."""
    errors: list[BaseException] = []

    def guarded(target):
        try:
            target()
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not [t for t in threads if t.is_alive()], "a member hung"
    if errors:
        raise errors[0]
