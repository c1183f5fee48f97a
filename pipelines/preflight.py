"""Check a run's inputs and output paths before any step starts.

A bad row in ``eval.questions`` used to surface at the evaluate step, after SFT and GRPO
(hours of GPU time on a cluster); a question set naming a column that does not exist, at data
prep; a base model without its tokenizer, at SFT. ``check_run_inputs`` checks what can be
checked on this machine when ``lingo run --local`` starts and when the pipeline is compiled
(``lingo compile``, ``submit``, ``schedule``):

- ``eval.questions``: every row parses as an eval question, and the language filter and
  limit leave some;
- ``data_prep.source``: a local path exists; ``data_prep.question_sets`` with a local source:
  read as data prep reads them (the columns exist, some question is usable, the quarantined
  share is within ``max_bad_fraction``);
- ``model.source`` when it is a directory: config, tokenizer files and readable weights
  (``core.model_files``);
- config values a step would otherwise refuse only when it starts (``config_value_problems``):
  ``grpo.reward_weights``, each training step's processes and backend, the GRPO placement
  plan, the capacity check's layouts with ``layout_overrides``, the Megatron branch's layout;
- the local run's output directory and the compiled file: not a file where a directory goes
  (or the reverse), writable, not too long.

A local run needs every path here. A compiled pipeline runs elsewhere: a path that does not
exist on this machine may exist where the steps run (a volume, the image), so it is logged
and left to the step; one that exists here is checked. Hub ids and ``s3://`` URIs are not
fetched. Every problem is reported at once, in one ``RunInputError``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from pydantic import ValidationError

from core.model_files import model_dir_problems
from data_prep.config import BUNDLED_SOURCE, DataPrepConfig
from data_prep.sources import SourceError, describe_source, looks_like_path
from pipelines.presets import Preset

log = logging.getLogger(__name__)

SQLITE_MAX_PATH = 512
"""SQLite's longest file path (``MAX_PATHNAME`` of its unix VFS): data prep's row index lives
under the output directory, and past this SQLite says only "unable to open database file"."""
LOCAL_RUN_DEPTH = len(
    "/lingo-rl-2026-12-05-02-27-25-275123/data-prep/.data-prep-4194304-a1b2c3d4/rows.sqlite"
)
"""What a local run adds to its output directory on the way to the file SQLite opens."""


class RunInputError(ValueError):
    """A run's inputs or output paths would fail a step; the message lists every problem."""


def check_run_inputs(preset: Preset, output_dir: Path | None = None, local: bool = True) -> None:
    """Check ``preset``'s inputs (and the local run's ``output_dir``) before any step runs.

    ``local``: the steps run on this machine, so every path must be here; otherwise (a
    compiled pipeline) paths missing here are logged and left to the steps.

    Raises:
        RunInputError: every problem found, each naming the field, file and fix.
    """
    problems = []
    problems += _eval_questions(preset, local)
    problems += _data_sources(preset.data_prep, local)
    problems += _model_source(preset.model.source, local)
    problems += config_value_problems(preset)
    if not local:
        _warn_local_paths_compiled_in(preset)
    if output_dir is not None:
        problems += output_dir_problems(output_dir)
    if problems:
        raise RunInputError(
            f"{len(problems)} problem(s) with the run's inputs, found before any step ran: "
            + "; ".join(problems)
        )


