"""GRPO loss variants on the demo, side by side (issue #43 item 3).

``lingo run --local --cache`` cannot reuse SFT across runs: the SFT step takes the pipeline
run's MLflow parent run and job id as arguments, both new in every run, so kfp.local keys it
anew and every variant would train SFT again (18 min on a loaded 2-core machine). This bench
does what the pipeline does after SFT, with one run's own inputs: it reads a finished local
run's ``configure`` step (the resolved GRPO and eval configs), applies ``--set`` overrides to
the GRPO config, and runs the pipeline's own functions on that run's SFT model and data —
``run_grpo_step`` (the GRPO component's), ``export_hf_directory`` (export to HF's) and
``run_eval_step`` (the eval component's, SFT and the variant's policy on the 50 questions,
the run's sampling and seeds). The outputs keep the pipeline's layout (``grpo/training_log``,
``export-hf/model``, ``evaluate/results``), so ``table`` reads a pipeline run and a variant
the same way.

    python bench/loss_variants.py run --run runs/local/lingo-rl-<ts> -o OUT \\
        [--set grpo.algorithm.policy_loss=gspo ...]
    python bench/loss_variants.py table NAME=DIR [NAME=DIR ...]   # DIR: a run or an OUT

Every figure in the table is read from the files: both-language accuracy overall and per
language, loop rate and reasoning length ratio (GRPO ÷ SFT median reasoning words) of the
GRPO model in ``evaluate/results``; the held-out curve (``eval_both_language_accuracy``
every ``eval_every`` steps) and the mean ``step_time_s`` from ``training_metrics.jsonl``;
the exported step from ``grpo_summary.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
# bench/data_prep.py would shadow the data_prep package: keep this folder off the import path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]
sys.path.insert(0, str(ROOT))

LANGUAGES = ("en", "fr", "de", "es", "it")


def run_parameters(run: Path) -> dict:
    """The resolved step configs a local run's ``configure`` step handed the others."""
    path = run / "configure" / "executor_output.json"
    if not path.is_file():
        raise SystemExit(f"{path}: not found (--run must be a finished `lingo run --local` run)")
    return json.loads(path.read_text())["parameterValues"]


def apply_sets(grpo: dict, sets: list[str]) -> dict:
    """``grpo`` with ``grpo.A.B=VALUE`` overrides applied (values parsed as YAML); a key the
    config does not hold is an error naming it."""
    config = json.loads(json.dumps(grpo))
    for assignment in sets:
        key, sep, raw = assignment.partition("=")
        parts = key.split(".")
        if not sep or parts[0] != "grpo" or len(parts) < 2:
            raise SystemExit(f"--set {assignment!r}: expected grpo.FIELD[.FIELD…]=VALUE")
        node = config
        for i, part in enumerate(parts[1:-1], start=1):
            if not isinstance(node.get(part), dict):
                section = ".".join(parts[: i + 1])
                raise SystemExit(f"--set {assignment!r}: {section} is not a section")
            node = node[part]
        if parts[-1] not in node:
            raise SystemExit(f"--set {assignment!r}: {key} is not a GRPO config field")
        node[parts[-1]] = yaml.safe_load(raw)
    return config


def run_variant(
    run: Path, out: Path, sets: list[str], config_run: Path | None = None, sft_eval: bool = True
) -> None:
    """GRPO, export and eval of one variant on ``run``'s SFT model and data, with the step
    configs of ``config_run``'s ``configure`` step (default: ``run``'s) and ``sets`` applied.
    ``sft_eval=False`` evaluates the policy alone (the SFT model's responses are the same in
    every variant: same model, questions, sampling and seeds; ``table --sft-results`` reads
    them from the run's eval)."""
    grpo_s = grpo_only(run, out, sets, config_run, "loss-variants")
    params = run_parameters(config_run or run)
    start = time.monotonic()
    evaluate_policy(out / "grpo" / "model", run / "sft" / "model", params["eval"], out, sft_eval)
    eval_s = time.monotonic() - start
    (out / "timing.json").write_text(json.dumps({"grpo_s": grpo_s, "eval_s": eval_s}))
    print(f"{out}: GRPO {grpo_s:.0f} s, eval {eval_s:.0f} s")


