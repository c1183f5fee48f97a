"""The sync budget (capacity/sync_time.py): every GPU node type states its interconnect, the
planner models a sync from bytes, hops and bandwidth, and ``lingo estimate`` prints it."""

from __future__ import annotations

import pytest

from capacity import format_table
from capacity.estimate import estimate
from capacity.layouts import Layout, node_fields
from capacity.model_spec import count_parameters, load_model_spec
from capacity.sync_time import HOP_LATENCY_S, model_sync
from cluster.nodes import LOCAL, NODE_TYPES, sender_network_gbps
from pipelines.presets import get_preset, run_estimates

GPT_OSS_20B = count_parameters(load_model_spec("gpt-oss-20b"))


@pytest.mark.parametrize("name", [n for n, node in NODE_TYPES.items() if node.device == "cuda"])
def test_every_gpu_node_type_states_its_interconnect(name):
    node = NODE_TYPES[name]
    assert node.network_gbps and node.intra_node_gbps and node.network_links >= 1


def test_one_gpu_reaches_its_share_of_the_nodes_network():
    assert sender_network_gbps(NODE_TYPES["p5en.48xlarge"]) == 400.0  # 2 × 200 Gb/s EFA
    assert sender_network_gbps(NODE_TYPES["g5.12xlarge"]) == 40.0  # its one interface
    assert sender_network_gbps(NODE_TYPES[LOCAL]) is None


def _g5(**fields) -> Layout:
    base = {
        **node_fields("g5.12xlarge", nodes=6),
        "training_gpus": 16,
        "rollout_gpus": 8,
        "vllm_tensor_parallel_size": 4,
        "zero_stage": 3,
        "sync_bucket_mb": 64,
    }
    return Layout(**(base | fields))


def test_a_sync_to_engines_on_other_nodes_crosses_the_senders_network():
    sync = model_sync(GPT_OSS_20B, _g5())
    nbytes = GPT_OSS_20B.total * 2
    assert sync.bytes == nbytes and sync.receivers == 8 and sync.hops == 8
    assert sync.wire_gbps == 40.0
    assert sync.wire_s == pytest.approx(nbytes * 8 / 40e9)
    # 16 ranks on 4 nodes: rank 0 gathers 3/4 of the weights over its node's 40 Gb/s
    assert sync.gather_s == pytest.approx(nbytes * 0.75 * 8 / 40e9)
    assert sync.buckets == -(-nbytes // (64 << 20))
    assert sync.latency_s == pytest.approx(8 * sync.buckets * HOP_LATENCY_S)
    # gather and wire overlap: the longer of the two, not their sum
    assert sync.wire_s < sync.seconds < sync.wire_s + sync.gather_s
    faster = model_sync(GPT_OSS_20B, _g5(**node_fields("p5en.48xlarge", nodes=6)))
    assert faster.wire_gbps == 400.0 and faster.seconds < sync.seconds / 5


def test_engines_on_the_senders_node_take_its_gpu_links():
    layout = Layout(
        **node_fields("p5en.48xlarge", nodes=1),
        training_gpus=4,
        rollout_gpus=4,
        vllm_tensor_parallel_size=4,
    )
    sync = model_sync(GPT_OSS_20B, layout)
    assert sync.wire_gbps == 7200.0 and "within node 0" in sync.route


def test_no_sync_is_modeled_without_dedicated_engines_or_a_stated_interconnect():
    assert model_sync(GPT_OSS_20B, _g5(hybrid=True, rollout_gpus=8)) is None
    assert model_sync(GPT_OSS_20B, _g5(rollout_gpus=0)) is None
    assert model_sync(GPT_OSS_20B, _g5(sender_network_gbps=None)) is None
    assert model_sync(GPT_OSS_20B, _g5(intra_node_gbps=None)) is None


def test_estimate_prints_the_modeled_sync_of_the_gpt_oss_20b_preset():
    _, estimates = run_estimates(get_preset("gpt-oss-20b"), "gpt-oss-20b")
    grpo = estimates["grpo"]
    assert grpo.sync is not None and grpo.sync.seconds > 1.0
    table = format_table(grpo)
    assert f"weight sync per step: {grpo.sync.seconds:.1f} s modeled" in table
    assert "rollout.sync_budget_s" in table
    assert estimates["sft"].sync is None
    assert estimate("gpt-oss-20b", "tiny-cpu").sync is None
