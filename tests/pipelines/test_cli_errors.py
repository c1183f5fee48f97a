"""One-line errors everywhere (issue #32 item 12): each reproduction of the issue through the
CLI ends with its exit code, one ``error:`` line naming the cause and the path or option, and
no traceback (``--verbose`` keeps it).

A read-only or full file system is a real one: a tmpfs mounted in a mount namespace of the
test's own (``unshare -rm``, no privileges needed where unprivileged user namespaces are on);
the tests that need it are skipped where it cannot be made. A full disk inside PyTorch's
checkpoint writer is the file-size limit (``ulimit -f``; Python ignores SIGXFSZ, so the write
fails with EFBIG as it would with ENOSPC).
"""

from __future__ import annotations

import json
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests_helpers_trainer import subprocess_env
from typer.testing import CliRunner

from pipelines.cli import app

runner = CliRunner()
LINGO = str(Path(sys.executable).with_name("lingo"))


def _one_error(result, code: int = 1) -> str:
    """The one ``error:`` line of a failed command (CliRunner result or CompletedProcess)."""
    returncode = getattr(result, "exit_code", getattr(result, "returncode", None))
    stderr = result.stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert returncode == code, stderr[-3000:]
    assert len(errors) == 1, stderr[-3000:]
    assert "Traceback" not in stderr + (result.stdout or "")
    return errors[0]


def _tmpfs_works() -> bool:
    try:
        probe = "mount -t tmpfs -o size=16k tmpfs /mnt 2>/dev/null || mount -t tmpfs tmpfs /tmp"
        return subprocess.run(["unshare", "-rm", "sh", "-c", probe], timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


needs_tmpfs = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _tmpfs_works(),
    reason="needs a tmpfs in a user and mount namespace (unshare -rm)",
)


def _on_tmpfs(mount: Path, args: list[str], state: str) -> subprocess.CompletedProcess:
    """``lingo ARGS`` with a 64 KiB tmpfs at ``mount``, ``state`` ``full`` or ``read-only``."""
    mount.mkdir(exist_ok=True)
    setup = f"mount -t tmpfs -o size=64k tmpfs {mount}"
    if state == "full":
        setup += f" && (dd if=/dev/zero of={mount}/fill bs=1k count=128 2>/dev/null; true)"
    else:
        setup += f" && mount -o remount,ro {mount}"
    script = f"{setup} && exec {shlex.join([LINGO, *args])}"
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, timeout=300
    )


# --- lingo compile, eval, estimate: option values -------------------------------------------


def test_compile_into_an_existing_folder_is_one_line(tmp_path):
    # main: kfp's ValueError "should end with .yaml" and its traceback
    line = _one_error(runner.invoke(app, ["compile", "-o", str(tmp_path)]))
    assert f"--output {tmp_path} is a directory; give a file name" in line


@pytest.mark.parametrize(
    ("option", "value", "cause"),
    [
        ("--samples", "0", "--samples 0: Input should be greater than or equal to 1"),
        ("--max-tokens", "0", "--max-tokens 0: Input should be greater than or equal to 1"),
        ("--limit", "0", "--limit 0: Input should be greater than or equal to 1"),
        ("--temperature", "-1", "--temperature -1.0: Input should be greater than or equal"),
        ("--temperature", "nan", "--temperature nan: Input should be a finite number"),
        ("--engine", "bogus", "--engine 'bogus': Input should be 'hf' or 'vllm'"),
    ],
)
def test_eval_option_values_out_of_range_are_one_line(option, value, cause, tmp_path):
    # main: pydantic's 46-line ValidationError traceback
    result = runner.invoke(app, ["eval", "-m", "x=/none", option, value, "-o", str(tmp_path)])
    assert cause in _one_error(result)


def test_eval_models_whose_labels_collide_are_one_line(tmp_path):
    for name in ("A", "B"):
        (tmp_path / name / "model").mkdir(parents=True)
    models = ["-m", str(tmp_path / "A" / "model"), "-m", str(tmp_path / "B" / "model")]
    line = _one_error(runner.invoke(app, ["eval", *models, "-o", str(tmp_path / "out")]))
    assert "model labels must be unique: 'model'" in line and "-m NAME=LOCATION" in line


def test_estimate_of_a_binary_file_is_one_line(tmp_path):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    line = _one_error(runner.invoke(app, ["estimate", "--model", str(binary)]), code=2)
    assert f"{binary}: not a model's config.json (not UTF-8 JSON" in line


# --- sources ---------------------------------------------------------------------------------


def test_a_missing_relative_source_is_a_local_path_error_at_once(tmp_path, monkeypatch):
    # main: 26-37 s of hub retries, then an 84-line traceback
    monkeypatch.chdir(tmp_path)
    began = time.monotonic()
    line = _one_error(runner.invoke(app, ["data-prep", "--source", "rel/nosuch", "-o", "out"]))
    assert time.monotonic() - began < 20
    assert f"rel/nosuch: not a local file or directory (looked for {tmp_path}/rel/nosuch)" in line
    (tmp_path / "rel").mkdir()  # a local folder named like the id's first part: a path
    line = _one_error(runner.invoke(app, ["data-prep", "--source", "rel/nosuch", "-o", "out"]))
    assert f"rel/nosuch: no such file or directory (looked for {tmp_path}/rel/nosuch)" in line


