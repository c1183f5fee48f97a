"""The weight sync's transport (trainer/grpo/weight_transfer.py): which one each kind of run
selects, the pipelined buckets (the next gathered while one is on the wire), and the direct
group of dedicated vLLM engines, where every TP worker receives each bucket from the trainer
itself (relay factor 1.0).

The direct-group test runs the real coordinator (``RemoteRolloutEngine``), the real engine
lead (``DedicatedVLLMEngine.join_transfer``/``receive_weights``, ``serve``) and a follower over
real gloo groups (threads of this process, real TCP on localhost). vLLM's workers cannot run
here at TP 2 (the CPU build on this machine's cores), so two fake workers stand in for them:
they join as ``vllm_transfer.HostWeightTransferEngine`` joins (vLLM's
``stateless_init_torch_distributed_process_group``: a TCPStore client, the ``tcp://host:port``
prefix, gloo) and receive as it receives (one broadcast of the bucket's bytes).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from tests_helpers_trainer import run_threads

from trainer.grpo.channels import open_channels
from trainer.grpo.remote import DirectTransfer, EngineFollower, RemoteRolloutEngine, _unflat, serve
from trainer.grpo.vllm_dedicated import DedicatedVLLMEngine
from trainer.grpo.weight_transfer import (
    GlooSender,
    TransferChoice,
    log_transfer,
    pipelined,
    relay_factor,
    select_transfer,
)

TIMEOUT = timedelta(seconds=60)


@pytest.mark.parametrize(
    ("device", "colocate", "engine", "has_vllm", "transport", "direct"),
    [
        ("cuda", False, "vllm", True, "nccl", True),
        ("cuda", False, "vllm", False, "lingo_gloo", True),
        ("cpu", False, "vllm", True, "lingo_gloo", True),
        ("cpu", False, "vllm", False, "lingo_gloo", True),
        ("cuda", True, "vllm", True, "in_process_reload", False),
        ("cpu", True, "vllm", True, "in_process_reload", False),
        ("cuda", True, "hf", True, "shared", False),
        ("cpu", True, "hf", False, "shared", False),
        ("cuda", False, "hf", True, "channel", True),
        ("cpu", False, "hf", True, "channel", True),
    ],
)
def test_each_kind_of_run_selects_its_transport(
    device, colocate, engine, has_vllm, transport, direct
):
    choice = select_transfer(device, colocate, engine, has_vllm)
    assert (choice.transport, choice.direct) == (transport, direct)
    assert choice.reason


def test_an_unknown_engine_or_device_is_refused_by_name():
    with pytest.raises(ValueError, match="rollout.engine='sglang'"):
        select_transfer("cuda", False, "sglang")
    with pytest.raises(ValueError, match="device='xpu'"):
        select_transfer("xpu", False, "vllm")


def test_the_choice_is_logged_once(caplog):
    choice = TransferChoice("nccl", True, "a test's own reason")
    with caplog.at_level(logging.INFO, logger="trainer.grpo.weight_transfer"):
        assert log_transfer(choice)
        assert not log_transfer(choice)
    lines = [r.getMessage() for r in caplog.records if "a test's own reason" in r.getMessage()]
    assert lines == ["weight sync transport: nccl (a test's own reason)"]


class _Timeline:
    """Instrumented gather and send: when each bucket's gather and send started and ended,
    and how many buckets were alive at once."""

    def __init__(self, buckets: int, gather_s: float, send_s: float) -> None:
        self.buckets, self.gather_s, self.send_s = buckets, gather_s, send_s
        self.events: dict[tuple[str, int], tuple[float, float]] = {}
        self.alive = self.most_alive = 0
        self.lock = threading.Lock()

    def gather(self):
        for k in range(self.buckets):
            started = time.monotonic()
            time.sleep(self.gather_s)
            with self.lock:
                self.alive += 1
                self.most_alive = max(self.most_alive, self.alive)
            self.events["gather", k] = (started, time.monotonic())
            yield k, torch.full((1000,), float(k))

    def send(self, k: int) -> None:
        started = time.monotonic()
        time.sleep(self.send_s)
        self.events["send", k] = (started, time.monotonic())
        with self.lock:
            self.alive -= 1


def test_the_next_bucket_is_gathered_while_the_current_one_is_sent():
    timeline = _Timeline(buckets=6, gather_s=0.05, send_s=0.05)
    started = time.monotonic()
    received = []
    for k, tensor in pipelined(timeline.gather()):
        timeline.send(k)
        received.append((k, tensor))
    took = time.monotonic() - started
    for k in range(timeline.buckets - 1):
        send_start, send_end = timeline.events["send", k]
        gather_start, gather_end = timeline.events["gather", k + 1]
        assert gather_start < send_end and send_start < gather_end, f"bucket {k + 1}"
    assert took < 0.8 * timeline.buckets * (timeline.gather_s + timeline.send_s)  # serial: 0.6 s
    assert timeline.most_alive <= 2  # a double buffer: one on the wire, one being gathered
    assert [k for k, _ in received] == list(range(timeline.buckets))
    assert all(torch.equal(t, torch.full((1000,), float(k))) for k, t in received)


def test_a_gather_that_fails_raises_in_the_sender():
    def broken():
        yield 1
        raise RuntimeError("gather of bucket 2 failed")

    got = []
    with pytest.raises(RuntimeError, match="gather of bucket 2 failed"):
        for item in pipelined(broken()):
            got.append(item)
    assert got == [1]


def test_relay_factor_counts_what_a_process_receives_against_what_it_loads():
    assert relay_factor({"w0": 100, "w1": 100}, {"w0": 100, "w1": 100}) == 1.0
    assert relay_factor({"lead": 100, "w0": 100}, {"w0": 100}) == float("inf")
    assert relay_factor({"w0": 300}, {"w0": 100}) == 3.0


class _FakeWorker:
    """One vLLM TP worker as ``vllm_transfer.HostWeightTransferEngine`` is one: joins the
    trainer's group at its rank, receives each bucket's bytes in one broadcast, loads them."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.group = None
        self.received_bytes = 0
        self.loaded: dict[str, torch.Tensor] = {}

    def join(self, info: dict) -> None:
        host, port = info["master_address"], info["master_port"]
        store = dist.TCPStore(host, port, info["world_size"], is_master=False, timeout=TIMEOUT)
        prefix = dist.PrefixStore(f"tcp://{host}:{port}", store)
        rank = info["rank_offset"] + self.index
        self.group = dist.ProcessGroupGloo(prefix, rank, info["world_size"], TIMEOUT)

    def update_weights(self, update_info: dict) -> None:
        dtypes = [getattr(torch, name) for name in update_info["dtype_names"]]
        spec = list(zip(update_info["names"], dtypes, update_info["shapes"], strict=True))
        size = sum(
            torch.Size(shape).numel() * torch.empty((), dtype=d).element_size()
            for _, d, shape in spec
        )
        flat = torch.empty(size, dtype=torch.uint8)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([flat], options).wait()
        self.received_bytes += flat.numel()
        self.loaded.update((name, t.clone()) for name, t in _unflat(spec, flat))


