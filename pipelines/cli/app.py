"""The ``lingo`` app: its global options, how every command prints and fails, and the preset a
command's ``--preset``/``--set`` name."""

from __future__ import annotations

import functools
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

import typer

from core.errors import describe_error
from core.redact import configure_logging, for_console
from pipelines.overrides import AssignmentError, apply_overrides, parse_assignments
from pipelines.presets import PRESETS, get_preset

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
    global_options.verbose = verbose
    configure_logging(
        logging.DEBUG if verbose else logging.INFO,
        "%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@dataclass
class GlobalOptions:
    """The options given before the command (``lingo --verbose data-prep …``)."""

    verbose: bool = False


global_options = GlobalOptions()


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
            if global_options.verbose:
                echo(traceback.format_exc(), err=True)
            echo(f"error: {line}", err=True)
            raise typer.Exit(1) from exc

    return run_command


def parse_sets(sets: list[str] | None) -> dict[str, str]:
    try:
        return parse_assignments(sets or [])
    except AssignmentError as exc:
        raise typer.BadParameter(str(exc).removeprefix("--set: "), param_hint="--set") from None


def load_preset(name: str, sets: list[str] | None):
    overrides = parse_sets(sets)
    try:
        return apply_overrides(get_preset(name), overrides)
    except (KeyError, ValueError) as exc:
        raise typer.BadParameter(str(exc).strip("'\"")) from exc