def grpo_only(
    run: Path, out: Path, sets: list[str], config_run: Path | None = None, job: str = "grpo"
) -> float:
    """The pipeline's GRPO step on ``run``'s SFT model and data, with ``config_run``'s GRPO
    config (default: ``run``'s) and ``sets`` applied: its wall seconds
    (``out/grpo/{model,training_log,job_manifest}``, ``out/sets.json``)."""
    from cluster.config import JobLaunch
    from components.images import GPU_IMAGE
    from plan import branch_config
    from trainer.grpo.config import GRPOConfig
    from trainer.grpo.step import run_grpo_step

    params = run_parameters(config_run or run)
    sft_model = run / "sft" / "model"
    train, held_out = run / "data-prep" / "train_data", run / "data-prep" / "eval_data"
    for path in (sft_model, train, held_out):
        if not path.exists():
            raise SystemExit(f"{path}: not found (the run's SFT or data prep did not finish)")
    config = branch_config(
        apply_sets(params["grpo"], sets),
        params["backend"],
        params["megatron_layout"],
        megatron_optim=params["megatron_optim"],
    )
    cfg = GRPOConfig.model_validate(config)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sets.json").write_text(
        json.dumps({"run": str(run), "config_run": str(config_run or run), "sets": sets}, indent=1)
    )
    grpo = out / "grpo"
    grpo.mkdir(exist_ok=True)
    launch = JobLaunch.for_step(
        params["grpo_execution"], job, str(grpo / "job_manifest"), GPU_IMAGE, GPU_IMAGE
    )
    start = time.monotonic()
    run_grpo_step(cfg, sft_model, train, held_out, grpo / "model", grpo / "training_log", launch)
    return time.monotonic() - start


def evaluate_policy(policy: Path, sft_model: Path, config: dict, out: Path, sft_eval: bool) -> None:
    """Export to HF's and the eval's own functions on ``policy``: ``out/export-hf/model``,
    ``out/evaluate/{results,report,report_html}``."""
    from eval.eval_step import run_eval_step
    from trainer.export_hf import export_hf_directory

    exported = out / "export-hf" / "model"
    export_hf_directory(policy, sft_model, exported, "auto", "5GB")
    evaluate = out / "evaluate"
    models = {"sft": str(sft_model)} if sft_eval else {}
    run_eval_step(
        models | {"grpo": str(exported)},
        config,
        evaluate / "results",
        evaluate / "report",
        evaluate / "report_html",
    )


def merged_adapter(adapter: Path, sft_model: Path, out: Path) -> Path:
    """A LoRA GRPO policy (an adapter on the SFT model) merged into ``out`` with the GRPO
    step's own merge and its check (``trainer.sft.merge``), checked on two harmony prompts."""
    import torch

    from core.modeling import load_tokenizer
    from trainer.sft.merge import load_adapter, merge_and_save

    tokenizer = load_tokenizer(sft_model)
    template = "<|start|>user<|message|>{}<|end|><|start|>assistant"
    prompts = [
        tokenizer.encode(template.format(q), add_special_tokens=False)
        for q in ("Combien font 2 + 3 ?", "Wie viel ist 7 mal 6?")
    ]
    if not (out / "config.json").is_file():
        merge_and_save(load_adapter(sft_model, adapter, torch.float32), tokenizer, prompts, out)
    return out