def config_value_problems(preset: Preset) -> list[str]:
    """The config values a step would refuse when it starts, checked from the configs alone:
    ``grpo.reward_weights`` (GRPO builds its reward from them), each training step's processes
    and backend (its launch), the Megatron layout and GRPO config of every model-parallel
    branch the pipeline compiles (its conversion, its GRPO step), and the GRPO placement plan
    and the capacity check's layouts with ``layout_overrides`` (the capacity-check step), on
    the branch the run starts (``Preset.backend``, as ``plan.RunPlan`` shapes it)."""
    from capacity.layouts import LayoutError
    from cluster.torchrun import processes_problem
    from pipelines.preset_capacity import capacity_layout
    from pipelines.presets import run_plan
    from reward.scoring import RewardWeights
    from trainer.capacity_check import grpo_layout, sft_layout
    from trainer.grpo.config import GRPOConfig
    from trainer.megatron.layout import resolve_megatron_layout
    from trainer.placement import PlacementError, step_placement

    problems = []
    try:
        RewardWeights(**preset.grpo.reward_weights)
    except (TypeError, ValueError) as exc:
        problems.append(f"grpo.reward_weights: {exc}")
    for step, config in (("sft", preset.sft), ("grpo", preset.grpo)):
        if (problem := processes_problem(config)) is not None:
            problems.append(f"{step}: {problem}")
    plans, configs = {}, {}  # each branch's plan, and its GRPO config where it validates
    for branch in dict.fromkeys((*preset.grpo_branches, preset.backend)):
        try:
            plans[branch] = run_plan(preset, backend=branch)
            if plans[branch].trainer.model_parallel:  # what its convert step resolves
                resolve_megatron_layout(plans[branch].grpo_config["optim"]["megatron"]["layout"])
        except ValueError as exc:  # the layout's own sizes or fields (LayoutError), its preset
            problems.append(f"megatron_layout: {_one_line(exc)}")
            continue
        try:  # what the branch's GRPO step will validate at run time
            configs[branch] = GRPOConfig.model_validate(plans[branch].grpo_config)
        except ValidationError as exc:
            problems.append(f"the {branch} branch's grpo config: {_one_line(exc)}")
    if preset.backend not in configs:
        return problems
    plan = plans[preset.backend]  # the branch the run starts
    try:
        placement = step_placement(plan.grpo)
    except PlacementError as exc:
        return [*problems, f"grpo: the placement plan: {exc}"]
    machines = capacity_layout(preset)
    try:
        sft_layout(
            machines, preset.sft, plan.sft.nodes, plan.sft.gpus_per_node, plan.layout_overrides
        )
        grpo_layout(machines, configs[preset.backend], placement, plan.layout_overrides)
    except LayoutError as exc:
        problems.append(f"the capacity check's layout (layout_overrides): {_one_line(exc)}")
    return problems


def local_paths(preset: Preset) -> dict[str, str]:
    """Field → value of the preset's inputs given as a path on a file system (not a hub id,
    an ``s3://`` URI, ``tiny`` or ``bundled``)."""
    fields = {
        "eval.questions": preset.eval.questions or "",
        "data_prep.source": preset.data_prep.source,
        "model.source": preset.model.source,
    }
    fields |= {
        f"data_prep.question_sets[{n}].source": s.source
        for n, s in enumerate(preset.data_prep.question_sets)
    }
    return {
        field: value
        for field, value in fields.items()
        if value
        and value not in ("tiny", BUNDLED_SOURCE)
        and "://" not in value
        and (looks_like_path(value) or Path(value).exists())
    }


def _warn_local_paths_compiled_in(preset: Preset) -> None:
    """One warning line per input that a compiled pipeline carries as a path of this machine:
    its step reads that path where it runs (a pod), where it exists only in the image or on a
    mounted volume."""
    for field, value in local_paths(preset).items():
        log.warning(
            "%s=%s is a file path, compiled into the pipeline as it is: the step reads it "
            "inside its pod, where only the image's files and mounted volumes are",
            field,
            value,
        )


def _one_line(error: Exception) -> str:
    """``error``'s message on one line (pydantic's span several)."""
    return " ".join(str(error).split())


def _missing(field: str, path: str, local: bool) -> list[str]:
    """A path that is not on this machine: a problem for a local run, else a log line."""
    if local:
        return [f"{field}: {path}: no such file or directory (looked for {Path(path).absolute()})"]
    log.warning(
        "%s: %s is not on this machine; not checked here (it must exist where the steps run)",
        field,
        path,
    )
    return []


def _eval_questions(preset: Preset, local: bool) -> list[str]:
    from eval.runner import load_questions

    questions = preset.eval.questions
    if questions is not None and not Path(questions).exists():
        return _missing("eval.questions", questions, local)
    try:
        load_questions(questions, preset.eval.languages, preset.eval.limit)
    except (OSError, ValueError) as exc:
        return [f"eval.questions: {exc}"]
    return []


