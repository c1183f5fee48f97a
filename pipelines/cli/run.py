"""Running the pipeline and its steps here: ``lingo run``, ``compile``, ``data-prep``, ``eval``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from eval.eval_config import SamplingSettings
from pipelines.cli.app import (
    PresetOption,
    SetOption,
    app,
    clear_errors,
    echo,
    global_options,
    load_preset,
)
from pipelines.presets import (
    DEFAULT_PRESET,
    PRESETS,
)


@app.command()
@clear_errors
def run(
    local: Annotated[
        bool, typer.Option("--local", help="Run every step on this machine with kfp.local.")
    ] = False,
    preset: PresetOption = DEFAULT_PRESET,
    output_dir: Annotated[
        Path, typer.Option("--output-dir", "-o", help="Where the steps write their outputs.")
    ] = Path("runs/local"),
    cache: Annotated[
        bool, typer.Option(help="Reuse outputs of steps whose inputs did not change.")
    ] = False,
    sets: SetOption = None,
) -> None:
    """Run the pipeline. With --local: data prep (and the later steps) on this machine."""
    if not local:
        raise typer.BadParameter(
            "only --local runs from here; for a cluster use `lingo submit --endpoint URL`",
            param_hint="--local",
        )
    from pipelines.local_run import run_local, tracking_summary

    config = load_preset(preset, sets)
    result = run_local(
        config,
        output_dir,
        enable_caching=cache,
        quiet=not global_options.verbose,
        on_log=lambda path: echo(
            f"local run of preset {config.name!r}: one line per step; kfp.local's output and "
            f"the steps' logs go to {path}"
        ),
    )
    echo(f"\nlocal run of preset {config.name!r} finished in {result.seconds:.1f} s")
    outputs = dict(result.outputs)
    reports = outputs.pop("reports", None)
    echo(f"all task outputs: {result.pipeline_root}")
    for name, path in outputs.items():
        echo(f"  {name}: {path}")
    if reports is not None:
        names = ", ".join(sorted(p.name for p in reports.iterdir()))
        echo(f"\nreports (open the .html ones in a browser): {reports}/ {names}")
    if "eval_results" in outputs:
        echo("\neval, base vs SFT vs GRPO (overall figures; per language: reports/eval.html)")
        echo(headline(outputs["eval_results"]))
    if lines := tracking_summary(result, config.gate):
        echo("")
        for line in lines:
            echo(line)


HEADLINE_METRICS = (
    "mean_reward",
    "reasoning_language_accuracy",
    "answer_language_accuracy",
    "both_language_accuracy",
    "real_word_share",
)


def headline(results_json: Path) -> str:
    """A small table of the eval's overall metrics, one row per model."""
    import json

    results = json.loads(Path(results_json).read_text())
    widths = {m: len(m) + 2 for m in HEADLINE_METRICS}
    rows = [f"{'model':<8}" + "".join(f"{m:>{w}}" for m, w in widths.items())]
    for model in results["models"]:
        overall = model["summary"]["overall"]
        cells = "".join(
            f"{overall[m]['value']:>{w}.3f}"
            if overall.get(m, {}).get("value") is not None
            else f"{'-':>{w}}"
            for m, w in widths.items()
        )
        rows.append(f"{model['label']:<8}{cells}")
    return "\n".join(rows)


@app.command("compile")
@clear_errors
def compile_cmd(
    output: Annotated[Path, typer.Option("--output", "-o", help="YAML file to write.")] = Path(
        "lingo_pipeline.yaml"
    ),
    preset: PresetOption = DEFAULT_PRESET,
    sets: SetOption = None,
    every_preset: Annotated[
        bool,
        typer.Option(
            "--all",
            help="Write every preset's pipeline, as it is, to the repo's pipelines/compiled/ "
            "(<preset>.yaml, the files a test checks for drift).",
        ),
    ] = False,
) -> None:
    """Compile the preset's pipeline to KFP v2 YAML: its run form defaults to the preset's
    values (with --set's), the same bytes every time."""
    from pipelines.compile import compile_pipeline, compiled_path

    if every_preset:
        if sets:
            raise typer.BadParameter("--all writes the presets as they are", param_hint="--set")
        for name, config in PRESETS.items():
            echo(f"wrote {compile_pipeline(compiled_path(name), config)}")
        return
    if not output.parent.is_dir():
        raise typer.BadParameter(
            f"directory {output.parent} does not exist; create it first", param_hint="--output"
        )

    path = compile_pipeline(output, load_preset(preset, sets))
    echo(f"wrote {path}")


