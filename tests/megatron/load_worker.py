"""One rank of a multi-rank load of a ``torch_dist`` checkpoint, started by ``torchrun`` from
the tests: the checkpoint is loaded at the layout given here (whatever layout it was written
at), exported back to HF (each tensor gathered over its TP/EP/PP group), and, with PP 1 (and
EP 1 on a CPU), its next-token logits computed on the prompts of ``IDS_JSON``.

    torchrun --nproc_per_node 2 tests/megatron/load_worker.py MEGATRON_DIR HF_DIR OUT_DIR \\
        IDS_JSON --tp 2 --pp 1 --ep 1

Rank 0 writes ``OUT_DIR/hf`` (the export) and ``OUT_DIR/logits.pt``. Without CUDA it applies
the test-only CPU patches (``cpu_patches``), as the in-process tests do.
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
    for name in ("tp", "pp", "ep"):
        parser.add_argument(f"--{name}", type=int, default=1)
    args = parser.parse_args()
    cpu_patches.import_megatron_bridge()
    import torch
    import torch.distributed as dist

    from plan import ParallelSizes
    from trainer.megatron import bridge

    out = Path(args.out_dir)
    ids = json.loads(Path(args.ids_json).read_text())
    patches = contextlib.nullcontext() if torch.cuda.is_available() else cpu_patches.cpu_patches()
    sizes = ParallelSizes(tp=args.tp, pp=args.pp, ep=args.ep)
    with patches, bridge.megatron_parallel(sizes):
        sizes = bridge._current_sizes().sizes
        assert (sizes.tp, sizes.pp, sizes.ep) == (args.tp, args.pp, args.ep), sizes
        bridge.export_megatron_to_hf(args.megatron_dir, args.hf_dir, out / "hf")
        # a forward: pipeline stages cannot give logits here, and with EP > 1 Megatron-Core's
        # all-to-all dispatcher waits on a CUDA side stream (no CPU forward at EP 2)
        if args.pp == 1 and (args.ep == 1 or torch.cuda.is_available()):
            logits = bridge.megatron_next_token_logits(args.megatron_dir, args.hf_dir, ids)
            if dist.get_rank() == 0:
                torch.save(logits, out / "logits.pt")


if __name__ == "__main__":
    main()