def evaluate_final(variant: Path) -> None:
    """The eval of a variant's last policy (``grpo/training_log/final_policy``) when the
    held-out guard exported another: into ``variant/final`` (its ``grpo`` a link to the
    variant's, so ``table`` reads it as a row)."""
    record = json.loads((variant / "sets.json").read_text())
    run, config_run = Path(record["run"]), Path(record["config_run"])
    final = variant / "final"
    final.mkdir(exist_ok=True)
    if not (final / "grpo").exists():
        (final / "grpo").symlink_to(variant / "grpo")
    policy = variant / "grpo" / "training_log" / "final_policy"
    if (policy / "adapter_config.json").is_file():  # LoRA GRPO: merged as the GRPO step does
        policy = merged_adapter(policy, run / "sft" / "model", final / "merged_policy")
    evaluate_policy(policy, run / "sft" / "model", run_parameters(config_run)["eval"], final, False)
    steps = json.loads((variant / "grpo" / "training_log" / "grpo_summary.json").read_text())[
        "steps"
    ]
    (final / "policy.json").write_text(json.dumps({"policy": f"last ({steps}), not exported"}))
    print(f"{final}: evaluated {policy}")


def summarize(directory: Path, sft_results: Path | None = None) -> dict:
    """One row of the table, from a pipeline run's or a variant's files. A variant evaluated
    without SFT (``run --no-sft-eval``) takes SFT's summary from ``sft_results`` and its
    reasoning length ratio as the eval computes it (``reward.outcome.reasoning_length_ratio``
    of the median reasoning words, overall and per language)."""
    from reward.outcome import reasoning_length_ratio

    results = json.loads((directory / "evaluate" / "results").read_text())
    models = {m["label"]: m["summary"] for m in results["models"]}
    grpo = models["grpo"]
    if "sft" in models:
        sft, ratio = models["sft"], results["reasoning_length_ratio"]["grpo"]
    else:
        if sft_results is None:
            raise SystemExit(f"{directory}: evaluated without SFT; give --sft-results")
        reference = json.loads(sft_results.read_text())
        sft = {m["label"]: m["summary"] for m in reference["models"]}["sft"]
        if reference["sampling"] != results["sampling"]:
            raise SystemExit(f"{sft_results}: sampled unlike {directory}'s eval")

        def words(summary: dict, language: str | None = None) -> float:
            part = summary["overall"] if language is None else summary["per_language"][language]
            return part["median_reasoning_words"]["value"]

        ratio = {
            "overall": reasoning_length_ratio(words(grpo), words(sft)),
            "per_language": {
                lang: reasoning_length_ratio(words(grpo, lang), words(sft, lang))
                for lang in LANGUAGES
            },
        }
    log = directory / "grpo" / "training_log"
    lines = [json.loads(line) for line in (log / "training_metrics.jsonl").read_text().splitlines()]
    steps = [line["step_time_s"] for line in lines if "step_time_s" in line]
    summary = json.loads((log / "grpo_summary.json").read_text())

    def per_language(summary: dict, key: str) -> dict:
        return {lang: summary["per_language"][lang][key]["value"] for lang in LANGUAGES}

    return {
        "sft_both": sft["overall"]["both_language_accuracy"]["value"],
        "both": grpo["overall"]["both_language_accuracy"]["value"],
        "both_per_language": per_language(grpo, "both_language_accuracy"),
        "loop_rate": grpo["overall"]["loop_rate"]["value"],
        "loop_per_language": per_language(grpo, "loop_rate"),
        "ratio": ratio["overall"],
        "ratio_per_language": {lang: ratio["per_language"][lang] for lang in LANGUAGES},
        "mean_reward": grpo["overall"]["mean_reward"]["value"],
        "held_out": {
            line["step"]: line["eval_both_language_accuracy"]
            for line in lines
            if "eval_both_language_accuracy" in line
        },
        "collapsed_steps": [line["step"] for line in lines if line.get("eval_reasoning_collapsed")],
        "exported_step": (
            json.loads((directory / "policy.json").read_text())["policy"]
            if (directory / "policy.json").is_file()
            else summary["exported_step"]
        ),
        "steps": len(steps),
        "step_time_s": statistics.mean(steps),
    }


