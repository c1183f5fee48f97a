"""A stand-in training entry point for ``tests/cluster/test_rollout_node.py``: each rank joins
the gloo group torchrun set up for it, sums the ranks over the group, and writes what it saw
to ``<out>/rank<r>.json`` (``POD``: which pod's command started it, set by the test)."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(out: str) -> None:
    """Join the group, all-reduce the ranks, record rank, world, node rank and the sum."""
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    seen = {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "node_rank": int(os.environ["GROUP_RANK"]),
        "rank_sum": int(total),
        "pod": os.environ.get("POD", ""),
    }
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
