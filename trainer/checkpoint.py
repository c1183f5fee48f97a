"""Periodic training checkpoints: written atomically, last N kept, found again on resume.

A checkpoint is a directory ``step-<N>`` holding the backend's state (weights being trained,
optimizer, scheduler) and ``trainer_state.json`` (step, data position, RNG states). It is
written as ``.partial-step-<N>`` and renamed when complete, so a kill mid-write never leaves a
directory that looks like a checkpoint.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from trainer.backends import TrainingBackend
from trainer.distributed import DistInfo, barrier, broadcast_object

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"
RNG_FILE = "rng_state_rank{rank}.pt"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root``, oldest first."""
    if not root.exists():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint, if any."""
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def save_checkpoint(
    root: Path,
    step: int,
    backend: TrainingBackend,
    state: dict,
    info: DistInfo,
    keep: int,
) -> Path:
    """Write checkpoint ``step`` (every rank takes part), then drop all but the newest ``keep``."""
    final = root / f"step-{step}"
    partial = root / f".partial-step-{step}"
    if info.is_main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    barrier(info)
    backend.save_checkpoint(partial)
    torch.save(
        {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        },
        partial / RNG_FILE.format(rank=info.rank),
    )
    barrier(info)
    if info.is_main:
        (partial / STATE_FILE).write_text(json.dumps({**state, "step": step}, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for _, old in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint saved: %s", final)
    barrier(info)
    return final


def load_checkpoint(directory: Path, backend: TrainingBackend, info: DistInfo) -> dict:
    """Restore the backend and this rank's RNG from ``directory``; returns the trainer state."""
    backend.load_checkpoint(directory)
    rng_file = directory / RNG_FILE.format(rank=info.rank)
    if rng_file.exists():
        rng = torch.load(rng_file, map_location="cpu", weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    state = json.loads((directory / STATE_FILE).read_text())
    log.info("resumed from %s (step %d)", directory, state["step"])
    return state


def find_resume_point(root: Path, info: DistInfo) -> Path | None:
    """The checkpoint every rank resumes from (rank 0 decides)."""
    return broadcast_object(latest_checkpoint(root) if info.is_main else None, info)
