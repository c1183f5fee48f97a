"""One rank of a multi-rank ``convert_hf_to_megatron``, started by ``torchrun`` from the tests.

    torchrun --nproc_per_node 2 tests/megatron/convert_worker.py HF_DIR OUT_DIR \\
        --tp 2 --pp 1 --ep 1 --dtype fp32

Without CUDA it applies the test-only CPU patches (``cpu_patches``), as the in-process tests
do; with CUDA it runs unpatched.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent.parent)]  # cpu_patches; the repository root

import cpu_patches  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("hf_dir")
    parser.add_argument("out_dir")
    for name in ("tp", "pp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--dtype", default="fp32")
    args = parser.parse_args()
    cpu_patches.import_megatron_bridge()
    import torch

    from trainer.megatron.bridge import convert_hf_to_megatron
    from trainer.megatron.layout import MegatronLayout

    layout = MegatronLayout(
        tp=args.tp,
        pp=args.pp,
        ep=args.ep,
        sequence_parallel=args.tp > 1 and args.ep > 1,
        params_dtype=args.dtype,
    )

    if torch.cuda.is_available():
        convert_hf_to_megatron(args.hf_dir, args.out_dir, layout)
    else:
        with cpu_patches.cpu_patches():
            convert_hf_to_megatron(args.hf_dir, args.out_dir, layout)


if __name__ == "__main__":
    main()
