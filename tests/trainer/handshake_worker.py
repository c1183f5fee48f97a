"""One member of a two-process rollout channel, for tests/trainer/test_torch_handshake.py.

    python handshake_worker.py RANK PORT [TORCH_VERSION]

Rank 0 hosts the job's TCPStore on 127.0.0.1:PORT (as torchrun's agent does); both open the
channel with ``trainer.grpo.channels.open_channels`` (whose handshake logs to stderr) and pass
one object over it. ``TORCH_VERSION`` fakes this process's torch version string, as a process
of the other image would report it.
"""

from __future__ import annotations

import logging
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.grpo.channels import open_channels


def main(rank: int, port: int, torch_version: str | None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if torch_version:
        torch.__version__ = torch_version
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timeout)
    channel, _ = open_channels(store, [1], [1], rank, timeout)
    got = channel.broadcast_object({"from": "coordinator"} if rank == 0 else None)
    assert got == {"from": "coordinator"}, got
    channel.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