def table(rows: dict[str, dict]) -> str:
    def cells(values: dict, digits: int = 2) -> str:
        return " | ".join(f"{values[lang]:.{digits}f}" for lang in LANGUAGES)

    out = [
        "| variant | both-language (SFT → GRPO) | " + " | ".join(LANGUAGES) + " | mean reward |",
        "|---|---|" + "---|" * len(LANGUAGES) + "---|",
    ]
    for name, r in rows.items():
        out.append(
            f"| {name} | {r['sft_both']:.3f} → **{r['both']:.3f}** | "
            f"{cells(r['both_per_language'])} | {r['mean_reward']:.3f} |"
        )
    out += [
        "",
        "| variant | loop rate | "
        + " | ".join(f"loop {x}" for x in LANGUAGES)
        + " | length ratio | "
        + " | ".join(f"ratio {x}" for x in LANGUAGES)
        + " |",
        "|---|---|" + "---|" * (2 * len(LANGUAGES) + 1),
    ]
    for name, r in rows.items():
        out.append(
            f"| {name} | {r['loop_rate']:.3f} | {cells(r['loop_per_language'])} | "
            f"{r['ratio']:.2f} | {cells(r['ratio_per_language'])} |"
        )
    steps = sorted(set().union(*(r["held_out"] for r in rows.values())))
    out += [
        "",
        "| variant | "
        + " | ".join(f"step {s}" for s in steps)
        + " | exported step | s/step (mean) |",
        "|---|" + "---|" * (len(steps) + 2),
    ]
    for name, r in rows.items():
        curve = " | ".join(
            f"{r['held_out'][s]:.3f}{'*' if s in r['collapsed_steps'] else ''}"
            if s in r["held_out"]
            else "–"
            for s in steps
        )
        out.append(
            f"| {name} | {curve} | {r['exported_step']} | {r['step_time_s']:.2f} "
            f"({r['steps']} steps) |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run", help="GRPO + export + eval of one variant on a run's SFT model")
    one.add_argument("--run", type=Path, required=True, help="a finished local run's directory")
    one.add_argument(
        "--config-run",
        type=Path,
        help="read the step configs from this run's configure step instead (a run of newer "
        "code whose SFT did not finish; its data and SFT config must be --run's)",
    )
    one.add_argument("-o", "--output", type=Path, required=True)
    one.add_argument("--set", dest="sets", action="append", default=[], help="grpo.FIELD=VALUE")
    one.add_argument(
        "--no-sft-eval",
        dest="sft_eval",
        action="store_false",
        help="evaluate the policy alone (SFT's responses are the run's: same model and seeds)",
    )
    final = sub.add_parser(
        "eval-final", help="eval a variant's last policy (guard exported another)"
    )
    final.add_argument("variant", type=Path, help="a `run`'s -o")
    many = sub.add_parser("table", help="the Markdown tables of NAME=DIR rows")
    many.add_argument("rows", nargs="+", help="NAME=DIR (a local run's directory or a run's -o)")
    many.add_argument("--json", type=Path, help="also write the rows as JSON here")
    many.add_argument(
        "--sft-results",
        type=Path,
        help="the eval results holding SFT, for rows evaluated with --no-sft-eval",
    )
    args = parser.parse_args(argv)
    if args.command == "run":
        config_run = args.config_run.resolve() if args.config_run else None
        run_variant(args.run.resolve(), args.output.resolve(), args.sets, config_run, args.sft_eval)
        return 0
    if args.command == "eval-final":
        evaluate_final(args.variant.resolve())
        return 0
    rows = {}
    for item in args.rows:
        name, sep, directory = item.partition("=")
        if not sep:
            parser.error(f"{item!r}: expected NAME=DIR")
        rows[name] = summarize(Path(directory), args.sft_results)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
