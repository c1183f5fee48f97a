"""Seconds per GRPO step, three ways side by side in one run: lingo-rl one-step off-policy
(``rollout.async_steps: 1``), lingo-rl on-policy, and TRL's ``GRPOTrainer``; plus the
learning check that the overlap does not cost the held-out reward.

The demo's GRPO config (the ``tiny-cpu`` preset: 8 prompts × 8 samples, 128 new tokens,
lr 3e-4, clip 0.2/0.28, no KL, token-mean, in-language prompts), on the demo's SFT model
(made here, or ``--sft-model``). Ours runs as the issue asks: 1 training process and 1
rollout process (gloo, the HF engine, 1 torch thread each, the 2 cores); the only
difference between our two rows is ``rollout.async_steps``. TRL gets the same model, prompts,
group size, completion length, reward (our scorer through ``reward.adapters``), learning rate,
clip range and loss, on ``--trl-threads`` threads (default 2: the same cores). Every run does
``--steps`` steps; s/step is the mean over steps 2… (the first is a warm-up).

Targets (issue #20): async ≤ 0.7× our on-policy s/step and ≤ 0.35× TRL's; the held-out mean
reward after the same steps (64 held-out prompts × 2 samples, at the end) of the async runs
no worse than the worst on-policy run (within the on-policy loop's run-to-run spread), over
``--seeds`` seeds each.

    python bench/grpo_vs_trl.py [--steps 40] [--seeds 3] [--trl-seeds 1]
        [--sft-model DIR] [--work DIR] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# bench/data_prep.py would shadow the data_prep package: keep this folder off the import path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]
sys.path.insert(0, str(ROOT))

from pipelines.presets import get_preset  # noqa: E402

ASYNC_TARGET, TRL_TARGET = 0.7, 0.35


def prepare(work: Path, sft_model: Path | None) -> tuple[Path, Path]:
    """The demo's data, and its SFT model (trained here unless given)."""
    from data_prep.prepare import prepare_dataset
    from trainer.sft.recipe import run_sft
    from trainer.tiny_model import build_tiny_model

    preset = get_preset("tiny-cpu")
    data = work / "data"
    prepare_dataset(
        preset.data_prep, data / "train.jsonl", data / "eval.jsonl", data / "quarantine.jsonl"
    )
    if sft_model is None:
        base = build_tiny_model(work / "base", preset.model.tiny)
        sft_model = work / "sft"
        run_sft(
            preset.sft, base, data / "train.jsonl", data / "eval.jsonl", sft_model, work / "sft_w"
        )
    return Path(sft_model), data


def grpo_config(steps: int, seed: int, async_steps: int) -> dict:
    """The demo's GRPO config with dedicated engines (1 + 1 processes), one held-out eval
    at the end and no checkpoints."""
    cfg = get_preset("tiny-cpu").grpo.model_dump(mode="json")
    cfg["rollout"] |= {"colocate": False, "num_engines": 1, "async_steps": async_steps}
    cfg |= {"seed": seed, "max_steps": steps, "eval_every": steps, "checkpoint_every": 0}
    return cfg


