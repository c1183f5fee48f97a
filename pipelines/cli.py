"""The ``lingo`` command line: run the pipeline locally, compile it, run one step alone."""

from __future__ import annotations

import functools
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Annotated

import click
import typer

from pipelines.presets import (
    DEFAULT_PRESET,
    PRESETS,
    Preset,
    UnknownPresetError,
    apply_overrides,
    get_preset,
)

log = logging.getLogger(__name__)

app = typer.Typer(
    help=(
        "lingo-rl: post-train gpt-oss with GRPO so that it reasons and answers in the user's "
        "language.\n\nStart with `lingo run --local` (the whole pipeline on this machine, "
        "tiny model, bundled data), then `lingo compile` to get the pipeline for Kubeflow."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

SetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="Override a preset value, STEP.FIELD=VALUE (repeatable), e.g. data_prep.seed=7.",
    ),
]
PresetOption = Annotated[
    str,
    typer.Option(help=f"Named configuration; one of: {', '.join(PRESETS)}."),
]


def _version_callback(value: bool) -> None:
    if value:
        try:
            typer.echo(f"lingo-rl {version('lingo-rl')}")
        except PackageNotFoundError:
            typer.echo("lingo-rl (not installed)")
        raise typer.Exit()


@app.callback()
def main(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version_callback, is_eager=True, help="Show the version."
        ),
    ] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")] = False,
) -> None:
    _options.verbose = verbose
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@dataclass
class _GlobalOptions:
    """The options given before the command (``lingo --verbose data-prep …``)."""

    verbose: bool = False


_options = _GlobalOptions()

PROJECT_PACKAGES = ("core", "reward", "data_prep", "trainer", "eval", "pipelines", "components")


def _is_project_error(exc: BaseException) -> bool:
    """Errors the project raises on purpose (their message is the whole story), and the
    file-system errors that name their file; anything else is a bug and keeps its traceback."""
    if isinstance(exc, FileNotFoundError | PermissionError | IsADirectoryError):
        return True
    return any(cls.__module__.split(".")[0] in PROJECT_PACKAGES for cls in type(exc).__mro__)


def clear_errors(command: Callable) -> Callable:
    """A command's own errors become one line on stderr and exit status 1 (the traceback
    too under ``lingo --verbose``)."""

    @functools.wraps(command)
    def run_command(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:
            if not _is_project_error(exc):
                raise
            if _options.verbose:
                typer.echo(traceback.format_exc(), err=True)
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from exc

    return run_command


def _parse_sets(sets: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in sets or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"{item!r}: expected STEP.FIELD=VALUE", param_hint="--set")
        out[key.strip()] = value
    return out


def _load_preset(name: str, sets: list[str] | None):
    overrides = _parse_sets(sets)
    try:
        return apply_overrides(get_preset(name), overrides)
    except (KeyError, ValueError) as exc:
        raise typer.BadParameter(str(exc).strip("'\"")) from exc


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
    from pipelines.local_run import run_local

    config = _load_preset(preset, sets)
    result = run_local(
        config,
        output_dir,
        enable_caching=cache,
        quiet=not _options.verbose,
        on_log=lambda path: typer.echo(
            f"local run of preset {config.name!r}: one line per step; kfp.local's output and "
            f"the steps' logs go to {path}"
        ),
    )
    typer.echo(f"\nlocal run of preset {config.name!r} finished in {result.seconds:.1f} s")
    outputs = dict(result.outputs)
    reports = outputs.pop("reports", None)
    typer.echo(f"all task outputs: {result.pipeline_root}")
    for name, path in outputs.items():
        typer.echo(f"  {name}: {path}")
    if reports is not None:
        names = ", ".join(sorted(p.name for p in reports.iterdir()))
        typer.echo(f"\nreports (open the .html ones in a browser): {reports}/ {names}")
    if "eval_results" in outputs:
        typer.echo("\neval, base vs SFT vs GRPO (overall figures; per language: reports/eval.html)")
        typer.echo(headline(outputs["eval_results"]))


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
) -> None:
    """Compile the pipeline to KFP v2 YAML, with the preset's values as parameter defaults."""
    from pipelines.compile import compile_pipeline

    if not output.parent.is_dir():
        raise typer.BadParameter(
            f"directory {output.parent} does not exist; create it first", param_hint="--output"
        )

    path = compile_pipeline(output, _load_preset(preset, sets))
    typer.echo(f"wrote {path}")


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
    config = _load_preset(preset, overrides).data_prep
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
    typer.echo(
        f"{report.rows_read} rows: {report.train_rows} train{synthetic}, {report.eval_rows} eval, "
        f"{report.quarantined} quarantined → {output_dir}"
    )


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
    max_tokens: Annotated[int, typer.Option()] = 512,
    temperature: Annotated[float, typer.Option()] = 0.7,
    limit: Annotated[int | None, typer.Option(help="Only the first N questions")] = None,
) -> None:
    """Run the 50-question multilingual eval on one or more models; writes results.json and
    the Markdown/HTML reports."""
    from eval.runner import run_eval_cli

    report = run_eval_cli(
        model,
        output_dir,
        engine=engine,
        samples=samples,
        max_tokens=max_tokens,
        temperature=temperature,
        limit=limit,
    )
    typer.echo(f"report: {report}")
    typer.echo(headline(Path(report).parent / "results.json"))


@app.command()
def presets() -> None:
    """List the named configurations."""
    for name, preset in PRESETS.items():
        typer.echo(f"{name:14s} {preset.description}")