def _data_sources(config: DataPrepConfig, local: bool) -> list[str]:
    problems = []
    try:
        describe_source(config.source)
    except SourceError as exc:
        if looks_like_path(config.source):
            problems += _missing("data_prep.source", config.source, local)
        else:
            problems.append(f"data_prep.source: {exc}")
    readable = []
    for number, question_set in enumerate(config.question_sets):
        field = f"data_prep.question_sets[{number}].source"
        source = question_set.source
        if source == BUNDLED_SOURCE or Path(source).exists():
            readable.append(question_set)
        elif looks_like_path(source):
            problems += _missing(field, source, local)
    if readable:
        problems += _question_set_problems(config, readable)
    return problems


def _question_set_problems(config: DataPrepConfig, sets) -> list[str]:
    """The local question sets read as data prep reads them, into nothing."""
    from data_prep.question_sets import QuestionSetError, append_question_prompts

    class _Discard:
        def write(self, data: bytes) -> int:
            return len(data)

    try:
        append_question_prompts(
            sets, _Discard(), _Discard(), config.reasoning_effort, config.max_field_chars
        )
    except (QuestionSetError, SourceError, OSError) as exc:
        return [str(exc)]
    return []


def _model_source(source: str, local: bool) -> list[str]:
    if source == "tiny":
        return []
    if not Path(source).exists():
        return _missing("model.source", source, local) if looks_like_path(source) else []
    return [f"model.source: {problem}" for problem in model_dir_problems(source)]


def _name_max(directory: Path) -> int:
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except OSError:
        return 255


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # ENAMETOOLONG: reported by _path_problems
        return False


def _existing_ancestor(path: Path) -> Path:
    while not _exists(path) and path != path.parent:
        path = path.parent
    return path


def _path_problems(path: Path, what: str) -> list[str]:
    """A path too long for the file system, or under a directory that cannot be written."""
    path = Path(os.path.abspath(path))
    ancestor = _existing_ancestor(path)
    limit = _name_max(ancestor if ancestor.is_dir() else ancestor.parent)
    long_names = [part for part in path.parts if len(os.fsencode(part)) > limit]
    if long_names:
        return [
            f"{what} {path}: the name {long_names[0][:40]}… is {len(os.fsencode(long_names[0]))} "
            f"bytes, more than the file system's {limit}; choose a shorter one"
        ]
    if ancestor.is_dir() and not os.access(ancestor, os.W_OK | os.X_OK):
        return [
            f"{what} {path}: {ancestor} cannot be written (read-only file system or no "
            "permission); choose another place"
        ]
    return []


def output_dir_problems(output_dir: Path) -> list[str]:
    """Why the local run cannot write under ``output_dir``: a file there, a read-only or
    unwritable place, a name or path too long (SQLite, under data prep, opens paths of at most
    ``SQLITE_MAX_PATH`` bytes)."""
    what = "--output-dir"
    path = Path(os.path.abspath(output_dir))
    if any(ord(c) < 32 or ord(c) == 127 for c in str(path)):
        return [
            f"--output-dir {str(path)!r} holds a control character (a newline, a tab): the run's "
            "logs, commands and file listings would split or garble it; choose a plain name"
        ]
    if path == Path(path.anchor):
        return [f"{what} {path} is the file system's root; choose a folder of its own"]
    if _exists(path / "pyproject.toml") and _exists(path / "pipelines" / "pipeline.py"):
        return [
            f"{what} {path} is the lingo-rl source tree; choose a folder of its own "
            "(the default: runs/local)"
        ]
    if _exists(path) and not path.is_dir():
        return [f"{what} {path} is a file, not a directory; choose a directory"]
    problems = _path_problems(path, what)
    longest = len(os.fsencode(str(path))) + LOCAL_RUN_DEPTH
    if not problems and longest >= SQLITE_MAX_PATH:
        problems.append(
            f"{what} {path} is {len(os.fsencode(str(path)))} bytes long: the run's files under "
            f"it would reach {longest} bytes, and SQLite (data prep's row index) opens paths "
            f"shorter than {SQLITE_MAX_PATH}; choose a shorter directory"
        )
    return problems


def output_file_problems(output: Path) -> list[str]:
    """Why the compiled pipeline cannot be written to ``output``."""
    what = "--output"
    path = Path(os.path.abspath(output))
    if _exists(path) and path.is_dir():
        return [f"{what} {path} is a directory; give a file name (e.g. {path / 'pipeline.yaml'})"]
    return _path_problems(path, what)
