"""Files the project creates in a folder never write through a symbolic link planted there
(issue #44, item 4): ``ln -s ~/important.txt OUT/.lingo-run.lock`` used to have the next
``lingo run --local -o OUT`` replace the file's content with its PID."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.atomic import LinkRefusedError, atomic_write_text, open_no_follow
from pipelines.local_run import LOCK_FILE, output_dir_lock

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "important.txt"
    path.write_text("precious\n")
    return path


def test_the_run_lock_refuses_a_planted_link_and_leaves_its_target(tmp_path, victim):
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).symlink_to(victim)
    refused = rf"{LOCK_FILE} is a symbolic link \(to {victim}"
    with pytest.raises(LinkRefusedError, match=refused), output_dir_lock(out):
        pass
    assert victim.read_text() == "precious\n"


@pytest.mark.slow  # 40 s here: the CLI's imports on a loaded machine
def test_lingo_run_with_a_planted_lock_link_says_one_line_and_writes_nothing(tmp_path, victim):
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).symlink_to(victim)
    done = subprocess.run(
        [sys.executable, "-m", "pipelines", "run", "--local", "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: {out / LOCK_FILE} is a symbolic link"), lines
    assert "Traceback" not in done.stderr
    assert victim.read_text() == "precious\n"
    assert not list(out.glob("lingo-rl-*"))  # nothing ran


def test_open_no_follow_refuses_links_fifos_and_folders(tmp_path, victim):
    link = tmp_path / "link"
    link.symlink_to(victim)
    for mode in ("w", "a", "ab", "r+", "a+"):
        with pytest.raises(LinkRefusedError, match="is a symbolic link"):
            open_no_follow(link, mode)
    assert victim.read_text() == "precious\n"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(LinkRefusedError, match="not a regular file"):
        open_no_follow(fifo, "w")  # did not block on a FIFO without a reader
    with open_no_follow(tmp_path / "new.log", "a") as handle:
        handle.write("one\n")
    with open_no_follow(tmp_path / "new.log", "a") as handle:
        handle.write("two\n")
    assert (tmp_path / "new.log").read_text() == "one\ntwo\n"


def test_the_quiet_console_log_refuses_a_planted_link(tmp_path, victim):
    from pipelines.local_console import QuietConsole

    log = tmp_path / "logs" / "run-20261206-170000.log"
    log.parent.mkdir()
    log.symlink_to(victim)
    with pytest.raises(LinkRefusedError), QuietConsole(log):
        pass
    assert victim.read_text() == "precious\n"


def test_training_metrics_never_write_through_a_link(tmp_path, victim):
    from trainer.metrics import MetricsWriter

    work = tmp_path / "work"
    work.mkdir()
    (work / ".training_metrics.jsonl.partial").symlink_to(victim)  # the old temp name
    (work / "training_metrics.jsonl").symlink_to(victim)
    writer = MetricsWriter(work / "training_metrics.jsonl", max_steps=2)
    writer.log(1, loss=1.0)
    writer.log(2, loss=0.5)
    assert victim.read_text() == "precious\n"
    assert not (work / "training_metrics.jsonl").is_symlink()
    assert len((work / "training_metrics.jsonl").read_text().splitlines()) == 2


def test_a_whole_file_write_replaces_a_planted_link_instead_of_its_target(tmp_path, victim):
    path = tmp_path / "report.md"
    path.symlink_to(victim)
    atomic_write_text(path, "ours\n")
    assert victim.read_text() == "precious\n"
    assert not path.is_symlink() and path.read_text() == "ours\n"
