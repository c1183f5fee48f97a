"""Seconds per GRPO step: lingo-rl's trainer vs TRL's ``GRPOTrainer``, side by side in one run.

Both train the same tiny GPT-OSS model (from the same directory) on the same prompts (the
bundled sample's train split, as harmony text), with the same group size, completion length,
reward (our language-compliance scorer; TRL gets it through ``eval.adapters``), learning rate,
clip range (0.2 / 0.28), no KL, token-level loss, CPU. Each runs ``--steps`` steps; the first
is a warm-up and is not counted. Target: ours ≤ 0.5× TRL's time per step.

    python bench/grpo_vs_trl.py [--steps 6] [--prompts 8] [--group 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

# bench/data_prep.py would shadow the data_prep package: keep this folder off the import path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]


def prepare(workdir: Path) -> tuple[Path, Path]:
    from data_prep.config import DataPrepConfig
    from data_prep.prepare import prepare_dataset
    from trainer.tiny_model import build_tiny_model

    data = workdir / "data"
    prepare_dataset(
        DataPrepConfig(workers=1), data / "train.jsonl", data / "eval.jsonl", data / "q.jsonl"
    )
    model = build_tiny_model(workdir / "model")
    return model, data


def run_ours(model: Path, data: Path, args, workdir: Path) -> list[float]:
    from trainer.grpo.config import GRPOConfig
    from trainer.grpo.recipe import run_grpo
    from trainer.metrics import read_metrics

    n = args.prompts * args.group
    cfg = GRPOConfig.model_validate(
        {
            "rollout": {"n_samples": args.group, "max_new_tokens": args.tokens, "temperature": 1.0},
            "algorithm": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "kl_loss_coef": 0.0},
            "optim": {"learning_rate": args.lr, "lr_scheduler": "constant"},
            "prompts_per_step": args.prompts,
            "mini_batch_size": n,
            "micro_batch_size": n,  # one forward over the whole batch, as TRL does here
            "max_steps": args.steps,
            "eval_every": 0,
            "eval_prompts": 1,
            "eval_samples": 1,
            "dtype": "float32",
        }
    )
    run_grpo(
        cfg,
        model,
        data / "train.jsonl",
        data / "eval.jsonl",
        workdir / "ours_model",
        workdir / "ours",
    )
    walls = [
        m["wall_time_s"]
        for m in read_metrics(workdir / "ours" / "training_metrics.jsonl")
        if "loss" in m
    ]
    return [b - a for a, b in zip(walls, walls[1:], strict=False)]


def run_trl(model: Path, data: Path, args, workdir: Path) -> list[float]:
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from eval.adapters import language_compliance_reward

    records = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    unique = {r["prompt"]: r["label"] for r in records}
    dataset = Dataset.from_list([{"prompt": p, "label": lab} for p, lab in unique.items()])
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            stamps.append(time.monotonic())

    config = GRPOConfig(
        output_dir=str(workdir / "trl"),
        per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=args.tokens,
        temperature=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        loss_type="dapo",
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=42,
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
    trainer.train()
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, for both")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        model, data = prepare(workdir)
        ours = run_ours(model, data, args, workdir)
        trl = run_trl(model, data, args, workdir)
    ours_s, trl_s = sum(ours) / len(ours), sum(trl) / len(trl)
    print(
        f"\n{args.prompts} prompts x {args.group} samples, {args.tokens} new tokens, "
        f"{args.steps} steps (first not counted), torch threads {torch.get_num_threads()}"
    )
    print(f"{'trainer':<22}{'s/step':>10}")
    print(f"{'lingo-rl':<22}{ours_s:>10.2f}")
    print(f"{'TRL GRPOTrainer':<22}{trl_s:>10.2f}")
    print(f"ratio lingo-rl / TRL: {ours_s / trl_s:.2f}x (target <= 0.5x)")


if __name__ == "__main__":
    main()
