"""Periodic training checkpoints: written atomically, last N kept, found again on resume.

A checkpoint is a directory ``step-<N>`` holding the backend's state (weights being trained,
optimizer, scheduler), ``trainer_state.json`` (step, data position, RNG states),
``config.json`` (the step's config, model and data that made it), ``divergence_guard.json``
(the divergence guard's counters, and whether the weights looked healthy) and
``manifest.json`` (the size and SHA-256 of every file). It is written as
``.partial-step-<N>`` and renamed when complete, so a kill mid-write never leaves a directory
that looks like a checkpoint.

Resume (``resume``) takes the newest checkpoint whose files match their manifest (sizes and
content hashes) and that loads; a damaged one is renamed ``.corrupt-step-<N>`` with a warning
and the previous one is used. A changed config (or train/eval file: their content hashes are
part of it) is compared with the checkpoint's: the changes in ``ALLOWED_RESUME_CHANGES`` are
applied and logged, any other refuses the resume with the list. A checkpoint saved with
unhealthy weights (``trainer.divergence``) refuses the resume, naming the last good one.

Policy snapshots (``save_policy_dir``: GRPO's best and final policies) and the step's output
copied from one (``export_policy``) are written the same way: staged, then renamed.
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

from core.atomic import discard_staging, publish_dir, staging_dir
from core.errors import names_write_failures
from trainer.backends.interface import TrainingBackend
from trainer.distributed import DistInfo, barrier, broadcast_object

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
GUARD_FILE = "divergence_guard.json"
RNG_FILE = "rng_state_rank{rank}.pt"
MANIFEST_FORMAT = 2
"""Manifest format 2: ``{"format": 2, "files": {name: {"size", "sha256"}}}``; format 1 (older
checkpoints) was ``{name: size}`` and is still read (sizes only)."""
DATA_FINGERPRINTS = ("train_data", "eval_data")
"""``config.json`` keys holding the train/eval files' content hashes (``file_fingerprint``);
a checkpoint written before they were recorded resumes with a warning."""
HASH_CHUNK = 1 << 20

ALLOWED_RESUME_CHANGES = frozenset(
    {
        "optim.learning_rate",
        "optim.max_zero_grad_steps",
        "optim.max_loss_spike",
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


class UnhealthyCheckpointError(ValueError):
    """The checkpoint to resume from was saved with weights the divergence guard distrusts."""


def model_fingerprint(model: str | Path) -> str:
    """What identifies a model across runs: its ``config.json`` (hashed), else its name."""
    config = Path(model) / "config.json"
    if config.is_file():
        return "config.json sha256 " + hashlib.sha256(config.read_bytes()).hexdigest()[:16]
    return str(model)


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's content, read in 1 MiB chunks (hashlib releases the GIL on
    them, so several files hash in parallel in threads)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while chunk := fh.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_fingerprint(path: str | Path | None) -> str | None:
    """What identifies a train or eval file across runs: its content's SHA-256 (the name and
    place do not matter; a changed row does)."""
    return None if path is None else "sha256 " + file_sha256(path)


def run_fingerprint(
    config: dict, model: str | Path, train_path: str | Path, eval_path: str | Path | None
) -> dict:
    """What a checkpoint must have been saved by to be resumed (``resume``): the step's
    config (JSON) and what identifies its model and data."""
    return {
        **config,
        "model": model_fingerprint(model),
        "train_data": file_fingerprint(train_path),
        "eval_data": file_fingerprint(eval_path),
    }


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
    guard: dict | None = None,
) -> Path:
    """Write checkpoint ``step`` (every rank takes part), then drop all but the newest ``keep``.

    ``config`` (the step's config, model and data, JSON types) is recorded for ``resume`` to
    compare with; ``guard`` (``DivergenceGuard.state_dict()``) for it to carry on counting
    and to refuse a checkpoint saved unhealthy.
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
        if guard is not None:
            (partial / GUARD_FILE).write_text(json.dumps(guard, indent=2))
        manifest = {"format": MANIFEST_FORMAT, "files": _describe_files(partial)}
        (partial / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for _, old in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint saved: %s", final)
    barrier(info)
    return final


def _describe_files(directory: Path) -> dict[str, dict]:
    """``{relative name: {"size", "sha256"}}`` of every file under ``directory``.

    The backend's files are written by torch, DeepSpeed or Megatron-Core themselves, so they
    are hashed once written, reading them back (from the page cache, mostly), one thread per
    file.
    """
    from concurrent.futures import ThreadPoolExecutor

    files = [f for f in sorted(directory.rglob("*")) if f.is_file()]
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(files)))) as pool:
        digests = list(pool.map(file_sha256, files))
    return {
        f.relative_to(directory).as_posix(): {"size": f.stat().st_size, "sha256": digest}
        for f, digest in zip(files, digests, strict=True)
    }


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
    """Why ``directory`` is not a usable checkpoint (a missing or resized file, or one whose
    content is not what was written), else None.

    Checkpoints written before manifests existed are only checked for their state file, those
    of manifest format 1 for their files' sizes.
    """
    if not (directory / STATE_FILE).is_file():
        return f"{STATE_FILE} is missing"
    manifest = directory / MANIFEST_FILE
    if not manifest.is_file():
        return None
    try:
        recorded = json.loads(manifest.read_text())
    except (OSError, ValueError) as exc:
        return f"{MANIFEST_FILE} is unreadable ({exc})"
    if recorded.get("format") == MANIFEST_FORMAT:
        files = recorded["files"]
    else:  # format 1: {name: size}
        files = {name: {"size": size} for name, size in recorded.items()}
    for name, described in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != described["size"]:
            size = described["size"]
            return f"{name} has {path.stat().st_size} bytes, {size} when written (truncated?)"
    hashed = [name for name, described in files.items() if "sha256" in described]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(8, max(1, len(hashed)))) as pool:
        digests = pool.map(file_sha256, [directory / name for name in hashed])
        for name, digest in zip(hashed, digests, strict=True):
            if digest != files[name]["sha256"]:
                return (
                    f"{name} does not hold what was written (sha256 {digest[:16]}…, "
                    f"{files[name]['sha256'][:16]}… when written): the file was changed or "
                    "damaged on disk"
                )
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
    for key in DATA_FINGERPRINTS:
        if key in changes and changes[key][0] is None:
            log.warning("%s records no %s hash (an older checkpoint); not compared", directory, key)
            del changes[key]
    refused = {k: v for k, v in changes.items() if k not in ALLOWED_RESUME_CHANGES}
    if refused:
        listed = "; ".join(f"{k}: {old!r} → {new!r}" for k, (old, new) in refused.items())
        data = [k for k in DATA_FINGERPRINTS if k in refused]
        what = "the config differs" if len(data) < len(refused) else "the data differs"
        hint = (
            f" ({' and '.join(data)}: the content of the {' and '.join(k[:-5] for k in data)} "
            "file is not the one the checkpoint trained on)"
            if data
            else ""
        )
        raise ResumeConfigError(
            f"cannot resume from {directory}: {what} in {listed}{hint}. Resume with the "
            f"checkpoint's values and files, or use a new work directory to start over (a "
            f"resume may change only {', '.join(sorted(ALLOWED_RESUME_CHANGES))})"
        )
    for key, (old, new) in changes.items():
        log.warning("RESUME WITH A CHANGED CONFIG: %s %r → %r (from %s)", key, old, new, directory)
    return changes


