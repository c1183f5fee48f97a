"""The sync budget (capacity/sync_time.py): every GPU node type states its interconnect, the
planner models a sync from bytes, hops and bandwidth, and ``lingo estimate`` prints it."""

from __future__ import annotations

import pytest

from capacity import format_table
from capacity.estimate import estimate
from capacity.layouts import Layout, node_fields
from capacity.model_spec import count_lora_parameters, count_parameters, load_model_spec
from capacity.sync_time import HOP_LATENCY_S, NoSync, describe_sync, model_sync
from cluster.nodes import LOCAL, NODE_TYPES, sender_network_gbps
from pipelines.preset_capacity import run_estimates
from pipelines.presets import get_preset

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


def test_colocated_engines_move_nothing_and_unmodeled_layouts_get_no_sync():
    for colocated in (_g5(hybrid=True, rollout_gpus=8), _g5(rollout_gpus=0)):
        sync = model_sync(GPT_OSS_20B, colocated)
        assert isinstance(sync, NoSync) and sync.bytes == GPT_OSS_20B.total * 2
        assert describe_sync(sync).startswith("weight sync per step: none, 0 s")
    assert model_sync(GPT_OSS_20B, _g5(rollouts=False, rollout_gpus=0)) is None  # SFT
    assert model_sync(GPT_OSS_20B, _g5(sender_network_gbps=None)) is None
    assert model_sync(GPT_OSS_20B, _g5(intra_node_gbps=None)) is None


def test_a_lora_sync_moves_the_adapter_alone():
    """Under LoRA the sync's bytes are the adapter's (trainer: ``hf_weights(trainable_only=
    True)``): r=16 on attention and experts is under 1% of gpt-oss-20b's bytes, and its
    buckets, gather and wire time shrink with it."""
    adapter = count_lora_parameters(load_model_spec("gpt-oss-20b"), 16, experts=True)
    full = model_sync(GPT_OSS_20B, _g5())
    lora = model_sync(GPT_OSS_20B, _g5(lora_rank=16, lora_experts=True), adapter=adapter)
    assert lora.adapter and not full.adapter
    assert lora.bytes == adapter * 2 and lora.bytes < 0.01 * full.bytes
    assert lora.buckets == -(-lora.bytes // (64 << 20)) < full.buckets
    assert lora.wire_s == pytest.approx(lora.bytes * 8 / 40e9)
    assert lora.seconds < full.seconds / 50
    assert "the LoRA adapter alone" in describe_sync(lora)
    assert "the LoRA adapter alone" not in describe_sync(full)


def test_the_lora_presets_colocated_engines_sync_nothing_and_it_says_what_a_sync_would_move():
    preset = get_preset("gpt-oss-20b-lora")
    _, estimates = run_estimates(preset, "gpt-oss-20b")
    sync = estimates["grpo"].sync
    adapter = count_lora_parameters(load_model_spec("gpt-oss-20b"), preset.grpo.lora.r, True)
    assert isinstance(sync, NoSync) and sync.adapter and sync.bytes == 2 * adapter
    line = (
        "weight sync per step: none, 0 s (the HF engine samples with the module each rank "
        f"trains); a sync to dedicated engines would move {sync.bytes / 2**20:.0f} MiB, the "
        "LoRA adapter alone"
    )
    assert line in format_table(estimates["grpo"])
    assert estimates["sft"].sync is None


def test_estimate_prints_the_modeled_sync_of_the_gpt_oss_20b_preset():
    _, estimates = run_estimates(get_preset("gpt-oss-20b"), "gpt-oss-20b")
    grpo = estimates["grpo"]
    assert grpo.sync is not None and grpo.sync.seconds > 1.0
    table = format_table(grpo)
    assert f"weight sync per step: {grpo.sync.seconds:.1f} s modeled" in table
    assert "rollout.sync_budget_s" in table
    assert estimates["sft"].sync is None
    assert estimate("gpt-oss-20b", "tiny-cpu").sync is None
