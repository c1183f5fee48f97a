"""The quiet console of ``lingo run --local``: one line per step, the training bars, a log file.

``kfp.local`` prints, for every task, its executor input and outputs as JSON, the task's whole
output and banners (about 1,650 lines for the demo). While a ``QuietConsole`` is active:

- kfp.local's own messages (it logs them on the root logger) and prints go to the log file;
- each task's output (kfp.local streams the subprocess's stdout and stderr) goes to the log
  file a line (or a ``\\r``-ended bar update) at a time; the ``sft`` / ``grpo`` progress bars
  (tqdm) are also drawn on the console;
- everything written, to the log or the console, goes through ``core.redact.redact``; the
  task runs in a process group of its own, stopped when the run is interrupted
  (``pipelines.step_processes``);
- the console gets one line when a step starts and one when it ends (status, seconds); a
  failing step's last output lines are printed below its line, and ``LocalStepFailedError``
  names the step and the log;
- a step's decision (an output line holding ``decision | ``: the data check's, the gate's) is
  printed on the console too, one line each.

It hooks into kfp.local at two points (kfp 2.17): the root logger (a filter that takes its
records) and ``subprocess_task_handler.run_local_subprocess`` (the function that runs a task's
command); both are restored on exit.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

from core.atomic import open_no_follow
from core.redact import redact
from eval.gate import DECISION_PREFIX
from pipelines.step_processes import StepProcesses

TRAINING_BARS = ("sft", "grpo")
TAIL_LINES = 30
# tqdm's bar: "sft:  45%|███▌ | 135/300 [01:10<01:25,  1.93it/s, loss=3.1]" (other output
# written to the same stream may follow it on the line: it is not part of the bar)
_BAR = re.compile(rf"^(?:{'|'.join(TRAINING_BARS)}):\s+\d+%\|[^|]*\|[^\]]*\]")
_EXCEPTION = re.compile(r"^[\w.]*(Error|Exception|Exit)\b:")
_TRACEBACK = "Traceback (most recent call last):"
# the line a traceback ends with: the exception's (dotted) class name, a colon, its message
_RAISED = re.compile(r"^(?:\w+\.)*[A-Z]\w*: ")
# kfp.local colours its lines; log records reach us with ESC already written out as the text
# ``\x1b`` (core.redact.for_console escapes terminal controls when a record is made)
_ANSI = re.compile(r"(?:\x1b|\\x1b)\[[0-9;]*m")
_STARTED = re.compile(r"^Executing task '([^']+)'")
_FINISHED = re.compile(r"^Task '([^']+)' finished with status (\w+)")


class LocalStepFailedError(RuntimeError):
    """A step of a local run failed; the message names it, its last output line and the log.

    Attributes:
        step: the task name (``data-prep``, ``sft``…).
        log_path: the run's log file, which holds the step's whole output.
        tail: the step's last output lines.
        raised: the exception line of the step's traceback, when it printed one (it names the
            error even when the exception's message runs past the tail).
    """

    def __init__(
        self, step: str, log_path: Path, tail: list[str], raised: str | None = None
    ) -> None:
        self.step, self.log_path, self.tail = step, log_path, tail
        lines = [line.strip() for line in tail if line.strip()] or ["no output"]
        # a traceback's exception line (its message may run over the lines after it)
        last = raised or next(
            (line for line in reversed(lines) if _EXCEPTION.match(line)), lines[-1]
        )
        super().__init__(f"step {step!r} failed: {last} (its whole output: {log_path})")


class _Redacting:
    """A text stream that writes ``core.redact.redact`` of what it is given."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        return self.stream.write(redact(text))

    def flush(self) -> None:
        self.stream.flush()