def run_ours(model: Path, data: Path, work: Path, steps: int, seed: int, async_steps: int) -> dict:
    from cluster.torchrun import torchrun_command
    from trainer.grpo.config import GRPOConfig
    from trainer.metrics import read_metrics

    name = f"ours-async{async_steps}-seed{seed}"
    cfg = GRPOConfig.model_validate(grpo_config(steps, seed, async_steps))
    (work / f"{name}.json").write_text(cfg.model_dump_json())
    args = ["--config", str(work / f"{name}.json"), "--sft-model", str(model)]
    args += ["--train", str(data / "train.jsonl"), "--eval", str(data / "eval.jsonl")]
    args += ["--model-output", str(work / name / "model"), "--work-dir", str(work / name)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    processes = cfg.nproc + cfg.rollout_processes
    began = time.monotonic()
    subprocess.run(
        torchrun_command("trainer.grpo", args, processes),
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wall = time.monotonic() - began
    lines = [m for m in read_metrics(work / name / "training_metrics.jsonl") if "loss" in m]
    counted = lines[1:]
    return {
        "s_per_step": statistics.mean(m["step_time_s"] for m in counted),
        "rollout_wait_s": statistics.mean(m["rollout_wait_s"] for m in counted),
        "rollout_idle_s": statistics.mean(m["rollout_idle_s"] for m in counted),
        "eval_mean_reward": lines[-1]["eval_mean_reward"],
        "eval_both_language_accuracy": lines[-1]["eval_both_language_accuracy"],
        "wall_s": wall,
    }


def run_trl(model: Path, data: Path, work: Path, steps: int, seed: int, threads: int) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from reward.adapters import language_compliance_reward
    from trainer.grpo.prompts import in_language

    ours = get_preset("tiny-cpu").grpo
    torch.set_num_threads(threads)
    records = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    kept = {  # the prompts our loop trains on (the preset's prompt_filter)
        r["prompt"]: r["label"] for r in records if ours.prompt_filter == "all" or in_language(r)
    }
    dataset = Dataset.from_list([{"prompt": p, "label": lab} for p, lab in kept.items()])
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            stamps.append(time.monotonic())

    n = ours.prompts_per_step * ours.rollout.n_samples
    config = GRPOConfig(
        output_dir=str(work / f"trl-seed{seed}"),
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        num_generations=ours.rollout.n_samples,
        max_completion_length=ours.rollout.max_new_tokens,
        temperature=ours.rollout.temperature,
        learning_rate=ours.optim.learning_rate,
        lr_scheduler_type="constant",
        beta=0.0,
        epsilon=ours.algorithm.clip_ratio_low,
        epsilon_high=ours.algorithm.clip_ratio_high,
        loss_type="dapo",
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=seed,
        dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.padding_side = "left"
    trainer = GRPOTrainer(
        model=str(model),
        reward_funcs=language_compliance_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Clock()],
    )
    began = time.monotonic()
    trainer.train()
    steps_s = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"s_per_step": statistics.mean(steps_s), "wall_s": time.monotonic() - began}


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Mean and spread (min, max) of each figure per trainer, the ratios and the checks."""
    out: dict = {"rows": {}}
    for name, results in runs.items():
        row = {}
        for key in results[0]:
            values = [r[key] for r in results]
            row[key] = {"mean": statistics.mean(values), "min": min(values), "max": max(values)}
        out["rows"][name] = row
    rows = out["rows"]
    fast, sync, trl = (rows[k]["s_per_step"]["mean"] for k in ("async", "sync", "trl"))
    out["async_over_sync"] = fast / sync
    out["async_over_trl"] = fast / trl
    out["sync_over_trl"] = sync / trl
    learned, floor = (
        rows["async"]["eval_mean_reward"]["mean"],
        rows["sync"]["eval_mean_reward"]["min"],
    )
    out["checks"] = {
        f"async <= {ASYNC_TARGET}x sync s/step": out["async_over_sync"] <= ASYNC_TARGET,
        f"async <= {TRL_TARGET}x TRL s/step": out["async_over_trl"] <= TRL_TARGET,
        "async held-out reward >= worst sync run's": learned >= floor,
    }
    return out


def format_summary(summary: dict, args) -> str:
    rows = summary["rows"]
    lines = [
        f"demo GRPO config (tiny-cpu), {args.steps} steps, first not counted; ours: 1 training "
        f"+ 1 rollout process, 1 thread each, {args.seeds} seeds; TRL: {args.trl_threads} "
        f"threads, {args.trl_seeds} seed(s)",
        f"{'trainer':<34}{'s/step':>16}{'held-out reward':>24}",
    ]
    names = {"async": "lingo-rl async_steps=1", "sync": "lingo-rl async_steps=0", "trl": "TRL"}
    for key, label in names.items():
        s = rows[key]["s_per_step"]
        cell = f"{s['mean']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"
        reward = rows[key].get("eval_mean_reward")
        held = f"{reward['mean']:.3f} [{reward['min']:.3f}-{reward['max']:.3f}]" if reward else "-"
        lines.append(f"{label:<34}{cell:>16}{held:>24}")
    lines.append(
        f"async / sync {summary['async_over_sync']:.2f}x (target <= {ASYNC_TARGET}), "
        f"async / TRL {summary['async_over_trl']:.2f}x (target <= {TRL_TARGET}), "
        f"sync / TRL {summary['sync_over_trl']:.2f}x"
    )
    for check, ok in summary["checks"].items():
        lines.append(f"{'PASS' if ok else 'FAIL'}  {check}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=3, help="seeds of each of our loops")
    parser.add_argument("--trl-seeds", type=int, default=1)
    parser.add_argument("--trl-threads", type=int, default=2)
    parser.add_argument("--sft-model", type=Path, help="the demo's SFT model, if made already")
    parser.add_argument("--work", type=Path, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model, data = prepare(work, args.sft_model)
        runs: dict[str, list[dict]] = {"async": [], "sync": [], "trl": []}
        for seed in range(42, 42 + args.seeds):  # interleaved: drifts in load hit both
            for key, async_steps in (("sync", 0), ("async", 1)):
                runs[key].append(run_ours(model, data, work, args.steps, seed, async_steps))
                print(key, seed, runs[key][-1], flush=True)
        for seed in range(42, 42 + args.trl_seeds):
            runs["trl"].append(run_trl(model, data, work, args.steps, seed, args.trl_threads))
            print("trl", seed, runs["trl"][-1], flush=True)
    summary = summarize(runs)
    print("\n" + format_summary(summary, args))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"sft_model": str(args.sft_model)}, **summary, "runs": runs},
                indent=2,
                default=str,
            )
        )
    return 0 if all(summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