@app.command("data-prep")
@clear_errors
def data_prep_cmd(
    output_dir: Annotated[
        Path, typer.Option("--output-dir", "-o", help="Directory for train/eval/quarantine JSONL.")
    ] = Path("runs/data"),
    source: Annotated[
        str | None,
        typer.Option(
            help="'bundled', a hub id, a local dir/.jsonl/.parquet, or s3://bucket/prefix "
            "(default: the preset's)."
        ),
    ] = None,
    preset: PresetOption = DEFAULT_PRESET,
    sets: SetOption = None,
) -> None:
    """Run only the data-prep step, outside KFP; writes train.jsonl, eval.jsonl,
    quarantine.jsonl and dataset_card.md."""
    from data_prep.prepare import prepare_dataset

    overrides = list(sets or []) + ([f"data_prep.source={source}"] if source else [])
    config = load_preset(preset, overrides).data_prep
    report = prepare_dataset(
        config,
        output_dir / "train.jsonl",
        output_dir / "eval.jsonl",
        output_dir / "quarantine.jsonl",
        output_dir / "dataset_card.md",
    )
    synthetic = f" (+{report.synthetic_rows} synthetic)" if report.synthetic_rows else ""
    if report.prompt_only_rows:
        synthetic += f" (+{report.prompt_only_rows} question-set prompts)"
    echo(
        f"{report.rows_read} rows: {report.train_rows} train{synthetic}, {report.eval_rows} eval, "
        f"{report.quarantined} quarantined → {output_dir}"
    )


EVAL_SAMPLING = SamplingSettings()
"""`lingo eval`'s sampling defaults: the eval's own (``eval.eval_config.SamplingSettings``)."""


@app.command("eval")
@clear_errors
def eval_cmd(
    model: Annotated[
        list[str],
        typer.Option(
            "--model",
            "-m",
            help="[label=]DIR (a HF model directory) or [label=]URL[#served-name] (an "
            "OpenAI-compatible endpoint, API key from $OPENAI_API_KEY); repeat to compare "
            "side by side, the first is the baseline.",
        ),
    ],
    output_dir: Annotated[Path, typer.Option("--output-dir", "-o")] = Path("runs/eval"),
    engine: Annotated[str, typer.Option(help="hf or vllm, for directories")] = "hf",
    samples: Annotated[int, typer.Option(help="Samples per question")] = 1,
    max_tokens: Annotated[int, typer.Option()] = EVAL_SAMPLING.max_tokens,
    temperature: Annotated[float, typer.Option()] = EVAL_SAMPLING.temperature,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass")] = EVAL_SAMPLING.top_p,
    seed: Annotated[
        int, typer.Option(help="Base seed; each response has its own seed derived from it")
    ] = EVAL_SAMPLING.seed,
    limit: Annotated[int | None, typer.Option(help="Only the first N questions")] = None,
    api: Annotated[
        str,
        typer.Option(
            help="Endpoints: chat (/v1/chat/completions; the server renders the chat) or "
            "completions (/v1/completions; the harmony prompt rendered here and tokenized by "
            "the model's own tokenizer: for a gpt-oss model whose tokenizer is not gpt-oss's, "
            "as `lingo serve` says)."
        ),
    ] = "chat",
    timeout: Annotated[
        float, typer.Option(help="Endpoints: longest wait for the next bytes of an answer (s).")
    ] = 120.0,
    connect_timeout: Annotated[
        float, typer.Option(help="Endpoints: longest wait to connect (s).")
    ] = 10.0,
    request_timeout: Annotated[
        float, typer.Option(help="Endpoints: bound on one request, its retries included (s).")
    ] = 300.0,
    run_timeout: Annotated[
        float, typer.Option(help="Endpoints: bound on all of one model's requests (s).")
    ] = 3600.0,
    retries: Annotated[int, typer.Option(help="Endpoints: retries of a failed request.")] = 3,
    max_reply_bytes: Annotated[
        int,
        typer.Option(
            help="Endpoints: largest reply read (bytes); a larger one is that response's failure."
        ),
    ] = 8 << 20,
) -> None:
    """Run the 50-question multilingual eval on one or more models; writes results.json and
    the Markdown/HTML reports. Every wait on an endpoint is bounded (--timeout,
    --connect-timeout, --request-timeout, --run-timeout)."""
    from eval.cli import run_eval_cli

    report = run_eval_cli(
        model,
        output_dir,
        engine=engine,
        samples=samples,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        limit=limit,
        api=api,
        timeout_s=timeout,
        connect_timeout_s=connect_timeout,
        request_timeout_s=request_timeout,
        run_timeout_s=run_timeout,
        max_retries=retries,
        max_reply_bytes=max_reply_bytes,
    )
    echo(f"report: {report}")
    echo(headline(Path(report).parent / "results.json"))
