"""One rank of multi-rank ``convert_hf_to_megatron`` runs, started by ``torchrun`` from the
tests: one conversion per ``--layout TP,PP,EP``, each into ``OUT_DIR/tpTP-ppPP-epEP``, in one
job (one process group; Megatron-Core's parallel state set up and torn down per layout), so
the tests pay torchrun's and Megatron's start-up once.

    torchrun --nproc_per_node 2 tests/megatron/convert_worker.py HF_DIR OUT_DIR \\
        --layout 2,1,1 --layout 1,2,1 --dtype fp32

Without CUDA it applies the test-only CPU patches (``cpu_patches``), as the in-process tests
do; with CUDA it runs unpatched.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if __name__ == "__main__":  # torchrun's script: cpu_patches, and the repository root
    # (not when a test imports layout_dir: tests/megatron first on the tests' path would give
    # their `from conftest import …` this folder's conftest)
    sys.path[:0] = [str(HERE), str(HERE.parent.parent)]

import cpu_patches  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("hf_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--layout", action="append", required=True, help="TP,PP,EP")
    parser.add_argument("--dtype", default="fp32")
    args = parser.parse_args()
    cpu_patches.import_megatron_bridge()
    import torch

    from trainer.megatron.bridge import convert_hf_to_megatron, process_group
    from trainer.megatron.layout import MegatronLayout

    patches = contextlib.nullcontext() if torch.cuda.is_available() else cpu_patches.cpu_patches()
    with patches, process_group():
        for tp, pp, ep in (map(int, layout.split(",")) for layout in args.layout):
            layout = MegatronLayout(
                tp=tp, pp=pp, ep=ep, sequence_parallel=tp > 1 and ep > 1, params_dtype=args.dtype
            )
            convert_hf_to_megatron(
                args.hf_dir, str(Path(args.out_dir) / layout_dir(tp, pp, ep)), layout
            )


def layout_dir(tp: int, pp: int, ep: int) -> str:
    """The folder of one layout's output under the job's output folder."""
    return f"tp{tp}-pp{pp}-ep{ep}"


if __name__ == "__main__":
    main()