def test_a_missing_model_source_path_is_named(tmp_path, monkeypatch):
    # main: huggingface_hub's HFValidationError ("Repo id must be in the form …")
    from trainer.base_model import ModelSourceError, materialize_base_model
    from trainer.tiny_model import TinyModelConfig

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelSourceError, match=rf"\./nosuch: no such model directory \(looked "
                       rf"for {tmp_path}/nosuch\)"):  # fmt: skip
        materialize_base_model("./nosuch", tmp_path / "out", TinyModelConfig())


@pytest.mark.slow  # a local run's checks before any step; the test above covers the step
def test_a_local_run_with_a_missing_model_source_ends_with_one_line(tmp_path):
    args = ["run", "--local", "-o", str(tmp_path / "runs"), "--set", "model.source=./nosuch"]
    result = subprocess.run([LINGO, *args], capture_output=True, text=True, cwd=tmp_path)
    line = _one_error(result)
    # the checks before any step find it (preflight), so no step starts
    assert "found before any step ran: model.source: ./nosuch: no such file" in line
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").glob("lingo-rl-*"))


# --- output paths ----------------------------------------------------------------------------

OUTPUT_COMMANDS = ["data-prep", "run", "eval"]


@pytest.fixture
def output_command(tiny_model_dir):
    """The command line of ``lingo data-prep | run --local | eval`` up to its ``-o``."""
    commands = {
        "data-prep": ["data-prep", "-o"],
        "run": ["run", "--local", "-o"],
        "eval": ["eval", "-m", f"tiny={tiny_model_dir}", "--limit", "1", "-o"],
    }
    return commands.__getitem__


@pytest.mark.parametrize("command", OUTPUT_COMMANDS)
def test_an_output_path_that_is_a_file_is_one_line(command, output_command, tmp_path):
    path = tmp_path / "a-file"
    path.write_text("the user's")
    line = _one_error(runner.invoke(app, [*output_command(command), str(path)]))
    assert str(path) in line and ("is a file" in line or "a file is in the way" in line)
    assert path.read_text() == "the user's"


@pytest.mark.parametrize("command", OUTPUT_COMMANDS)
def test_an_output_name_of_300_characters_is_one_line(command, output_command, tmp_path):
    result = runner.invoke(app, [*output_command(command), str(tmp_path / ("x" * 300))])
    line = _one_error(result)
    # the local run's pre-check finds it before any step; the other commands when they write
    too_long = ("file name too long: use a shorter path", "more than the file system's 255")
    assert any(cause in line for cause in too_long) and "x" * 80 in line


def test_a_data_prep_output_path_too_long_for_sqlite_is_one_line(tmp_path):
    # main: sqlite3.OperationalError "unable to open database file" and its traceback
    deep = Path(tmp_path, *["d" * 250] * 14)
    line = _one_error(runner.invoke(app, ["data-prep", "-o", str(deep)]))
    assert "SQLite opens at most 511: pass an output folder" in line


@needs_tmpfs
@pytest.mark.parametrize("state", ["read-only", "full"])
@pytest.mark.parametrize("command", OUTPUT_COMMANDS)
def test_an_output_on_a_read_only_or_full_file_system_is_one_line(
    command, state, output_command, tmp_path
):
    mount = tmp_path / "mnt"
    result = _on_tmpfs(mount, [*output_command(command), str(mount / "out")], state)
    line = _one_error(result)
    assert str(mount / "out") in line
    cause = "read-only file system" if state == "read-only" else "full"
    assert cause in line.replace("no space left on the device", "full")


def test_a_full_disk_during_an_sft_checkpoint_is_one_line(tmp_path, tiny_model_dir, prepared_data):
    # main: RuntimeError "[enforce fail at inline_container.cc] … file write failed", traceback
    config = tmp_path / "sft.json"
    config.write_text(
        json.dumps({"max_steps": 2, "micro_batch_size": 2, "checkpoint_every": 1, "lora": {"r": 0}})
    )
    work = tmp_path / "work"
    args = ["--config", str(config), "--base-model", str(tiny_model_dir), "--train",
            str(prepared_data / "train.jsonl"), "--model-output", str(tmp_path / "model"),
            "--work-dir", str(work)]  # fmt: skip
    limit = 256 << 10  # a checkpoint of the tiny model is ~3 MiB

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = subprocess.run(
        [sys.executable, "-m", "trainer.sft", *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=subprocess_env(),
        preexec_fn=small_files,
    )
    line = _one_error(result)
    assert f"cannot write {work / 'checkpoints'}: PyTorch could not write a file" in line


def test_verbose_keeps_the_traceback(tmp_path):
    result = runner.invoke(app, ["--verbose", "compile", "-o", str(tmp_path)])
    assert result.exit_code == 1 and "Traceback" in result.stderr
    assert "is a directory" in result.stderr
