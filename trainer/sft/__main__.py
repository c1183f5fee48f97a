"""One SFT process: ``python -m trainer.sft`` (or under torchrun).

    python -m trainer.sft --config sft.json --base-model DIR --train train.jsonl \
        --eval eval.jsonl --model-output OUT --work-dir WORK
"""

from trainer.entry import end_process, step_main
from trainer.sft.config import SFTConfig
from trainer.sft.recipe import run_sft

if __name__ == "__main__":
    step_main("python -m trainer.sft", SFTConfig, run_sft, "base-model", eval_required=False)
    end_process()  # exit 0 without finalization: every output is in place
