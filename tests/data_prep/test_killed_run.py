"""A killed data prep (issue #17): its workers die with it, and the next run into the same
directory removes what it left (work folder, temp files)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import make_rows, write_jsonl

from core.atomic import OUTPUT_RECORD
from data_prep.config import DataPrepConfig
from data_prep.prepare import prepare_dataset

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(p) for p in text.split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _start_data_prep(tmp_path: Path, out: Path, workers: int) -> subprocess.Popen:
    """A data prep of 30,000 rows (seconds) into ``out``, in a process of its own."""
    source = write_jsonl(tmp_path / "big.jsonl", make_rows(6000))
    script = textwrap.dedent(
        f"""
        from data_prep.config import DataPrepConfig
        from data_prep.prepare import prepare_dataset
        prepare_dataset(DataPrepConfig(source={str(source)!r}, workers={workers}),
                        {str(out / "train.jsonl")!r}, {str(out / "eval.jsonl")!r},
                        {str(out / "quarantine.jsonl")!r})
        """
    )
    return subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)


def test_killed_data_prep_leaves_no_workers_and_the_next_run_cleans_up(tmp_path):
    out = tmp_path / "out"
    proc = _start_data_prep(tmp_path, out, workers=2)
    deadline = time.monotonic() + 120
    workers: list[int] = []
    while time.monotonic() < deadline and proc.poll() is None:
        workers = _children(proc.pid)
        if len(workers) == 2:
            break
        time.sleep(0.05)
    assert len(workers) == 2, "the data prep never started its two workers"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.1)
    # on main both workers stayed, blocked on their pipes, for good
    assert not any(_alive(w) for w in workers), "orphaned data-prep workers"
    left = [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert any(name.startswith(".data-prep-") for name in left), left

    small = write_jsonl(tmp_path / "small.jsonl", make_rows(4))
    prepare_dataset(
        DataPrepConfig(source=str(small), workers=1),
        out / "train.jsonl",
        out / "eval.jsonl",
        out / "quarantine.jsonl",
    )
    assert sorted(p.name for p in out.iterdir() if p.name != OUTPUT_RECORD) == [
        "eval.jsonl",
        "quarantine.jsonl",
        "train.jsonl",
    ]


def test_a_second_data_prep_into_the_same_folder_is_refused_while_the_first_runs(tmp_path):
    # issue #32 item 9: on main both exited 0 and one silently replaced the other's outputs
    from data_prep.prepare import DataPrepBusyError

    out = tmp_path / "out"
    first = _start_data_prep(tmp_path, out, workers=1)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(out.glob(".data-prep-*")):
        assert first.poll() is None, "the first data prep ended before the test could overlap"
        time.sleep(0.02)
    other = write_jsonl(tmp_path / "other.jsonl", make_rows(3))
    with pytest.raises(DataPrepBusyError, match=rf"{out} is in use by another data prep \(pid"):
        prepare_dataset(
            DataPrepConfig(source=str(other), workers=1),
            out / "train.jsonl",
            out / "eval.jsonl",
            out / "quarantine.jsonl",
        )
    assert first.wait(timeout=300) == 0
    rows = sum(sum(1 for _ in (out / name).open()) for name in ("train.jsonl", "eval.jsonl"))
    assert rows == 30_000  # the first run's outputs, whole: nothing of the second's
    # once the first has ended, the folder is free again
    prepare_dataset(
        DataPrepConfig(source=str(other), workers=1),
        out / "train.jsonl",
        out / "eval.jsonl",
        out / "quarantine.jsonl",
    )
