"""Weights only where they are used (trainer/grpo/remote.py): the coordinator sends each
bucket to each engine's first process once; the other processes of a multi-process engine
receive no weights. Three members of real gloo groups (threads of this process, on one
store): the coordinator, an engine's lead and its follower, as a vLLM engine of tensor
parallel 2 has (its lead relays the weights to vLLM's workers)."""

from __future__ import annotations

import copy
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from tests_helpers_trainer import run_threads
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.grpo.channels import announce_ready, open_channels, wait_until_ready
from trainer.grpo.config import RolloutConfig
from trainer.grpo.remote import EngineFollower, RemoteRolloutEngine, serve
from trainer.grpo.rollout import HFRolloutEngine

TIMEOUT = timedelta(seconds=60)
ROLLOUT_RANKS, LEADS = [1, 2], [1]  # one engine of two processes: rank 1 leads, 2 follows


def test_each_engine_receives_the_weights_once_and_followers_none(tiny_model_dir):
    store = dist.HashStore()
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = HFRolloutEngine(
        copy.deepcopy(policy).requires_grad_(False), tokenizer, RolloutConfig()
    )
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(0.01)
    model_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    seen: dict[str, object] = {}

    def coordinator():
        messages, weights = open_channels(store, ROLLOUT_RANKS, LEADS, 0, TIMEOUT)
        remote = RemoteRolloutEngine(LEADS, messages, 16 << 10, weights)  # many buckets
        seen["sent"] = remote.sync_weights((n, p.detach()) for n, p in policy.named_parameters())
        seen["coordinator"] = weights.broadcast_bytes
        remote.close()

    def lead():
        messages, weights = open_channels(store, ROLLOUT_RANKS, LEADS, 1, TIMEOUT)
        seen["lead"] = (messages, weights)
        serve(engine, 0, 1, messages, weights)

    def follower():
        messages, weights = open_channels(store, ROLLOUT_RANKS, LEADS, 2, TIMEOUT)
        seen["follower"] = (messages, weights)
        serve(EngineFollower(), 0, 1, messages, weights)

    run_threads(coordinator, lead, follower)
    assert seen["sent"] == model_bytes  # one engine, one copy
    assert model_bytes <= seen["coordinator"] < model_bytes + (64 << 10)  # + the buckets' headers
    lead_messages, lead_weights = seen["lead"]
    assert lead_weights is not lead_messages
    assert lead_weights.broadcast_bytes >= model_bytes  # the weights (and their headers)
    follower_messages, follower_weights = seen["follower"]
    assert follower_weights is None
    assert follower_messages.broadcast_bytes < 1024  # "sync", "stop": no weight byte
    for (name, want), got in zip(policy.named_parameters(), engine.model.parameters(), strict=True):
        assert torch.equal(want, got), name


def test_one_process_engines_share_one_channel():
    store = dist.HashStore()
    out = {}

    def member(rank):
        out[rank] = open_channels(store, [1, 2], [1, 2], rank, TIMEOUT)

    run_threads(*(lambda r=r: member(r) for r in range(3)))
    for messages, weights in out.values():
        assert messages is weights and messages.members == [0, 1, 2]


def test_each_side_waits_for_the_other_outside_any_collective():
    store = dist.HashStore()
    announce_ready(store, 2)
    late = threading.Timer(0.5, announce_ready, args=(store, 1))
    late.start()
    wait_until_ready(store, [1, 2], timedelta(seconds=30), "engines")  # once rank 1 is
    late.join()
    with pytest.raises(TimeoutError, match=r"engines \[3\] not ready.*rollout.start_timeout_s"):
        wait_until_ready(store, [1, 3], timedelta(seconds=1), "engines")