class _FakeLLM:
    """vLLM's ``LLM`` as ``DedicatedVLLMEngine`` calls it: each RPC runs on every worker."""

    def __init__(self, workers: int) -> None:
        self.workers = [_FakeWorker(i) for i in range(workers)]
        self.calls: list[str] = []
        core = SimpleNamespace(shutdown=lambda: self.calls.append("shutdown"))
        self.llm_engine = SimpleNamespace(engine_core=core)

    def _on_all(self, method: str, *args) -> None:
        threads = [
            threading.Thread(target=getattr(w, method), args=args, daemon=True)
            for w in self.workers
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)

    def init_weight_transfer_engine(self, request: dict) -> None:
        self._on_all("join", request["init_info"])

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, request: dict) -> None:
        self.calls.append("update")
        self._on_all("update_weights", request["update_info"])

    def finish_weight_update(self) -> None:
        self.calls.append("finish")

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset")

    def collective_rpc(self, method: str) -> list[int]:
        assert method == "weight_bytes_received"
        return [w.received_bytes for w in self.workers]


def _lead_engine(workers: int) -> DedicatedVLLMEngine:
    """The real ``DedicatedVLLMEngine`` lead logic over a fake ``LLM`` (no vLLM here)."""
    engine = object.__new__(DedicatedVLLMEngine)
    engine.llm = _FakeLLM(workers)
    engine.quantization, engine.model_dir = None, "fake"
    engine.joined = False
    engine.sender = None
    return engine


