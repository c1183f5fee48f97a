"""Periodic training checkpoints: written atomically, last N kept, found again on resume.

A checkpoint is a directory ``step-<N>`` holding the backend's state (weights being trained,
optimizer, scheduler), ``trainer_state.json`` (step, data position, RNG states),
``config.json`` (the step's config and model that made it) and ``manifest.json`` (the size of
every file). It is written as ``.partial-step-<N>`` and renamed when complete, so a kill
mid-write never leaves a directory that looks like a checkpoint.

Resume (``resume``) takes the newest checkpoint whose files match their manifest and that
loads; a damaged one is renamed ``.corrupt-step-<N>`` with a warning and the previous one is
used. A changed config is compared with the checkpoint's: the changes in
``ALLOWED_RESUME_CHANGES`` are applied and logged, any other refuses the resume with the list.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from core.errors import names_write_failures
from trainer.backends.interface import TrainingBackend
from trainer.distributed import DistInfo, barrier, broadcast_object

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
RNG_FILE = "rng_state_rank{rank}.pt"

ALLOWED_RESUME_CHANGES = frozenset(
    {
        "optim.learning_rate",
        "optim.max_zero_grad_steps",
        "max_steps",
        "num_epochs",
        "eval_every",
        "eval_max_examples",
        "checkpoint_every",
        "max_ckpt_num",
        "keep_checkpoints",
        "cpu_threads",
    }
)
"""Config fields a resume may change (applied from the resumed step on); any other change
(group size, batch shapes, model, algorithm, data order) refuses the resume."""


class ResumeConfigError(ValueError):
    """The config differs from the checkpoint's in fields a resume cannot change."""


def model_fingerprint(model: str | Path) -> str:
    """What identifies a model across runs: its ``config.json`` (hashed), else its name."""
    config = Path(model) / "config.json"
    if config.is_file():
        return "config.json sha256 " + hashlib.sha256(config.read_bytes()).hexdigest()[:16]
    return str(model)


def _flatten(config: dict, prefix: str = "") -> dict[str, object]:
    flat: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def config_changes(saved: dict, current: dict) -> dict[str, tuple[object, object]]:
    """``{dotted field: (checkpoint's value, current value)}`` for every field that differs."""
    old, new = _flatten(saved), _flatten(current)
    return {
        key: (old.get(key), new.get(key))
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key)
    }


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


@names_write_failures("root")
def save_checkpoint(
    root: Path,
    step: int,
    backend: TrainingBackend,
    state: dict,
    info: DistInfo,
    keep: int,
    config: dict | None = None,
) -> Path:
    """Write checkpoint ``step`` (every rank takes part), then drop all but the newest ``keep``.

    ``config`` (the step's config and model, JSON types) is recorded for ``resume`` to
    compare with.
    """
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
        if config is not None:
            (partial / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
        sizes = {
            f.relative_to(partial).as_posix(): f.stat().st_size
            for f in sorted(partial.rglob("*"))
            if f.is_file()
        }
        (partial / MANIFEST_FILE).write_text(json.dumps(sizes, indent=2))
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


def checkpoint_problem(directory: Path) -> str | None:
    """Why ``directory`` is not a usable checkpoint (a missing or resized file), else None.

    Checkpoints written before manifests existed are only checked for their state file.
    """
    if not (directory / STATE_FILE).is_file():
        return f"{STATE_FILE} is missing"
    manifest = directory / MANIFEST_FILE
    if not manifest.is_file():
        return None
    try:
        sizes = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        return f"{MANIFEST_FILE} is unreadable ({exc})"
    for name, size in sizes.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} when written (truncated?)"
    return None


def _set_aside(directory: Path, problem: str) -> None:
    """Rename a damaged checkpoint out of the way (kept for inspection), with a warning."""
    aside = directory.with_name(f".corrupt-{directory.name}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(directory, aside)
    log.warning(
        "checkpoint %s is damaged (%s); set aside as %s (delete it when done), trying the "
        "previous one",
        directory,
        problem,
        aside,
    )


def find_resume_point(root: Path, info: DistInfo) -> Path | None:
    """The checkpoint every rank resumes from (rank 0 decides): the newest intact one."""
    chosen = None
    if info.is_main:
        for _, directory in reversed(list_checkpoints(root)):
            problem = checkpoint_problem(directory)
            if problem is None:
                chosen = directory
                break
            _set_aside(directory, problem)
    return broadcast_object(chosen, info)


def _check_config(directory: Path, config: dict) -> dict[str, tuple[object, object]]:
    """The allowed changes from the checkpoint's config; raises on any other."""
    saved_file = directory / CONFIG_FILE
    if not saved_file.is_file():
        log.warning("%s records no config (an older checkpoint); resuming unchecked", directory)
        return {}
    changes = config_changes(json.loads(saved_file.read_text()), config)
    refused = {k: v for k, v in changes.items() if k not in ALLOWED_RESUME_CHANGES}
    if refused:
        listed = "; ".join(f"{k}: {old!r} → {new!r}" for k, (old, new) in refused.items())
        raise ResumeConfigError(
            f"cannot resume from {directory}: the config differs in {listed}. Resume with the "
            f"checkpoint's values, or use a new work directory to start over (a resume may "
            f"change only {', '.join(sorted(ALLOWED_RESUME_CHANGES))})"
        )
    for key, (old, new) in changes.items():
        log.warning("RESUME WITH A CHANGED CONFIG: %s %r → %r (from %s)", key, old, new, directory)
    return changes


def resume(root: Path, backend: TrainingBackend, info: DistInfo, config: dict) -> dict | None:
    """Restore the newest usable checkpoint under ``root``; its trainer state, or None.

    ``config`` is the current run's (as ``save_checkpoint`` records it). A checkpoint that
    fails its manifest (or, in a one-process run, fails to load) is set aside and the previous
    one is tried; a config change outside ``ALLOWED_RESUME_CHANGES`` raises
    ``ResumeConfigError``; an allowed learning-rate change is applied to the restored schedule.
    """
    while (directory := find_resume_point(root, info)) is not None:
        changes = broadcast_object(_check_config(directory, config) if info.is_main else None, info)
        try:
            state = load_checkpoint(directory, backend, info)
        except Exception as exc:
            if info.world_size > 1:  # the ranks cannot agree to skip it safely
                raise
            _set_aside(directory, f"{type(exc).__name__}: {exc}")
            continue
        if "optim.learning_rate" in changes:
            backend.set_base_learning_rate(changes["optim.learning_rate"][1])
        return state
    return None
