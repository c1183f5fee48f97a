"""Every process group a step creates gets the timeout its config sizes
(``collective_timeout_s``), not torch's default (10 minutes for NCCL): the torchrun world,
and the training processes' own group of a GRPO job with dedicated engines. Each case runs
in a process of its own, as torchrun's rank 0 of a one-process job."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch
from tests_helpers_trainer import subprocess_env

from trainer.backends.config import ProcessSettings

GROUP_TIMEOUT = """
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from trainer.distributed import init_distributed

device, split = sys.argv[1], sys.argv[2] == "split"
timeout = timedelta(seconds=77)
if split:  # GRPO with dedicated engines: the training processes' group, on the job's store
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    info = init_distributed(device, members=[0], store=store, timeout=timeout)
else:
    info = init_distributed(device, timeout=timeout)
backend = dist.group.WORLD._get_backend(torch.device(device))
print(info.timeout.total_seconds(), backend.options._timeout.total_seconds())
dist.barrier()
dist.destroy_process_group()
"""


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _group_timeouts(device: str, split: bool) -> list[float]:
    env = {
        **subprocess_env(),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_port()),
    }
    command = [sys.executable, "-c", GROUP_TIMEOUT, device, "split" if split else "world"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return [float(x) for x in done.stdout.split()]


@pytest.mark.parametrize("split", [False, True], ids=["torchrun-world", "training-group"])
def test_groups_get_the_configured_timeout(split):
    assert _group_timeouts("cpu", split) == [77.0, 77.0]  # gloo's default: 1800


def test_the_timeout_is_a_setting_of_every_step():
    assert ProcessSettings().collective_timeout.total_seconds() == 3600
    assert ProcessSettings(collective_timeout_s=90).collective_timeout.total_seconds() == 90


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("split", [False, True], ids=["torchrun-world", "training-group"])
def test_nccl_groups_get_the_configured_timeout(split):
    """NCCL's default is 10 minutes (torch ``default_pg_nccl_timeout``): shorter than a 20B
    engine's start or rank 0 saving the model."""
    assert _group_timeouts("cuda", split) == [77.0, 77.0]
