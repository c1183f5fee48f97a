"""The quiet console of `lingo run --local` on a two-step pipeline under kfp.local."""

import io

import pytest
from kfp import dsl, local

from pipelines.local_console import LocalStepFailedError, QuietConsole


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def chatty(fail: bool):
    import sys

    print("an ordinary line of output", flush=True)
    for done in range(3):
        sys.stderr.write(f"\rsft:  {done * 50}%|##   | {done}/2 [00:01<00:01,  1.00it/s, loss=1]")
        if done == 0:  # a warning lands on the bar's line (no \r before it): log only
            sys.stderr.write("/x.py:1: FutureWarning: a warning\n")
        sys.stderr.flush()
    sys.stderr.write("\n")
    if fail:
        raise ValueError("the reason it failed")


@dsl.pipeline
def two_steps(fail: bool = False):
    first = chatty(fail=False)
    chatty(fail=fail).after(first)


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def long_failure():
    # an exception whose name does not end in Error and whose message (a table) runs longer
    # than the printed tail, like the capacity check's LayoutDoesNotFit
    raise UserWarning("does not fit:\n" + "\n".join(f"| row {i} | 1.0 GiB |" for i in range(40)))


@dsl.pipeline
def one_long_failure():
    long_failure()


def _run(tmp_path, fail: bool, console: io.StringIO) -> tuple[str, str]:
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    with QuietConsole(tmp_path / "logs" / "run.log", console):
        two_steps(fail=fail)
    return console.getvalue(), (tmp_path / "logs" / "run.log").read_text()


def test_one_line_per_step_start_and_end_and_the_bars_the_rest_in_the_log(tmp_path, capsys):
    console, log = _run(tmp_path, False, io.StringIO())
    lines = [line for line in console.split("\n") if line.strip()]
    steps = [line.split()[1:3] for line in lines if "%|" not in line]
    assert steps == [
        ["chatty", "started"],
        ["chatty", "SUCCESS"],
        ["chatty-2", "started"],
        ["chatty-2", "SUCCESS"],
    ]
    assert "\rsft:  100%|##   | 2/2" in console  # the training bar, redrawn in place
    assert "ordinary line" not in console and "executorInput" not in console
    assert "FutureWarning" not in console and "FutureWarning: a warning" in log
    assert len([line for line in lines if "%|" in line]) == 2  # one bar line per step
    assert "an ordinary line of output" in log and "Executing task 'chatty-2'" in log
    assert "executor" in log.lower()  # kfp.local's own dumps are kept in the log
    out = capsys.readouterr()
    assert "chatty" not in out.out + out.err  # nothing else reached the terminal


def test_a_failing_step_prints_its_tail_and_raises_naming_it(tmp_path):
    with pytest.raises(
        LocalStepFailedError, match="'chatty-2' failed: ValueError: the reason"
    ) as e:
        _run(tmp_path, True, console := io.StringIO())
    assert e.value.step == "chatty-2" and e.value.log_path.name == "run.log"
    assert any("Traceback" in line for line in e.value.tail)
    printed = console.getvalue()
    assert "chatty-2           FAILURE" in printed
    assert "ValueError: the reason it failed" in printed  # the tail, below the step's line


def test_a_long_exception_message_still_names_the_exception(tmp_path):
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    console = io.StringIO()
    with (
        pytest.raises(LocalStepFailedError, match="failed: UserWarning: does not fit") as e,
        QuietConsole(tmp_path / "logs" / "run.log", console),
    ):
        one_long_failure()
    assert e.value.tail[0] == "UserWarning: does not fit:" and e.value.tail[1] == "…"
    assert "  UserWarning: does not fit:" in console.getvalue()
    assert "| row 39 | 1.0 GiB |" in console.getvalue()  # and the tail after it


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def decides():
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("eval.gate").info("decision | data: unchanged data | fingerprint equal")
    print("not a decision", flush=True)


@dsl.pipeline
def one_decision():
    decides()


def test_a_steps_decision_line_is_printed_under_it(tmp_path):
    """Issue 41: the data check's and the gate's decisions are one console line each."""
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    console = io.StringIO()
    with QuietConsole(tmp_path / "logs" / "run.log", console):
        one_decision()
    lines = [line.strip() for line in console.getvalue().splitlines() if line.strip()]
    assert lines[1] == "decision | data: unchanged data | fingerprint equal"
    assert [line.split()[1:3] for line in (lines[0], lines[2])] == [
        ["decides", "started"],
        ["decides", "SUCCESS"],
    ]
    assert "not a decision" not in console.getvalue()
