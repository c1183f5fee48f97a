"""GRPO seconds per step, full-parameter vs LoRA, paired in one run (issue #42).

The issue's bar: the tiny demo with ``grpo.lora`` enabled has a GRPO step time no worse than
full GRPO's measured in the same run. On a shared machine the load changes from minute to
minute, so this bench interleaves the two (full, LoRA, full, LoRA, …), each a short GRPO run
of the pipeline's own GRPO step (``trainer.grpo.step.run_grpo_step``, what the GRPO component
calls) on a finished local run's SFT model and data, with that run's resolved GRPO config
(``bench/loss_variants.py``'s ``--run``/``--config-run``/``--set``) and no eval after it. Each
run is a fresh process, so neither inherits the other's caches or threads.

    python bench/lora_step_time.py run --run runs/local/lingo-rl-<ts> -o OUT --pairs 3 \\
        --set grpo.max_steps=10 --lora-set grpo.lora.r=16 ...
    python bench/lora_step_time.py table OUT

From each run's ``training_metrics.jsonl`` it takes the median ``step_time_s``,
``rollout_time_s`` and ``train_time_s`` (and ``response_length_mean``) of the steps after the
first ``--warmup`` (2), and prints them per pair with the LoRA ÷ full ratio of each, and the
ratios' min/median/max.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# bench/data_prep.py would shadow the data_prep package: keep this folder off the import path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]
sys.path.insert(0, str(ROOT))

from bench.loss_variants import grpo_only  # noqa: E402

TIMES = ("step_time_s", "rollout_time_s", "train_time_s")
MODES = ("full", "lora")


def step_medians(lines: list[dict], warmup: int, source: str = "training_metrics.jsonl") -> dict:
    """The median of each of ``TIMES`` over the training steps after the first ``warmup``
    (lines without ``step_time_s``, e.g. the step-0 baseline eval, are not steps), and how
    many steps that was. Too few steps is an error naming ``source``."""
    steps = sorted((line for line in lines if "step_time_s" in line), key=lambda x: x["step"])
    kept = steps[warmup:]
    if not kept:
        raise SystemExit(f"{source}: {len(steps)} training steps, none after {warmup} warm-up")
    out: dict = {"steps": len(kept)}
    for key in TIMES:
        values = [line[key] for line in kept if key in line]
        if len(values) != len(kept):
            raise SystemExit(f"{source}: {key} missing on some steps")
        out[key] = statistics.median(values)
    if all("tokens_per_s" in line for line in kept):
        # per 1,000 response tokens (tokens_per_s × step_time_s: the step's, every rank's): a
        # policy that answers longer takes longer to train on, whatever the adapter costs
        for key in TIMES:
            out[f"{key}_per_ktok"] = statistics.median(
                1000 * line[key] / (line["tokens_per_s"] * line["step_time_s"]) for line in kept
            )
    lengths = [line["response_length_mean"] for line in kept if "response_length_mean" in line]
    if lengths:  # the training time grows with it; the rollouts' is bounded by max_new_tokens
        out["response_length_mean"] = statistics.median(lengths)
    return out


def read_medians(run_dir: Path, warmup: int) -> dict:
    path = run_dir / "grpo" / "training_log" / "training_metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: not found (that GRPO run did not finish)")
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return step_medians(lines, warmup, str(path))


def pair_ratios(pairs: list[dict]) -> dict:
    """Per time key (and per 1,000 tokens where the logs have ``tokens_per_s``): LoRA ÷ full
    of each pair, and their min, median and max."""
    out = {}
    keys = [*TIMES, *(f"{k}_per_ktok" for k in TIMES)]
    for key in [k for k in keys if all(k in p["full"] and k in p["lora"] for p in pairs)]:
        ratios = [p["lora"][key] / p["full"][key] for p in pairs]
        out[key] = {
            "ratios": ratios,
            "min": min(ratios),
            "median": statistics.median(ratios),
            "max": max(ratios),
        }
    return out


def _length(medians: dict) -> str:
    return f"{medians['response_length_mean']:.0f}" if "response_length_mean" in medians else "–"


def table(pairs: list[dict]) -> str:
    rows = [
        "| pair | full s/step | LoRA s/step | LoRA ÷ full | full rollout s | LoRA rollout s "
        "| full train s | LoRA train s | full / LoRA response tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, p in enumerate(pairs, start=1):
        f, lo = p["full"], p["lora"]
        rows.append(
            f"| {i} | {f['step_time_s']:.2f} | {lo['step_time_s']:.2f} | "
            f"{lo['step_time_s'] / f['step_time_s']:.2f} | {f['rollout_time_s']:.2f} | "
            f"{lo['rollout_time_s']:.2f} | {f['train_time_s']:.2f} | {lo['train_time_s']:.2f} | "
            f"{_length(f)} / {_length(lo)} |"
        )
    rows.append("")
    rows.append("| LoRA ÷ full | min | median | max |")
    rows.append("|---|---|---|---|")
    for key, r in pair_ratios(pairs).items():
        rows.append(f"| {key} | {r['min']:.2f} | {r['median']:.2f} | {r['max']:.2f} |")
    return "\n".join(rows)


def collect(out: Path, warmup: int) -> list[dict]:
    """The pairs found under ``out`` (``pair1-full``, ``pair1-lora``, …), complete ones only."""
    pairs = []
    i = 1
    while all((out / f"pair{i}-{m}").is_dir() for m in MODES):
        pairs.append({m: read_medians(out / f"pair{i}-{m}", warmup) for m in MODES})
        i += 1
    if not pairs:
        raise SystemExit(f"{out}: no complete pair (pair1-full and pair1-lora)")
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def run_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--run", type=Path, required=True, help="a finished local run")
        p.add_argument("--config-run", type=Path, help="read the step configs from this run")
        p.add_argument("-o", "--output", type=Path, required=True)
        p.add_argument("--set", dest="sets", action="append", default=[], help="both modes")

    many = sub.add_parser("run", help="interleaved full/LoRA GRPO runs, then the table")
    run_args(many)
    many.add_argument("--lora-set", action="append", default=[], help="LoRA only")
    many.add_argument("--pairs", type=int, default=3)
    many.add_argument("--warmup", type=int, default=2, help="first steps left out")
    one = sub.add_parser("grpo", help="one GRPO run (what `run` starts per mode)")
    run_args(one)
    show = sub.add_parser("table", help="the table of a `run`'s OUT")
    show.add_argument("output", type=Path)
    show.add_argument("--warmup", type=int, default=2)
    show.add_argument("--json", type=Path, help="also write the pairs and ratios as JSON here")
    args = parser.parse_args(argv)

    if args.command == "grpo":
        config_run = args.config_run.resolve() if args.config_run else None
        seconds = grpo_only(
            args.run.resolve(), args.output.resolve(), args.sets, config_run, "lora-step-time"
        )
        print(f"{args.output}: GRPO {seconds:.0f} s")
        return 0
    if args.command == "table":
        pairs = collect(args.output, args.warmup)
        print(table(pairs))
        if args.json:
            args.json.write_text(json.dumps({"pairs": pairs, "ratios": pair_ratios(pairs)}))
        return 0
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    out = args.output.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for i in range(1, args.pairs + 1):
        for mode in MODES:
            target = out / f"pair{i}-{mode}"
            if (target / "grpo" / "training_log" / "grpo_summary.json").is_file():
                continue  # a rerun resumes the sequence
            shutil.rmtree(target, ignore_errors=True)  # a run cut short starts again
            sets = args.sets + (args.lora_set if mode == "lora" else [])
            cmd = [sys.executable, __file__, "grpo", "--run", str(args.run), "-o", str(target)]
            if args.config_run:
                cmd += ["--config-run", str(args.config_run)]
            for s in sets:
                cmd += ["--set", s]
            print(f"pair {i} {mode}: {' '.join(cmd)}", flush=True)
            subprocess.run(cmd, check=True)
    print(table(collect(out, args.warmup)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
