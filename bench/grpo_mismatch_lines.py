"""The engine/trainer mismatch fields of the demo's GRPO lines, without the demo's SFT.

Runs the ``tiny-cpu`` preset's GRPO step (``pipelines.presets.TINY_CPU.grpo``: HF engine,
the torch backend, one update a step) for ``--steps`` steps from the preset's tiny model as
built (untrained: ``make demo`` trains it by SFT first, which takes minutes on a free CPU and
far longer on a shared one) on the bundled data, and prints each step's ``rollout_kl``,
``|d|`` percentiles, ``router_mismatch_rate`` and the correction's statistics.

Usage::

    python bench/grpo_mismatch_lines.py [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FIELDS = (
    "rollout_kl",
    "rollout_logprob_diff_p50",
    "rollout_logprob_diff_p99",
    "rollout_logprob_diff_max",
    "rollout_seq_beyond_mask_fraction",
    "router_mismatch_rate",
    "importance_ratio_mean",
    "importance_ratio_max",
    "tis_clipped_fraction",
    "seq_masked_fraction",
)


def main(argv: list[str] | None = None) -> None:
    from data_prep.config import DataPrepConfig
    from data_prep.prepare import prepare_dataset
    from pipelines.presets import TINY_CPU
    from trainer.grpo.recipe import run_grpo
    from trainer.metrics import read_metrics
    from trainer.tiny_model import build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp())
    prepare_dataset(
        DataPrepConfig(workers=1), work / "train.jsonl", work / "eval.jsonl", work / "q.jsonl"
    )
    model = build_tiny_model(work / "model", TINY_CPU.model.tiny)
    cfg = TINY_CPU.grpo.model_copy(
        update={"max_steps": args.steps, "eval_every": 0, "checkpoint_every": 0}
    )
    run_grpo(cfg, model, work / "train.jsonl", work / "eval.jsonl", work / "out", work / "grpo")
    for line in read_metrics(work / "grpo" / "training_metrics.jsonl"):
        if "loss" in line:
            print(json.dumps({"step": line["step"], **{k: line.get(k) for k in FIELDS}}))


if __name__ == "__main__":
    main()