class QuietConsole:
    """Route kfp.local's output to ``log_path`` and print step lines on ``console``.

    Args:
        log_path: the log file (created, parents included).
        console: where the step lines and the bars go (default: this process's stdout).
    """

    def __init__(
        self, log_path: Path, console: TextIO | None = None, steps: StepProcesses | None = None
    ) -> None:
        self.log_path = log_path
        self.console = console or sys.stdout
        self.steps = steps or StepProcesses()
        self.failed: tuple[str, list[str], str | None] | None = None
        self._started: dict[str, float] = {}
        self._current: str | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        # the step's exception line (``LayoutDoesNotFit: …``): kept even when the exception's
        # message (a table) runs longer than the tail
        self._raised: str | None = None
        self._in_traceback = False
        self._bar_width = 0
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> QuietConsole:
        from kfp.local import subprocess_task_handler

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # a link planted at the log's (predictable) name is refused, not written through
        self.log = self._stack.enter_context(open_no_follow(self.log_path, "w"))
        self._stack.enter_context(contextlib.redirect_stdout(_Redacting(self.log)))
        root = logging.getLogger()
        root.addFilter(self._take_record)
        self._stack.callback(root.removeFilter, self._take_record)
        original = subprocess_task_handler.run_local_subprocess
        subprocess_task_handler.run_local_subprocess = self._run_subprocess
        self._stack.callback(setattr, subprocess_task_handler, "run_local_subprocess", original)
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self._end_bar()
        self._stack.close()
        if isinstance(exc, RuntimeError) and self.failed is not None:
            step, tail, raised = self.failed
            raise LocalStepFailedError(step, self.log_path, tail, raised) from exc

    # kfp.local's messages: every root-logger record goes to the log; step starts and ends
    # also make a console line
    def _take_record(self, record: logging.LogRecord) -> bool:
        message = redact(_ANSI.sub("", record.getMessage()))
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        self.log.write(f"{stamp} {record.levelname} {message}\n")
        self.log.flush()
        if started := _STARTED.match(message):
            self._step_started(started.group(1))
        elif finished := _FINISHED.match(message):
            self._step_finished(finished.group(1), finished.group(2))
        return False  # nothing else prints it

    def _step_started(self, step: str) -> None:
        self._current = step
        self._started[step] = time.monotonic()
        self._tail.clear()
        self._raised, self._in_traceback = None, False
        self._say(f"{time.strftime('%H:%M:%S')}  {step:<18} started")

    def _step_finished(self, step: str, status: str) -> None:
        seconds = time.monotonic() - self._started.get(step, time.monotonic())
        self._say(f"{time.strftime('%H:%M:%S')}  {step:<18} {status:<8} {seconds:7.1f} s")
        if status != "SUCCESS" and self.failed is None:
            tail = list(self._tail)
            if self._raised is not None and self._raised not in tail:
                tail = [self._raised, "…"] + tail
            self.failed = (step, tail, self._raised)
            self._say(f"--- last lines of {step}'s output (all of it: {self.log_path}) ---")
            for line in tail:
                self._say(f"  {line}")
            self._say("---")
        self._current = None

    def _say(self, line: str) -> None:
        self._end_bar()
        self.console.write(line + "\n")
        self.console.flush()

    # a task's output: to the log, its last lines kept for a failure, training bars drawn
    def _run_subprocess(self, full_command: list[str], env_vars: dict | None = None) -> int:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pending = ""
        process = self.steps.start(
            full_command, env_vars, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        with self.steps.stopped_on_error(process):
            fd = process.stdout.fileno()
            while chunk := os.read(fd, 65536):
                pending += decoder.decode(chunk)
                *pieces, pending = re.split(r"(\r|\n)", pending)
                for piece, end in zip(pieces[::2], pieces[1::2], strict=True):
                    self._output_piece(redact(piece), end)
            pending += decoder.decode(b"", final=True)
            if pending:
                self._output_piece(redact(pending), "\n")
            return process.wait()

    def _output_piece(self, piece: str, end: str) -> None:
        """One ``\\r``- or ``\\n``-terminated piece of a task's output (redacted)."""
        self.log.write(piece + end)
        self.log.flush()
        if bar := _BAR.match(piece):
            self.console.write("\r" + bar.group(0).ljust(self._bar_width))
            self.console.flush()
            self._bar_width = len(bar.group(0))
            if end == "\n" and not piece[bar.end() :].strip():  # tqdm closed the bar
                self._end_bar()
        if end == "\n" and (at := piece.find(DECISION_PREFIX)) >= 0:
            self._say(f"          {piece[at:]}")  # the data check's and the gate's decision
        if piece.strip() and end == "\n":
            self._tail.append(piece)
            if piece.startswith(_TRACEBACK):
                self._in_traceback = True
            elif self._in_traceback and not piece[0].isspace():
                self._in_traceback = False
                if _RAISED.match(piece):
                    self._raised = piece

    def _end_bar(self) -> None:
        if self._bar_width:
            self.console.write("\n")
            self._bar_width = 0