def test_every_tp_worker_receives_each_bucket_from_the_trainer_and_nothing_is_relayed():
    """One engine of tensor parallel 2 (ranks 1 lead, 2 follower; two vLLM workers)."""
    torch.manual_seed(0)
    policy = {
        f"model.layers.{i}.{part}": torch.randn(64, 48, dtype=torch.bfloat16)
        for i in range(4)
        for part in ("q.weight", "k.weight", "mlp.weight")
    } | {"model.norm.weight": torch.randn(48), "model.layers.0.sinks": torch.randn(7)}
    model_bytes = sum(t.numel() * t.element_size() for t in policy.values())
    bucket_bytes = 16 << 10
    store = dist.HashStore()
    lead = _lead_engine(workers=2)
    seen: dict[str, object] = {}

    def coordinator():
        messages, weights = open_channels(store, [1, 2], [1], 0, TIMEOUT)
        choice = select_transfer("cpu", False, "vllm")
        direct = DirectTransfer(choice, (2,), "127.0.0.1", TIMEOUT)
        remote = RemoteRolloutEngine([1], messages, bucket_bytes, weights, direct)
        seen["sent"] = remote.sync_weights(iter(policy.items()))
        seen["sent_again"] = remote.sync_weights(iter(policy.items()))
        seen["stats"] = remote.sender.stats
        seen["headers"] = weights.broadcasts
        remote.close()

    def engine_lead():
        messages, weights = open_channels(store, [1, 2], [1], 1, TIMEOUT)
        seen["lead_weights_channel"] = weights
        serve(lead, 0, 1, messages, weights)

    def follower():
        messages, weights = open_channels(store, [1, 2], [1], 2, TIMEOUT)
        seen["follower"] = (messages, weights)
        serve(EngineFollower(), 0, 1, messages, weights)

    run_threads(coordinator, engine_lead, follower)

    workers = lead.llm.workers
    stats = seen["stats"]
    assert lead.llm.calls[-1] == "shutdown"
    received = {f"worker {w.index}": w.received_bytes for w in workers}
    needed = {f"worker {w.index}": 2 * model_bytes for w in workers}  # two syncs, all of it
    lead_channel = seen["lead_weights_channel"]
    # the lead's channel carried the buckets' names, dtypes and shapes: no weight byte
    assert lead_channel.broadcast_bytes < model_bytes / 10
    received["lead"] = 0
    assert relay_factor(received, needed) == 1.0
    assert lead.worker_bytes_received() == [2 * model_bytes, 2 * model_bytes]
    assert seen["sent"] == seen["sent_again"] == 2 * model_bytes  # each worker counted
    for worker in workers:
        assert set(worker.loaded) == set(policy)
        for name, tensor in policy.items():
            assert torch.equal(worker.loaded[name], tensor), (worker.index, name)
    # collectives per bucket: one broadcast of its bytes on the weight group, and its header
    # (names, dtypes, shapes) as one object on the lead's channel: a size and a payload
    assert stats.buckets >= 4 and stats.collectives_per_bucket == 1.0
    headers_per_sync = stats.buckets // 2 + 1  # every bucket, then END
    assert seen["headers"] == 2 * 2 * headers_per_sync  # two syncs, two broadcasts per object
    assert lead.llm.calls.count("update") == stats.buckets
    follower_messages, follower_weights = seen["follower"]
    assert follower_weights is None and follower_messages.broadcast_bytes < 4096


def test_the_gloo_sender_delivers_the_bytes_identical():
    sender = GlooSender("127.0.0.1", 2, TIMEOUT)
    worker = _FakeWorker(0)
    info = {
        "master_address": "127.0.0.1",
        "master_port": sender.port,
        "world_size": 2,
        "rank_offset": 1,
    }
    bucket = torch.randint(0, 255, (123_457,), dtype=torch.uint8)
    spec = {"names": ["w"], "dtype_names": ["uint8"], "shapes": [[123_457]]}
    run_threads(sender.connect, lambda: worker.join(info))
    run_threads(lambda: sender.send(bucket), lambda: worker.update_weights(spec))
    sender.close()
    assert torch.equal(worker.loaded["w"], bucket)
    assert sender.stats.bytes == bucket.numel() and sender.stats.collectives == 1
