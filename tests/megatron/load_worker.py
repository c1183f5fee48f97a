"""One rank of multi-rank loads of a ``torch_dist`` checkpoint, started by ``torchrun`` from
the tests: the checkpoint is loaded at each layout given here (whatever layout it was written
at), exported back to HF (each tensor gathered over its TP/EP/PP group), and, with PP 1 (and
EP 1 on a CPU), its next-token logits computed on the prompts of ``IDS_JSON``. The layouts
run one after the other in one job (one process group; Megatron-Core's parallel state set up
and torn down per layout), so the tests pay torchrun's and Megatron's start-up once.

    torchrun --nproc_per_node 2 tests/megatron/load_worker.py MEGATRON_DIR HF_DIR OUT_DIR \\
        IDS_JSON --layout 2,1,1 --layout 1,1,2

Rank 0 writes ``OUT_DIR/tpTP-ppPP-epEP/hf`` (the export) and ``…/logits.pt``. Without CUDA it
applies the test-only CPU patches (``cpu_patches``), as the in-process tests do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent.parent)]  # cpu_patches; the repository root

import cpu_patches  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for name in ("megatron_dir", "hf_dir", "out_dir", "ids_json"):
        parser.add_argument(name)
    parser.add_argument("--layout", action="append", required=True, help="TP,PP,EP")
    args = parser.parse_args()
    cpu_patches.import_megatron_bridge()
    import torch
    import torch.distributed as dist
    from convert_worker import layout_dir

    from plan import ParallelSizes
    from trainer.megatron import bridge

    ids = json.loads(Path(args.ids_json).read_text())
    patches = contextlib.nullcontext() if torch.cuda.is_available() else cpu_patches.cpu_patches()
    with patches, bridge.process_group():
        for tp, pp, ep in (map(int, layout.split(",")) for layout in args.layout):
            out = Path(args.out_dir) / layout_dir(tp, pp, ep)
            with bridge.megatron_parallel(ParallelSizes(tp=tp, pp=pp, ep=ep)):
                sizes = bridge._current_sizes().sizes
                assert (sizes.tp, sizes.pp, sizes.ep) == (tp, pp, ep), sizes
                bridge.export_megatron_to_hf(args.megatron_dir, args.hf_dir, out / "hf")
                # a forward: pipeline stages cannot give logits here, and with EP > 1
                # Megatron-Core's all-to-all dispatcher waits on a CUDA side stream (no CPU
                # forward at EP 2)
                if pp == 1 and (ep == 1 or torch.cuda.is_available()):
                    logits = bridge.megatron_next_token_logits(args.megatron_dir, args.hf_dir, ids)
                    if dist.get_rank() == 0:
                        torch.save(logits, out / "logits.pt")


if __name__ == "__main__":
    main()
