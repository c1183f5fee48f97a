"""``lingo serve``: a model folder behind vLLM's OpenAI-compatible server."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipelines.cli.app import app, clear_errors, echo


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
