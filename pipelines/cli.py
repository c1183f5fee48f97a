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

import typer

from core.errors import describe_error
from core.redact import configure_logging, for_console
from eval.eval_config import SamplingSettings
from pipelines.presets import (
    DEFAULT_PRESET,
    PRESETS,
    AssignmentError,
    Preset,
    UnknownPresetError,
    apply_overrides,
    get_preset,
    parse_assignments,
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
        help="Override a preset value, STEP.FIELD=VALUE (repeatable), e.g. data_prep.seed=7 "
        "or backend=megatron.",
    ),
]
PresetOption = Annotated[
    str,
    typer.Option(help=f"Named configuration; one of: {', '.join(PRESETS)}."),
]


def _version_callback(value: bool) -> None:
    if value:
        try:
            echo(f"lingo-rl {version('lingo-rl')}")
        except PackageNotFoundError:
            echo("lingo-rl (not installed)")
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
    configure_logging(
        logging.DEBUG if verbose else logging.INFO,
        "%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@dataclass
class _GlobalOptions:
    """The options given before the command (``lingo --verbose data-prep …``)."""

    verbose: bool = False


_options = _GlobalOptions()


def echo(text: str, err: bool = False) -> None:
    """Print a line, credentials redacted and terminal controls escaped (``core.redact``):
    what every command prints."""
    typer.echo(for_console(text), err=err)


def clear_errors(command: Callable) -> Callable:
    """A command's expected failures become one line on stderr and exit status 1 (2 for a
    bad option value; the traceback too under ``lingo --verbose``); anything else is a bug and
    keeps its traceback."""

    @functools.wraps(command)
    def run_command(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except typer.BadParameter as exc:  # a value the command itself refused
            echo(f"error: {' '.join(exc.format_message().split())}", err=True)
            raise typer.Exit(2) from exc
        except (typer.Exit, typer.Abort):
            raise
        except KeyboardInterrupt:  # SIGINT: what a local run stopped is said by then
            echo("error: interrupted (SIGINT)", err=True)
            raise typer.Exit(1) from None
        except Exception as exc:
            # an expected failure (core.errors.describe_error), or None: a bug
            line = describe_error(exc, kwargs.get("output_dir") or kwargs.get("output"))
            if line is None:
                raise
            if _options.verbose:
                echo(traceback.format_exc(), err=True)
            echo(f"error: {line}", err=True)
            raise typer.Exit(1) from exc

    return run_command


def _parse_sets(sets: list[str] | None) -> dict[str, str]:
    try:
        return parse_assignments(sets or [])
    except AssignmentError as exc:
        raise typer.BadParameter(str(exc).removeprefix("--set: "), param_hint="--set") from None


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
    from pipelines.local_run import run_local, tracking_summary

    config = _load_preset(preset, sets)
    result = run_local(
        config,
        output_dir,
        enable_caching=cache,
        quiet=not _options.verbose,
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

    path = compile_pipeline(output, _load_preset(preset, sets))
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
    from eval.runner import run_eval_cli

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


@app.command()
@clear_errors
def serve(
    model: Annotated[
        str,
        typer.Argument(
            help="A model folder (a run's exported GRPO model: the grpo_model path `lingo run "
            "--local` prints), or a registered version as an MLflow model URI: "
            "models:/lingo-gpt-oss@champion (the gate's champion; needs MLFLOW_TRACKING_URI) "
            "or models:/NAME/VERSION."
        ),
    ],
    port: Annotated[int, typer.Option(help="Port of the OpenAI-compatible API.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    name: Annotated[
        str, typer.Option(help="The served model name (the cluster's InferenceService name).")
    ] = "lingo-gpt-oss",
    max_model_len: Annotated[int, typer.Option(help="vLLM's context length.")] = 2048,
    python: Annotated[
        str | None,
        typer.Option(
            help="A Python with vLLM [default: $LINGO_VLLM_PYTHON, else .venv-vllm (make "
            "test-vllm builds it), else this one]."
        ),
    ] = None,
    log_file: Annotated[
        Path, typer.Option("--log-file", help="Where the server's output goes.")
    ] = Path("runs/serve/vllm.log"),
    cache_dir: Annotated[
        Path,
        typer.Option("--cache-dir", help="Where a models:/ URI's version is downloaded (once) to."),
    ] = Path("runs/serve/models"),
) -> None:
    """Serve a model folder or the registry's champion with vLLM's OpenAI-compatible server
    (gpt-oss's reasoning parser, as the cluster's InferenceService does); print the endpoint
    and the `lingo eval` command that scores it (through /v1/completions for a gpt-oss model
    with its own tokenizer, which vLLM's chat cannot render); run until interrupted (Ctrl-C or
    SIGTERM: the server is stopped with it)."""
    from pipelines.serve_local import chat_api_problem, resolve_model, server_command, vllm_python

    folder = resolve_model(model, cache_dir)
    if folder != Path(model):
        echo(f"{model} is {folder}")
    problem = chat_api_problem(folder)
    if problem is not None:
        echo(
            f"{problem}: it is scored through /v1/completions instead (the harmony prompt "
            "rendered by `lingo eval --api completions`, tokenized by the model's own tokenizer)"
        )
    import torch

    command = server_command(
        folder,
        vllm_python(python),
        host=host,
        port=port,
        name=name,
        max_model_len=max_model_len,
        cpu=not torch.cuda.is_available(),
        dtype="auto" if torch.cuda.is_available() else "float32",
    )
    api = "chat" if problem is None else "completions"
    _serve_until_stopped(model, command, f"http://{host}:{port}/v1", name, log_file, api)


def _serve_until_stopped(
    model: str, command: list[str], base: str, name: str, log_file: Path, api: str
) -> None:
    """Start the server, print its endpoint and the command that scores it, and wait until it
    ends or is interrupted (Ctrl-C or SIGTERM: the server is stopped with it); exit 1 when it
    did not start or ended with an error."""
    from pipelines.serve_local import start_server, terminate_as_interrupt

    echo(f"starting vLLM on {model} (log: {log_file}) …")
    server = None
    with terminate_as_interrupt():
        try:  # interrupted while it starts, start_server stops the process it started
            server = start_server(command, base, name, log_file, api=api)
            parser = "reasoning parser openai_gptoss"
            echo(f"serving {model} as {name!r} at {base} (OpenAI API; {parser})")
            echo(f"score it: {server.eval_command}")
            server.process.wait()
        except KeyboardInterrupt:
            echo("stopping")
        finally:
            if server is not None:
                server.stop()
    if server is None or server.process.returncode not in (0, -15, None):
        raise typer.Exit(1)


@app.command()
def presets() -> None:
    """List the named configurations."""
    for name, preset in PRESETS.items():
        echo(f"{name:14s} {preset.description}")


@app.command()
@clear_errors
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
        echo(render_estimate(model, layout, overrides))
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
    echo(plan.render())
    for step, result in estimates.items():
        echo(f"\n{step.upper()}\n{format_table(result)}")
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
        echo(f"run {submitted.run_id}: {submitted.url}")
        if wait:
            echo(f"run {submitted.run_id}: {wait_for_run(conn, submitted.run_id).state}")
    except (KfpApiError, RunFailedError) as exc:
        echo(str(exc), err=True)
        raise typer.Exit(1) from exc


schedule_app = typer.Typer(
    help="Schedule the pipeline (a recurring run pinned to the version uploaded now), or list, "
    "pause, resume and delete schedules.",
    no_args_is_help=False,
)
app.add_typer(schedule_app, name="schedule")
ExperimentOption = Annotated[str, typer.Option(help="KFP experiment, created if missing.")]
OptionalEndpoint = Annotated[
    str | None,
    typer.Option(
        "--endpoint",
        envvar="KFP_ENDPOINT",
        help="KFP API base URL (bearer token, if needed, from $KFP_TOKEN).",
    ),
]


@schedule_app.callback(invoke_without_command=True)
@clear_errors
def schedule(
    ctx: typer.Context,
    endpoint: OptionalEndpoint = None,
    cron: Annotated[
        str | None, typer.Option(help='Cron, 5 fields ("30 2 * * *") or KFP\'s 6.')
    ] = None,
    preset: PresetOption = DEFAULT_PRESET,
    sets: SetOption = None,
    experiment: ExperimentOption = "lingo-rl",
    name: Annotated[
        str | None,
        typer.Option(
            help="The schedule's name [default: <preset>-recurring]; an existing "
            "schedule of that name in the experiment is replaced."
        ),
    ] = None,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print what would be created and replaced; change nothing."),
    ] = False,
) -> None:
    """Upload the preset's pipeline as a new version and schedule it on --cron, pinned to that
    version (another preset's submit does not change what it runs); the same name again
    replaces the schedule."""
    if ctx.invoked_subcommand is not None:
        return
    if endpoint is None:
        raise typer.BadParameter(
            "give the KFP API URL (or set $KFP_ENDPOINT)", param_hint="--endpoint"
        )
    if cron is None:
        raise typer.BadParameter('give the schedule, e.g. --cron "30 2 * * *"', param_hint="--cron")
    from pipelines.kfp_client import CronError, KfpApiError, KfpConnection, cron_with_seconds
    from pipelines.schedules import plan_schedule, schedule_preset

    try:
        cron_with_seconds(cron)  # a bad cron fails before any request
    except CronError as exc:
        raise typer.BadParameter(str(exc), param_hint="--cron") from exc
    conn = KfpConnection.from_env(endpoint)  # a bad endpoint: one line naming it
    config = _load_preset(preset, sets)
    try:
        plan = plan_schedule(conn, config, cron, name=name, experiment=experiment)
        if dry_run:
            echo(f"dry run, nothing created:\n{plan.render()}")
            return
        created, version = schedule_preset(conn, config, plan)
    except KfpApiError as exc:
        echo(str(exc), err=True)
        raise typer.Exit(1) from exc
    echo(plan.render(version))
    echo(f"recurring run {created.recurring_run_id} {created.status} on {plan.cron!r}")


def _schedule_connection(endpoint: str | None):
    from pipelines.kfp_client import KfpConnection

    if endpoint is None:
        raise typer.BadParameter(
            "give the KFP API URL (or set $KFP_ENDPOINT)", param_hint="--endpoint"
        )
    return KfpConnection.from_env(endpoint)


@schedule_app.command("list")
@clear_errors
def schedule_list(
    endpoint: OptionalEndpoint = None,
    experiment: Annotated[
        str | None, typer.Option(help="Only this KFP experiment's schedules [default: all].")
    ] = None,
) -> None:
    """List the schedules: name, id, status, cron, pipeline version (pinned or latest)."""
    from pipelines.kfp_client import KfpApiError
    from pipelines.schedules import find_experiment, list_schedules

    conn = _schedule_connection(endpoint)
    try:
        experiment_id = find_experiment(conn, experiment) if experiment else None
        if experiment and experiment_id is None:
            echo(f"no experiment {experiment!r}: no schedules")
            return
        schedules = list_schedules(conn, experiment_id)
    except KfpApiError as exc:
        echo(str(exc), err=True)
        raise typer.Exit(1) from exc
    if not schedules:
        echo("no schedules")
    for s in schedules:
        version = s.pipeline_version_id or "latest (not pinned)"
        echo(
            f"{s.display_name}  {s.recurring_run_id}  {s.status}  {s.cron!r}  "
            f"pipeline {s.pipeline_id} version {version}"
        )


def _schedule_action(name: str, endpoint: str | None, experiment: str, action: str) -> None:
    """pause, resume or delete every schedule called ``name`` (or the one with that id)."""
    from pipelines.kfp_client import KfpApiError
    from pipelines.schedules import (
        ScheduleNotFoundError,
        delete_schedule,
        resolve_schedules,
        set_enabled,
    )

    conn = _schedule_connection(endpoint)
    try:
        for found in resolve_schedules(conn, name, experiment):
            if action == "delete":
                delete_schedule(conn, found)
            else:
                set_enabled(conn, found, action == "resume")
            done = {"pause": "paused", "resume": "resumed", "delete": "deleted"}[action]
            echo(f"{done} {found.display_name} ({found.recurring_run_id})")
    except ScheduleNotFoundError as exc:
        raise typer.BadParameter(str(exc), param_hint="NAME") from exc
    except KfpApiError as exc:
        echo(str(exc), err=True)
        raise typer.Exit(1) from exc


ScheduleName = Annotated[str, typer.Argument(help="The schedule's name (or its recurring run id).")]


@schedule_app.command("pause")
@clear_errors
def schedule_pause(
    name: ScheduleName,
    endpoint: OptionalEndpoint = None,
    experiment: ExperimentOption = "lingo-rl",
) -> None:
    """Pause a schedule (it starts no runs until resumed)."""
    _schedule_action(name, endpoint, experiment, "pause")


@schedule_app.command("resume")
@clear_errors
def schedule_resume(
    name: ScheduleName,
    endpoint: OptionalEndpoint = None,
    experiment: ExperimentOption = "lingo-rl",
) -> None:
    """Resume a paused schedule (missed intervals are not caught up)."""
    _schedule_action(name, endpoint, experiment, "resume")


@schedule_app.command("delete")
@clear_errors
def schedule_delete(
    name: ScheduleName,
    endpoint: OptionalEndpoint = None,
    experiment: ExperimentOption = "lingo-rl",
) -> None:
    """Delete a schedule (the runs it started stay)."""
    _schedule_action(name, endpoint, experiment, "delete")


@app.command()
@clear_errors
def status(
    run_id: Annotated[str, typer.Argument(help="The run id (lingo submit prints it).")],
    endpoint: EndpointOption,
    namespace: Annotated[
        str | None,
        typer.Option(
            help="Namespace of the run's training jobs (TrainJobs, PyTorchJobs), read with "
            "the kubeconfig [default: its context's namespace].",
        ),
    ] = None,
) -> None:
    """Show a run's state and its training jobs' (queued, running, …); exit 1 when the run
    FAILED or was CANCELED (a job Kueue has not admitted yet is queued, not failed)."""
    from pipelines.kfp_client import FAILED_STATES, KfpApiError, KfpConnection, get_run, run_url

    conn = KfpConnection.from_env(endpoint)
    try:
        run = get_run(conn, run_id)
    except KfpApiError as exc:
        echo(str(exc), err=True)
        raise typer.Exit(1) from exc
    echo(f"{run.run_id} {run.state} {run.display_name} {run_url(conn, run_id)}")
    if run.error:
        echo(f"error: {run.error}", err=True)
    for line in _run_jobs(run_id, namespace):
        echo(f"  {line}")
    if run.state in FAILED_STATES:
        raise typer.Exit(1)


@app.command()
@clear_errors
def rehearse(
    preset: Annotated[
        str, typer.Option(help="A cluster preset: gpt-oss-20b or gpt-oss-20b-verl.")
    ] = "gpt-oss-20b",
    backend: Annotated[
        str | None, typer.Option(help="The GRPO branch: hf or megatron (default: the preset's).")
    ] = None,
    output_dir: Annotated[
        Path, typer.Option("--output-dir", "-o", help="Where the rehearsal's run goes.")
    ] = Path("runs/rehearsal"),
    job_api: Annotated[
        str,
        typer.Option(
            help="The job API the rehearsal's cluster serves: trainjob (Trainer v2) or "
            "pytorchjob (Training Operator v1); the preset's job_api: auto picks it."
        ),
    ] = "trainjob",
) -> None:
    """Run a cluster preset's compiled pipeline on this machine as a cluster runs it: each
    step as its pod, each TrainJob (or PyTorchJob) expanded into pods (local processes), a
    scaled-down model; print what ran, what was substituted and the result; exit 1 when
    anything failed."""
    from pipelines.rehearsal import rehearse as run_rehearsal
    from plan import UnknownSpecError, job_spec

    if backend not in (None, "hf", "megatron"):
        raise typer.BadParameter(f"{backend!r}: use hf or megatron", param_hint="--backend")
    try:
        job_spec(job_api, "--job-api")
    except UnknownSpecError as error:
        raise typer.BadParameter(str(error), param_hint="--job-api") from None
    if _load_preset(preset, None).hardware.node_type == "local":
        raise typer.BadParameter(
            f"{preset!r} runs on this machine already (lingo run --local); rehearse a cluster "
            "preset: gpt-oss-20b, gpt-oss-20b-verl",
            param_hint="--preset",
        )
    report = run_rehearsal(preset, output_dir, backend, job_api)
    echo(report.table())
    if not report.passed:
        raise typer.Exit(1)


def _run_jobs(run_id: str, namespace: str | None) -> list[str]:
    """``lingo status``'s job lines, or one line saying why they could not be read."""
    try:
        from kubernetes import config as k8s_config

        from cluster.launcher import NoKubernetesAccess, default_api_client
        from cluster.step_job import current_namespace, describe_run_jobs
    except ImportError as exc:
        return [f"training jobs not read: {exc.msg} (pip install 'lingo-rl[cluster]')"]
    try:
        api_client = default_api_client()
    except NoKubernetesAccess as exc:
        return [f"training jobs not read: {exc}"]
    if namespace is None:
        try:
            _, context = k8s_config.list_kube_config_contexts()
            namespace = context["context"].get("namespace", "default")
        except k8s_config.ConfigException:  # in a pod: its own namespace
            namespace = current_namespace()
    jobs = describe_run_jobs(namespace, api_client, run_id)
    return jobs or [f"no training job of this run in namespace {namespace}"]


cluster_app = typer.Typer(help="Set up a Kubernetes cluster for lingo-rl's training jobs.")
app.add_typer(cluster_app, name="cluster")


@cluster_app.command("install-runtime")
@clear_errors
def install_runtime(
    preset: Annotated[
        str, typer.Option(help="The cluster preset whose volume and runtime name to use.")
    ] = "gpt-oss-20b",
    image: Annotated[
        str | None,
        typer.Option(help="The training image [default: the GPU image, LINGO_GPU_IMAGE]."),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the YAML (for kubectl apply -f) instead.")
    ] = False,
    sets: SetOption = None,
) -> None:
    """Install (or update) the ClusterTrainingRuntime the TrainJobs reference (Kubeflow
    Trainer v2): torchrun on the training image, the shared PVC, /dev/shm. Needs rights on
    cluster-scoped clustertrainingruntimes (a cluster admin's)."""
    from components.images import GPU_IMAGE
    from pipelines.presets import training_runtime

    config = _load_preset(preset, sets)
    try:
        runtime = training_runtime(config, image or GPU_IMAGE)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--preset") from exc
    if dry_run:
        from cluster.pytorchjob import manifest_yaml

        typer.echo(RUNTIME_HEADER + manifest_yaml(runtime), nl=False)
        return
    from cluster.launcher import install_training_runtime

    done = install_training_runtime(runtime)
    echo(f"{done} ClusterTrainingRuntime {runtime['metadata']['name']}")


RUNTIME_HEADER = (
    "# The ClusterTrainingRuntime lingo-rl's TrainJobs reference (Kubeflow Trainer v2.3).\n"
    "# Install: kubectl apply -f deploy/cluster-training-runtime.yaml, or\n"
    "# lingo cluster install-runtime. Written by: lingo cluster install-runtime --dry-run\n"
)


@cluster_app.command("setup")
@clear_errors
def setup(
    namespace: Annotated[
        str | None,
        typer.Option(help="Where the pipeline runs [default: the kubeconfig context's]."),
    ] = None,
    service_account: Annotated[
        str,
        typer.Option(
            help="The pipeline's service account: Data Science Pipelines' "
            "pipeline-runner-<DSPA name>."
        ),
    ] = "pipeline-runner-dspa",
    preset: Annotated[
        str, typer.Option(help="The cluster preset whose platform (volume, Secrets) to set up.")
    ] = "gpt-oss-20b",
    image: Annotated[
        str | None,
        typer.Option(help="The runtime's training image [default: the GPU image]."),
    ] = None,
    workspace_size: Annotated[
        str, typer.Option(help="The workspace PVC's size, when it is created.")
    ] = "500Gi",
    storage_class: Annotated[
        str | None,
        typer.Option(help="The workspace PVC's storage class (ReadWriteMany) [default: none]."),
    ] = None,
    skip_runtime: Annotated[
        bool,
        typer.Option(
            "--skip-runtime",
            help="Leave the ClusterTrainingRuntime out (a cluster admin installs it).",
        ),
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print the manifests (Secrets as comments) instead."),
    ] = False,
    sets: SetOption = None,
) -> None:
    """Set a namespace up for the pipeline's training jobs, in one command: the
    ClusterTrainingRuntime, a Role and RoleBinding for the pipeline's service account
    (TrainJobs, TrainingRuntimes, PyTorchJobs; JobSets, pods, logs, events read), the
    workspace PVC if missing, and a Secret for each of the platform's Secrets whose
    variables are set here (S3, MLflow, Hugging Face: all optional)."""
    import os

    from cluster.setup import SecretSource, setup_plan
    from components.images import GPU_IMAGE
    from pipelines.platform import get_platform
    from pipelines.presets import training_runtime

    config = _load_preset(preset, sets)
    platform = get_platform(config.hardware.platform)
    try:
        runtime = None if skip_runtime else training_runtime(config, image or GPU_IMAGE)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--preset") from exc
    api_client = None
    if not dry_run:
        from cluster.launcher import default_api_client

        api_client = default_api_client()
    namespace = namespace or _context_namespace(fallback="default" if dry_run else None)
    workspace = (
        (platform.workspace_pvc, workspace_size, storage_class) if platform.workspace_pvc else None
    )
    sources = [SecretSource(s.secret_name, s.key_to_env, s.steps) for s in platform.secrets]
    plan = setup_plan(namespace, service_account, runtime, workspace, sources, os.environ)
    if dry_run:
        _print_setup(plan)
        return
    from cluster.setup import apply_plan

    done, failed = apply_plan(plan, api_client)
    for line in done + plan.skipped:
        echo(line)
    for line in failed:
        echo(f"error: {line}", err=True)
    if failed:
        raise typer.Exit(1)


def _print_setup(plan) -> None:
    """``lingo setup --dry-run``: the plan's manifests as YAML documents, its Secrets as
    comments that name their keys (never their values), and what it would skip."""
    from cluster.pytorchjob import manifest_yaml
    from cluster.setup import describe_secret

    documents = [manifest_yaml(m) for m in plan.manifests() if m["kind"] != "Secret"]
    comments = [describe_secret(m) for m in plan.namespaced if m["kind"] == "Secret"]
    comments += [f"# {line}" for line in plan.skipped]
    typer.echo(SETUP_HEADER + "---\n".join(documents), nl=False)
    for line in comments:
        echo(line)


def _context_namespace(fallback: str | None = None) -> str:
    """The kubeconfig's current context's namespace (``default`` when it names none), else
    in a pod its own, else ``fallback``.

    Raises:
        typer.BadParameter: none of them (no ``fallback``).
    """
    from kubernetes import config as k8s_config

    from cluster.step_job import SERVICE_ACCOUNT_NAMESPACE

    try:
        _, context = k8s_config.list_kube_config_contexts()
    except (k8s_config.ConfigException, OSError) as exc:
        if SERVICE_ACCOUNT_NAMESPACE.exists():
            return SERVICE_ACCOUNT_NAMESPACE.read_text().strip()
        if fallback is not None:
            return fallback
        raise typer.BadParameter(
            f"none given, and no kubeconfig context to take it from ({exc})",
            param_hint="--namespace",
        ) from exc
    return context["context"].get("namespace", "default")


SETUP_HEADER = (
    "# What `lingo cluster setup` creates (kubectl apply -f; the ClusterTrainingRuntime takes a\n"
    "# cluster admin). Written by: lingo cluster setup --dry-run\n"
)
