"""One process of a whole GRPO run (``python -m trainer.grpo``) on a CPU with the test-only
Megatron patches applied, started by ``torchrun`` from the tests:

    torchrun --nproc_per_node 2 tests/megatron/grpo_run_worker.py --config grpo.json \\
        --sft-model DIR --train train.jsonl --eval eval.jsonl --model-output OUT --work-dir W

The arguments are ``trainer.grpo``'s. Without CUDA the run needs the same patches as the
in-process tests (``cpu_patches`` and ``training_cpu_patches``); the guard on ``__main__``
matters: Megatron-Core's ``torch_dist`` save starts its writer workers by spawning, which
re-imports this file.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent.parent)]  # the repository root

import cpu_patches  # noqa: E402

if __name__ == "__main__":
    cpu_patches.import_megatron_bridge()
    from test_megatron_grpo_step import training_cpu_patches

    with cpu_patches.cpu_patches(), training_cpu_patches():
        sys.argv[0] = "trainer.grpo"
        runpy.run_module("trainer.grpo", run_name="__main__")
