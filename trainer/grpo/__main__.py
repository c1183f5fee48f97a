"""Entry point for one GRPO process: ``python -m trainer.grpo`` (or under torchrun).

    python -m trainer.grpo --config grpo.json --sft-model DIR --train train.jsonl \
        --eval eval.jsonl --model-output OUT --work-dir WORK
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from trainer.grpo.config import GRPOConfig
from trainer.grpo.recipe import run_grpo


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.grpo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--config", type=Path, required=True, help="GRPOConfig as JSON")
    parser.add_argument("--sft-model", required=True)
    parser.add_argument("--train", required=True)
    parser.add_argument("--eval", required=True)
    parser.add_argument("--model-output", required=True)
    parser.add_argument("--work-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = GRPOConfig.model_validate(json.loads(args.config.read_text()))
    run_grpo(cfg, args.sft_model, args.train, args.eval, args.model_output, args.work_dir)


if __name__ == "__main__":
    main()