def _guard_state(directory: Path) -> dict | None:
    path = directory / GUARD_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _check_health(directory: Path) -> None:
    """Refuse a checkpoint saved with weights the divergence guard distrusted."""
    state = _guard_state(directory)
    if state is None or state.get("healthy", True):
        return
    bad_from = state.get("bad_from") or 0  # its weights were bad since this step's
    good = [
        d
        for number, d in list_checkpoints(directory.parent)
        if number < bad_from and (_guard_state(d) or {}).get("healthy", True)
    ]
    last = (
        f"the last good checkpoint is {good[-1]}: move the later ones out of "
        f"{directory.parent} to resume from it"
        if good
        else f"no earlier good checkpoint is in {directory.parent}"
    )
    raise UnhealthyCheckpointError(
        f"cannot resume from {directory}: {state.get('problem')}, so training on from it "
        f"would only carry the divergence on; {last}, or use a new work directory to start "
        "over (lower optim.learning_rate)"
    )


def resume(
    root: Path, backend: TrainingBackend, info: DistInfo, config: dict, guard=None
) -> dict | None:
    """Restore the newest usable checkpoint under ``root``; its trainer state, or None.

    ``config`` is the current run's (as ``save_checkpoint`` records it). A checkpoint that
    fails its manifest (or, in a one-process run, fails to load) is set aside and the previous
    one is tried; a config change outside ``ALLOWED_RESUME_CHANGES`` (a changed train or
    eval file among them) raises ``ResumeConfigError``; an allowed learning-rate change is
    applied to the restored schedule. ``guard`` (a ``trainer.divergence.DivergenceGuard``)
    gets the checkpoint's counters; a checkpoint saved unhealthy raises
    ``UnhealthyCheckpointError`` naming the last good one.
    """
    while (directory := find_resume_point(root, info)) is not None:
        changes = broadcast_object(_check_config(directory, config) if info.is_main else None, info)
        if guard is not None:
            _check_health(directory)  # every rank reads the same file: all raise, or none
        try:
            state = load_checkpoint(directory, backend, info)
        except Exception as exc:
            if info.world_size > 1:  # the ranks cannot agree to skip it safely
                raise
            _set_aside(directory, f"{type(exc).__name__}: {exc}")
            continue
        if "optim.learning_rate" in changes:
            backend.set_base_learning_rate(changes["optim.learning_rate"][1])
        if guard is not None and (saved := _guard_state(directory)) is not None:
            guard.load_state_dict(saved)
        return state
    return None


@names_write_failures("directory")
def save_policy_dir(
    backend: TrainingBackend, tokenizer, directory: Path, dtype, base_model, info: DistInfo
) -> None:
    """The current policy (``TrainingBackend.save_policy``: a HF directory, or Megatron's
    ``torch_dist`` checkpoint, which the pipeline's ``export_hf`` step turns into one), every
    rank taking part (ZeRO-3 gathers; rank 0 writes), renamed into place when complete."""
    tmp = directory.with_name(f".{directory.name}.partial")
    if info.is_main:
        tmp = staging_dir(directory)
    barrier(info)
    backend.save_policy(tmp, base_model, dtype)
    if info.is_main:
        tokenizer.save_pretrained(tmp)
        publish_dir(tmp, directory)
    barrier(info)


@names_write_failures("model_output")
def export_policy(source: Path, model_output: Path) -> None:
    """A copy of the policy directory ``source`` as the step's ``--model-output``, put in
    place when complete."""
    tmp = staging_dir(model_output)
    try:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
    except BaseException:
        discard_staging(tmp)
        raise
    publish_dir(tmp, model_output, "--model-output")
