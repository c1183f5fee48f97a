"""Trainer backend, rollout engine, job API, weight format and GRPO branch are decided by the
fields of their specs (``plan.trainer_spec``, ``plan.engine_spec``, ``plan.job_spec``,
``plan.RunPlan``) or looked up in their registries, not by comparing their names. The
comparisons outside ``plan/`` are counted here under a ceiling that only goes down (issue #40's
target is 0, reached; device, dtype and execution-mode checks are not counted).

Two patterns (``NAME_COMPARISON``, ``LITERAL_COMPARISON``): a field holding such a name
compared with a string (also ``.get("backend") != "…"``), and any registered name (every
trainer backend, rollout engine, job API, GRPO branch and export format) compared or tested
for membership as a string literal (``== "megatron"``, ``"megatron" not in …``), in capacity,
trainer, components, cluster, pipelines, eval, generation and core.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the packages that read specs (plan/ holds the registries; reward and data_prep name none)
READERS = ("capacity", "trainer", "components", "cluster", "pipelines", "eval")
PACKAGES = (*READERS, "generation", "core")
NAME_COMPARISON = re.compile(
    r'(backend|engine|job_api|weight_format|source_format)["\')\]]*\s*(==|!=|in \()\s*"'
)


def _registered_names() -> set[str]:
    from cluster.jobs import JOB_KINDS
    from plan import ENGINE_SPECS, GRPO_BRANCHES, TRAINERS
    from trainer.export_hf import EXPORTERS

    return {*TRAINERS, *ENGINE_SPECS, *JOB_KINDS, *GRPO_BRANCHES, *EXPORTERS}


_NAMES = "|".join(sorted(_registered_names()))
LITERAL_COMPARISON = re.compile(rf'(==|!=)\s*"({_NAMES})"|"({_NAMES})"\s+(not\s+)?in\s')

CEILING = 0
"""None left (2026-12-07): the GRPO component reads ``optim.trainer`` (image, weight format), the
job API code ``plan.job_spec`` / ``cluster.jobs.JobKind``'s fields, the eval its
``eval.engines.DIRECTORY_ENGINES``. ``cluster.job_api``'s ``auto`` names no job API and is
compared as ``cluster.jobs.AUTO``."""


def name_comparisons() -> list[str]:
    """``path:line: text`` of every comparison the grep finds."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            lines = path.read_text(encoding="utf-8").splitlines()
            for number, line in enumerate(lines, 1):
                if NAME_COMPARISON.search(line) or LITERAL_COMPARISON.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def test_name_comparisons_stay_under_the_ceiling():
    found = name_comparisons()
    assert len(found) <= CEILING, (
        f"{len(found)} comparisons of a backend/engine/job API/weight format by name (ceiling "
        f"{CEILING}); read a field of plan.trainer_spec / engine_spec / job_spec instead:\n"
        + "\n".join(found)
    )


def test_the_pattern_finds_the_comparisons_it_counts():
    assert NAME_COMPARISON.search('if optim.backend == "megatron":')
    assert NAME_COMPARISON.search('vllm = rollout.engine != "vllm"')
    assert NAME_COMPARISON.search('if job_api in ("trainjob", "pytorchjob"):')
    assert not NAME_COMPARISON.search("if optim.trainer.model_parallel:")
    assert not NAME_COMPARISON.search('if device == "cuda":')
    assert NAME_COMPARISON.search('if config["optim"].get("backend") != "megatron":')
    assert LITERAL_COMPARISON.search('if "megatron" not in preset.grpo_branches:')
    assert LITERAL_COMPARISON.search('if trainer.image == "megatron":')
    assert LITERAL_COMPARISON.search('elif source_format == "deepspeed":')
    assert not LITERAL_COMPARISON.search('if execution.mode == "local":')
    assert not LITERAL_COMPARISON.search('name = "megatron"')
