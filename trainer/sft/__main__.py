"""Entry point for one SFT process: ``python -m trainer.sft`` (or under torchrun).

    python -m trainer.sft --config sft.json --base-model DIR --train train.jsonl \
        --eval eval.jsonl --model-output OUT --work-dir WORK
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from trainer.sft.config import SFTConfig
from trainer.sft.recipe import run_sft


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.sft", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--config", type=Path, required=True, help="SFTConfig as JSON")
    parser.add_argument("--base-model", required=True)
    parser.add_argument("--train", required=True)
    parser.add_argument("--eval", default=None)
    parser.add_argument("--model-output", required=True)
    parser.add_argument("--work-dir", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = SFTConfig.model_validate(json.loads(args.config.read_text()))
    run_sft(cfg, args.base_model, args.train, args.eval, args.model_output, args.work_dir)


if __name__ == "__main__":
    main()