@app.command()
def estimate(
    model: Annotated[
        str | None,
        typer.Option(
            help="Model preset (gpt-oss-20b, gpt-oss-120b, tiny-gpt-oss), a model "
            "directory or a config.json [default: gpt-oss-20b, or the --preset's model]."
        ),
    ] = None,
    layout: Annotated[
        str | None,
        typer.Option(
            help="Layout preset: g5.12xlarge-x6-openrlhf, g5.12xlarge-x6-openrlhf-12train, "
            "g5.12xlarge-x6-openrlhf-hybrid, p5en.48xlarge-x2-megatron, tiny-cpu "
            "[default: g5.12xlarge-x6-openrlhf, or the --preset's hardware]."
        ),
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            help="A pipeline preset: print its GRPO placement plan and estimate its SFT and "
            "GRPO steps as configured (processes, batch, lengths, engines) on its hardware "
            "(or --layout's machines), as the pipeline's capacity check does."
        ),
    ] = None,
    sets: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Override a layout field, KEY=VALUE (repeatable), e.g. micro_train_batch_size=2.",
        ),
    ] = None,
) -> None:
    """Estimate GPU memory, host memory and storage of a GRPO/SFT layout, with a verdict.

    Exits with status 1 when the layout does not fit."""
    from capacity import (
        LayoutDoesNotFit,
        LayoutError,
        ModelSpecError,
        check_layout,
        render_estimate,
    )
    from trainer.placement import PlacementError

    overrides = _parse_sets(sets)
    try:
        if preset is not None:
            _estimate_preset(get_preset(preset), model, layout, overrides)
            return
        model, layout = model or "gpt-oss-20b", layout or "g5.12xlarge-x6-openrlhf"
        typer.echo(render_estimate(model, layout, overrides))
        check_layout(model, layout, overrides)
    except (ModelSpecError, LayoutError, PlacementError, UnknownPresetError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    except LayoutDoesNotFit:
        raise typer.Exit(1) from None


def _estimate_preset(
    preset: Preset, model: str | None, layout: str | None, overrides: dict[str, str]
) -> None:
    """``lingo estimate --preset``: the placement plan, then SFT's and GRPO's tables."""
    from capacity import MODEL_PRESETS, Verdict, format_table
    from pipelines.presets import run_estimates

    if model is None:  # the preset's model, where the planner knows it by name
        name = "tiny-gpt-oss" if preset.model.source == "tiny" else preset.model.source
        model = name.rsplit("/", 1)[-1] if name.rsplit("/", 1)[-1] in MODEL_PRESETS else name
    plan, estimates = run_estimates(preset, model, layout, overrides)
    typer.echo(plan.render())
    for step, result in estimates.items():
        typer.echo(f"\n{step.upper()}\n{format_table(result)}")
    if any(e.verdict is Verdict.DOES_NOT_FIT for e in estimates.values()):
        raise typer.Exit(1)


EndpointOption = Annotated[
    str,
    typer.Option(
        "--endpoint",
        envvar="KFP_ENDPOINT",
        help="KFP API base URL (bearer token, if needed, from $KFP_TOKEN).",
    ),
]


@app.command()
@clear_errors
def submit(
    endpoint: EndpointOption,
    experiment: Annotated[
        str, typer.Option(help="KFP experiment, created if missing.")
    ] = "lingo-rl",
    preset: PresetOption = DEFAULT_PRESET,
    sets: SetOption = None,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the run until it ends.")] = False,
) -> None:
    """Compile the pipeline, upload it as a new version and start a run on a KFP server."""
    from pipelines.kfp_client import (
        KfpApiError,
        KfpConnection,
        RunFailedError,
        submit_preset,
        wait_for_run,
    )

    conn = KfpConnection.from_env(endpoint)
    try:
        submitted = submit_preset(conn, _load_preset(preset, sets), experiment=experiment)
        typer.echo(f"run {submitted.run_id}: {submitted.url}")
        if wait:
            typer.echo(f"run {submitted.run_id}: {wait_for_run(conn, submitted.run_id).state}")
    except (KfpApiError, RunFailedError) as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from exc


@app.command()
@clear_errors
def schedule(
    endpoint: EndpointOption,
    cron: Annotated[str, typer.Option(help='Cron, 5 fields ("30 2 * * *") or KFP\'s 6.')],
    preset: PresetOption = DEFAULT_PRESET,
    sets: SetOption = None,
    experiment: Annotated[
        str, typer.Option(help="KFP experiment, created if missing.")
    ] = "lingo-rl",
) -> None:
    """Schedule a recurring run that always uses the pipeline's latest version."""
    from pipelines.kfp_client import KfpApiError, KfpConnection, schedule_preset

    try:
        recurring_id = schedule_preset(
            KfpConnection.from_env(endpoint),
            _load_preset(preset, sets),
            cron,
            experiment=experiment,
        )
    except ValueError as exc:  # a bad cron
        raise typer.BadParameter(str(exc), param_hint="--cron") from exc
    except KfpApiError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"recurring run {recurring_id} on {cron!r}")


@app.command()
@clear_errors
def status(
    run_id: Annotated[str, typer.Argument(help="The run id (lingo submit prints it).")],
    endpoint: EndpointOption,
) -> None:
    """Show a run's state; exit 1 when it FAILED or was CANCELED."""
    from pipelines.kfp_client import FAILED_STATES, KfpApiError, KfpConnection, get_run, run_url

    conn = KfpConnection.from_env(endpoint)
    try:
        run = get_run(conn, run_id)
    except KfpApiError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from exc
    typer.echo(f"{run.run_id} {run.state} {run.display_name} {run_url(conn, run_id)}")
    if run.error:
        typer.echo(f"error: {run.error}", err=True)
    if run.state in FAILED_STATES:
        raise typer.Exit(1)
