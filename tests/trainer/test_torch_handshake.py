"""The rollout channels' torch-release handshake (trainer/grpo/channels.py): in the Megatron
branch the trainers (NGC's torch) and the dedicated engines (the GPU image's) run two torch
builds in one job; before a channel's first collective each member publishes its torch and
Python in the job's store, and the coordinator logs them once and warns when the releases
differ, saying what was measured of that pair. Two real processes on a real TCPStore and
gloo channel; one reports a faked torch version, as a process of the other image would."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import free_port
from tests_helpers_trainer import subprocess_env

from trainer.grpo.channels import (
    MEASURED_RELEASE_PAIRS,
    check_torch_releases,
    runtime_versions,
    torch_release,
)

WORKER = Path(__file__).with_name("handshake_worker.py")
NGC_25_10 = "2.9.0a0+145a3a7bda.nv25.10"
"""The torch of the Megatron image's base, nvcr.io/nvidia/pytorch:25.10-py3."""


def _channel(rank1_torch: str | None) -> str:
    """Run a two-process channel (rank 1 reporting ``rank1_torch``); the coordinator's log."""
    port = free_port()
    command = [sys.executable, str(WORKER)]
    coordinator = subprocess.Popen(
        [*command, "0", str(port)], env=subprocess_env(), stderr=subprocess.PIPE, text=True
    )
    engine = subprocess.Popen(
        [*command, "1", str(port), *([rank1_torch] if rank1_torch else [])],
        env=subprocess_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        engine_log = engine.communicate(timeout=120)[1]
        coordinator_log = coordinator.communicate(timeout=60)[1]
    finally:
        for process in (coordinator, engine):
            process.kill()
    assert engine.returncode == 0, engine_log[-3000:]
    assert coordinator.returncode == 0, coordinator_log[-3000:]
    assert "two torch releases" not in engine_log  # only the coordinator logs the set
    return coordinator_log


def test_the_coordinator_warns_naming_both_torch_builds_and_the_measured_pair():
    log = _channel(NGC_25_10)
    mine = f"torch {torch.__version__} (Python {runtime_versions()['python']}) on ranks [0]"
    assert mine in log and f"torch {NGC_25_10} (Python" in log and "on ranks [1]" in log
    [warning] = [line for line in log.splitlines() if line.startswith("WARNING")]
    assert f"two torch releases in one job (2.9 and {torch_release(torch.__version__)})" in warning
    assert NGC_25_10 in warning and torch.__version__ in warning
    assert "measured in one job" in warning and "bit-exact" in warning
    assert log.count("rollout channel members") == 1


def _coordinator_log(caplog, *others: str) -> list[logging.LogRecord]:
    """The coordinator's handshake records, the other members (ranks 1, 2, ...) having
    published ``others`` (torch versions) in the store."""
    store = dist.HashStore()
    for rank, version in enumerate(others, start=1):
        store.set(f"versions/{rank}", json.dumps({"torch": version, "python": "3.12.3"}))
    with caplog.at_level(logging.INFO, logger="trainer.grpo.channels"):
        versions = check_torch_releases(store, range(len(others) + 1), 0, timedelta(seconds=5))
    assert [v["torch"] for v in versions.values()] == [torch.__version__, *others]
    return caplog.records


def test_an_unmeasured_pair_is_named_with_the_way_to_measure_it(caplog):
    records = _coordinator_log(caplog, "3.1.0+cu140", NGC_25_10)
    [warning] = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    mine = torch_release(torch.__version__)
    assert f"two torch releases in one job (2.9 and {mine} and 3.1)" in warning
    assert f"torch 2.9 and 3.1, {mine} and 3.1 not measured together" in warning
    assert "bench/channel_compat.py" in warning
    assert MEASURED_RELEASE_PAIRS[frozenset({"2.9", mine})] in warning


def test_one_torch_release_is_logged_once_without_a_warning(caplog):
    records = _coordinator_log(caplog, torch.__version__.split("+")[0] + "+other-build")
    assert [r.levelno for r in records] == [logging.INFO]
    assert "on ranks [0]" in records[0].getMessage() and "on ranks [1]" in records[0].getMessage()


def test_a_member_that_never_publishes_is_named_before_any_collective():
    store = dist.HashStore()
    store.set("versions/1", '{"torch": "2.13.0", "python": "3.11.7"}')
    with pytest.raises(TimeoutError, match=r"members \[2\] did not start within 1 s"):
        check_torch_releases(store, [0, 1, 2], 0, timedelta(seconds=1))


def test_releases_are_major_minor_of_any_build():
    assert torch_release(NGC_25_10) == "2.9"
    assert torch_release("2.13.0+cpu") == "2.13"
    assert torch_release("2.14.0") == "2.14"
    assert frozenset({torch_release(NGC_25_10), "2.14"}) in MEASURED_RELEASE_PAIRS


def test_the_channels_pickle_with_protocol_4_whatever_the_python():
    """Protocol 5 (Python 3.14's default) writes numpy 2 arrays under ``numpy._core``, which
    numpy 1.x, in the other image, cannot load."""
    import pickle
    import pickletools

    import numpy as np

    from trainer.grpo.channels import channel_pickle

    data = channel_pickle({"routed_experts": np.zeros((2, 3), dtype=np.int16)})
    protocols = {arg for op, arg, _ in pickletools.genops(data) if op.name == "PROTO"}
    assert protocols == {4}
    assert pickle.loads(data)["routed_experts"].dtype == np.int16
