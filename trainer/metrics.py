"""Training metrics: ``training_metrics.jsonl`` (read by Kubeflow for progress/ETA), MLflow, plots.

The file is an interface: the Open Data Hub Kubeflow SDK tails it for progress, ETA and the
end-of-job message (docs/platform.md, "Training metrics"). Its convention:

- one JSON object per optimizer step, appended and flushed by global rank 0 only (other
  ranks get a writer that does nothing); metrics measured after the step (held-out eval) are
  merged onto that step's line, so the last line always carries the train ``loss``;
- every line carries ``step``, ``max_steps``, ``epoch`` and ``wall_time_s`` — seconds since
  training started, cumulative across resumes, so ``ETA = wall_time_s / step × (max_steps −
  step)``;
- ``epoch`` is the fractional number of *planned* epochs completed (HF Trainer /
  training_hub style, 0-based: ``planned_epochs × step / max_steps``, 0 before the first step,
  exactly ``planned_epochs`` at the last). It never exceeds the configured number of epochs,
  so the reader's 1-based ``currentEpoch = max(1, ceil(epoch))`` never passes the total.
  Passes over the data, which can exceed it (``max_steps`` set beyond one epoch), are
  ``data_passes``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path

from core.atomic import atomic_writer, open_no_follow

log = logging.getLogger(__name__)

METRICS_FILE = "training_metrics.jsonl"


class MetricsFileError(ValueError):
    """A metrics file has a line that is not JSON before its last line."""


def read_metrics(path: str | Path) -> list[dict]:
    """All lines of a metrics file (missing file: no lines).

    A torn last line (a writer killed mid-line) is left out with a warning; ``MetricsWriter``
    rewrites the file without it on resume. A bad line before the last raises
    ``MetricsFileError`` naming the file and line.
    """
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if any(rest.strip() for rest in lines[number:]):
                raise MetricsFileError(f"{path}:{number}: not a JSON object ({exc})") from exc
            log.warning("%s:%d: torn last line (%r) left out", path, number, line[:80])
    return out


class MetricsWriter:
    """Write one metric line per optimizer step for one training run; resumable.

    Args:
        path: the ``training_metrics.jsonl`` file.
        max_steps: total optimizer steps of the run.
        planned_epochs: the configured number of epochs the ``max_steps`` steps stand for
            (``epoch`` runs from 0 to this).
        is_main: only the global rank 0 process writes; others pass False.
        resume_step: when resuming from a checkpoint at this step, lines after it (written
            before the interruption, not covered by the checkpoint) are dropped, and the wall
            clock continues from the last kept line.
        mlflow_run: log the same metrics to this active MLflow run (see ``core.tracking``).
        progress: a ``trainer.progress.ProgressServer`` that serves every line as the
            OpenShift AI progress object (rank 0, when progress tracking is on).
    """

    def __init__(
        self,
        path: str | Path,
        max_steps: int,
        planned_epochs: float = 1.0,
        is_main: bool = True,
        resume_step: int = 0,
        mlflow_run=None,
        progress=None,
    ) -> None:
        self.path = Path(path)
        self.max_steps = max_steps
        self.planned_epochs = planned_epochs
        self.is_main = is_main
        self.mlflow_run = mlflow_run
        self.progress = progress
        self._offset = 0.0
        if not is_main:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # a torn last line (killed mid-write) is dropped here: the rewrite below repairs it
        kept = (
            [m for m in read_metrics(self.path) if m["step"] <= resume_step] if resume_step else []
        )
        if kept:
            self._offset = max(m["wall_time_s"] for m in kept)
        self._written = [json.dumps(m) + "\n" for m in kept[:-1]]
        self._last: dict | None = kept[-1] if kept else None
        self._rewrite()
        for line in kept:  # a resumed run serves where it stands, its last eval included
            self._serve(line)
        self._start = time.monotonic()

    def _serve(self, line: dict) -> None:
        if self.progress is not None:
            self.progress.update(line, self.planned_epochs)

    def _rewrite(self) -> None:
        """Replace the file with the lines so far (atomic: a reader sees old or new, whole)."""
        tail = [json.dumps(self._last) + "\n"] if self._last is not None else []
        with atomic_writer(self.path) as fh:  # a new file: a link there is not written through
            fh.write("".join(self._written + tail))

    def wall_time(self) -> float:
        """Seconds of training so far, including time before a resume."""
        return self._offset + (time.monotonic() - self._start) if self.is_main else 0.0

    def epoch(self, step: int) -> float:
        """Planned epochs completed after ``step`` steps: 0 … ``planned_epochs``."""
        return round(self.planned_epochs * min(step, self.max_steps) / self.max_steps, 4)

    def log(self, step: int, **values: float | int | None) -> dict | None:
        """Write ``step``'s line (rank 0); non-finite floats are written as null.

        A second call for the same step (the held-out eval after the update) merges its values
        onto that step's line, rewritten in place, with ``wall_time_s`` moved to now.
        """
        if not self.is_main:
            return None
        clean = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in values.items()
        }
        header = {
            "step": step,
            "max_steps": self.max_steps,
            "epoch": self.epoch(step),
            "wall_time_s": round(self.wall_time(), 3),
        }
        if self._last is not None and self._last["step"] == step:
            self._last = {**self._last, **header, **clean}
            self._rewrite()
        else:
            if self._last is not None:
                self._written.append(json.dumps(self._last) + "\n")
            self._last = {**header, **clean}
            with open_no_follow(self.path, "a") as fh:  # a link planted there: refused
                fh.write(json.dumps(self._last) + "\n")
                fh.flush()
        self._serve(self._last)
        if self.mlflow_run is not None:
            from core.tracking import log_metrics

            log_metrics({k: v for k, v in {**header, **clean}.items() if k != "step"}, step)
        return self._last


def plot_metrics(
    metrics_path: str | Path, output_png: str | Path, keys: Iterable[str], title: str
) -> Path | None:
    """Plot ``keys`` against ``step`` from a metrics file into a PNG (one panel per key)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines = read_metrics(metrics_path)
    keys = [k for k in keys if any(line.get(k) is not None for line in lines)]
    if not keys:
        return None
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.6 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys, strict=True):
        points = [(line["step"], line[key]) for line in lines if line.get(key) is not None]
        ax.plot(
            [p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 50 else None
        )
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("step")
    axes[0, 0].set_title(title)
    fig.tight_layout()
    output_png = Path(output_png)
    output_png.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_png.with_name(f".{output_png.name}.partial.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, output_png)
    return output_png
