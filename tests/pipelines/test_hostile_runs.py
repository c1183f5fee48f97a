"""A fresh hostile pass over output folders, ``--set``, compiling and files (issue #44, the
runs/CLI/signals share of "25 new attempts"). Each attempt is a row in docs/reliability.md's
"Round three" table; the ones that failed on main were fixed with the test that shows it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from core.atomic import LinkRefusedError
from pipelines import cli
from pipelines.local_run import LOCK_FILE, output_dir_lock
from pipelines.preflight import output_dir_problems

ROOT = Path(__file__).resolve().parents[2]


def _errors(args: list[str]) -> tuple[int, list[str]]:
    result = CliRunner().invoke(cli.app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    return result.exit_code, [ln for ln in result.output.splitlines() if ln.startswith("error:")]


# output folders


def test_the_file_system_root_is_not_an_output_folder():
    """On main `lingo run --local -o /` passed every check (root may write there) and would
    have put mlflow.db, logs/ and a run folder at /."""
    assert output_dir_problems(Path("/")) == [
        "--output-dir / is the file system's root; choose a folder of its own"
    ]


def test_the_source_tree_is_not_an_output_folder():
    """On main `-o .` in the checkout mixed the run's files into the source tree."""
    (problem,) = output_dir_problems(ROOT)
    assert problem == (
        f"--output-dir {ROOT} is the lingo-rl source tree; choose a folder of its own "
        "(the default: runs/local)"
    )
    assert output_dir_problems(ROOT / "runs" / "local") == []


def test_an_output_folder_with_a_newline_is_refused(tmp_path):
    """On main accepted: logs and file listings split the name."""
    (problem,) = output_dir_problems(tmp_path / "a\nb")
    assert "holds a control character" in problem and "\n" not in problem


def test_an_output_folder_with_spaces_and_unicode_is_fine(tmp_path):
    assert output_dir_problems(tmp_path / "mes runs ü ñ 日本") == []


def test_a_fifo_at_the_lock_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / LOCK_FILE)
    with pytest.raises(LinkRefusedError, match="not a regular file"), output_dir_lock(tmp_path):
        pass


# --set


def test_a_field_set_twice_with_two_values_is_refused(tmp_path):
    """On main the later value won without a word (`--set sft.max_steps=1 --set
    sft.max_steps=2` compiled with 2)."""
    code, errors = _errors(
        ["compile", "-o", str(tmp_path / "p.yaml"), "--set", "sft.max_steps=1"]
        + ["--set", "sft.max_steps=2"]
    )
    assert code == 2 and errors == [
        "error: Invalid value for --set: sft.max_steps is given twice ('1', then '2'); give it once"
    ]


def test_a_field_set_twice_with_one_value_counts_once(tmp_path):
    out = tmp_path / "p.yaml"
    code, _ = _errors(
        ["compile", "-o", str(out), "--set", "sft.max_steps=3", "--set", "sft.max_steps=3"]
    )
    assert code == 0 and out.is_file()


@pytest.mark.parametrize(
    ("item", "named"),
    [
        ("sft.nope=1", "no field 'nope'"),
        ("sft.optim.a.b.c=1", "sft.optim.a has no fields"),
        ("sft=1", "use STEP.FIELD"),
        ("=1", "is not STEP.FIELD=VALUE"),
        ("sft.max_steps=1e400", "sft.max_steps"),
    ],
)
def test_unknown_deep_and_malformed_set_items_are_one_line(item, named, tmp_path):
    code, errors = _errors(["compile", "-o", str(tmp_path / "p.yaml"), "--set", item])
    assert code == 2 and len(errors) == 1 and named in errors[0], errors
    assert not (tmp_path / "p.yaml").exists()


def test_a_5000_digit_number_is_one_line(tmp_path):
    code, errors = _errors(
        ["compile", "-o", str(tmp_path / "p.yaml"), "--set", "data_prep.seed=" + "9" * 5000]
    )
    assert code == 2 and len(errors) == 1 and len(errors[0]) < 400


# compiling


def test_compile_over_a_planted_link_replaces_the_link_not_its_target(tmp_path):
    victim = tmp_path / "important.txt"
    victim.write_text("precious\n")
    out = tmp_path / "p.yaml"
    out.symlink_to(victim)
    code, _ = _errors(["compile", "-o", str(out)])
    assert code == 0 and victim.read_text() == "precious\n"
    assert not out.is_symlink() and yaml.safe_load(out.read_text())["pipelineInfo"]


@pytest.mark.slow  # two processes importing kfp: ~60 s on a loaded 2-core machine
def test_two_compiles_racing_on_one_file_leave_one_whole_pipeline(tmp_path):
    """Two `lingo compile` processes writing one file at once (as two terminals' `lingo
    compile --all` do): each writes a temp file and renames it, so the file is one whole
    pipeline and no temp file is left."""
    import subprocess
    import sys

    out = tmp_path / "p.yaml"
    script = (
        "from pathlib import Path; from pipelines.compile import compile_pipeline; "
        "from pipelines.presets import get_preset; "
        f"[compile_pipeline(Path({str(out)!r}), get_preset('tiny-cpu')) for _ in range(3)]"
    )
    racers = [
        subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stderr=subprocess.PIPE)
        for _ in range(2)
    ]
    for racer in racers:
        assert racer.wait(timeout=600) == 0, racer.stderr.read()[-2000:]
    assert yaml.safe_load(out.read_text())["pipelineInfo"]["name"] == "lingo-rl"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.yaml"]  # no temp file left


def test_a_full_disk_while_compiling_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    from kfp import compiler

    def full(self, pipeline_func, package_path, **kwargs):
        Path(package_path).write_text("# half")
        raise OSError(errno.ENOSPC, "No space left on device", package_path)

    monkeypatch.setattr(compiler.Compiler, "compile", full)
    code, errors = _errors(["compile", "-o", str(tmp_path / "p.yaml")])
    assert code == 1 and len(errors) == 1 and "no space left" in errors[0].lower(), errors
    assert list(tmp_path.iterdir()) == []


def test_sigterm_while_compiling_leaves_no_temp_file(tmp_path, monkeypatch):
    from kfp import compiler

    from pipelines.compile import compile_pipeline
    from pipelines.presets import get_preset

    def terminated(self, pipeline_func, package_path, **kwargs):
        Path(package_path).write_text("# half")
        raise SystemExit(143)  # what lingo's SIGTERM handler raises

    monkeypatch.setattr(compiler.Compiler, "compile", terminated)
    with pytest.raises(SystemExit):
        compile_pipeline(tmp_path / "p.yaml", get_preset("tiny-cpu"))
    assert list(tmp_path.iterdir()) == []
