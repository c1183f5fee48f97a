"""One GRPO process: ``python -m trainer.grpo`` (or under torchrun).

    python -m trainer.grpo --config grpo.json --sft-model DIR --train train.jsonl \
        --eval eval.jsonl --model-output OUT --work-dir WORK
"""

from trainer.entry import end_process, step_main
from trainer.grpo.config import GRPOConfig
from trainer.grpo.recipe import run_grpo

if __name__ == "__main__":
    step_main("python -m trainer.grpo", GRPOConfig, run_grpo, "sft-model", eval_required=True)
    end_process()  # exit 0 without finalization: every output is in place
