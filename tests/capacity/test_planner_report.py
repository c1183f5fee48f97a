"""Layouts, overrides, verdicts on whole scenarios, the table and the fail-fast check."""

from __future__ import annotations

import logging

import pytest

from capacity import (
    LAYOUT_PRESETS,
    LayoutDoesNotFit,
    LayoutError,
    Verdict,
    check_layout,
    estimate,
    render_estimate,
    resolve_layout,
)


def test_overrides_are_typed_from_strings() -> None:
    layout = resolve_layout(
        "g5.12xlarge-x6-openrlhf",
        {"nodes": "8", "hybrid": "true", "rollout_gpus": "16", "vllm_sleep_level": "2"},
    )
    assert (layout.nodes, layout.hybrid, layout.vllm_sleep_level) == (8, True, 2)
    assert LAYOUT_PRESETS["g5.12xlarge-x6-openrlhf"].nodes == 6  # presets stay untouched


@pytest.mark.parametrize(
    ("layout", "overrides", "named"),
    [
        ("no-such-layout", {}, "no-such-layout"),
        ("tiny-cpu", {"node": "2"}, "node"),
        ("tiny-cpu", {"zero_stage": "5"}, "zero_stage"),
        ("tiny-cpu", {"dtype": "fp8"}, "dtype"),
        ("g5.12xlarge-x6-openrlhf", {"rollout_gpus": "12"}, "rollout_gpus"),
        ("g5.12xlarge-x6-openrlhf", {"vllm_tensor_parallel_size": "3"}, "vllm_tensor_parallel"),
    ],
)
def test_bad_layouts_name_the_input(layout: str, overrides: dict[str, str], named: str) -> None:
    with pytest.raises(LayoutError, match=named):
        resolve_layout(layout, overrides)


@pytest.mark.parametrize("preset", sorted(LAYOUT_PRESETS))
def test_every_preset_estimates(preset: str) -> None:
    model = "tiny-gpt-oss" if LAYOUT_PRESETS[preset].device == "cpu" else "gpt-oss-20b"
    result = estimate(model, preset)
    assert result.resources[0].key == "training_gpu"
    assert result.resources[-1].key == "storage"
    for resource in result.resources:
        assert resource.total.expected > 0
        assert resource.capacity > 0


def test_reference_layouts_fit_their_models() -> None:
    assert estimate("gpt-oss-20b", "g5.12xlarge-x6-openrlhf").fits
    assert estimate("gpt-oss-120b", "p5en.48xlarge-x2-megatron").fits
    assert estimate("tiny-gpt-oss", "tiny-cpu").verdict is Verdict.FITS


def test_120b_on_the_a10g_cluster_does_not_fit_the_host() -> None:
    result = estimate("gpt-oss-120b", "g5.12xlarge-x6-openrlhf")
    host = result.resource("host_node0")
    assert host.verdict is Verdict.DOES_NOT_FIT
    assert any("add training nodes" in advice for advice in host.advice)


def test_large_micro_batch_overflows_the_a10g() -> None:
    result = estimate("gpt-oss-20b", "g5.12xlarge-x6-openrlhf", {"micro_train_batch_size": "4"})
    gpu = result.resource("training_gpu")
    assert gpu.verdict is Verdict.DOES_NOT_FIT
    assert "micro_train_batch_size" in gpu.advice[0]


def test_hybrid_with_12_training_gpus_overflows_node0_ram() -> None:
    overrides = {"hybrid": "true", "rollout_gpus": "12"}
    result = estimate("gpt-oss-20b", "g5.12xlarge-x6-openrlhf-12train", overrides)
    host = result.resource("host_node0")
    assert host.verdict is Verdict.DOES_NOT_FIT
    assert any("non-hybrid" in advice for advice in host.advice)


def test_long_generations_leave_the_kv_cache_short() -> None:
    base = estimate("gpt-oss-20b", "g5.12xlarge-x6-openrlhf")
    longer = estimate("gpt-oss-20b", "g5.12xlarge-x6-openrlhf", {"generate_max_len": "131072"})
    assert longer.kv is not None and base.kv is not None
    assert longer.kv.sequences < base.kv.sequences
    rollout = longer.resource("rollout_gpu")
    assert rollout.verdict is not Verdict.FITS
    assert "generate_max_len" in rollout.advice[0]


def test_table_shows_every_resource_and_term() -> None:
    result = estimate("gpt-oss-20b", "g5.12xlarge-x6-openrlhf-12train")
    table = render_estimate("gpt-oss-20b", "g5.12xlarge-x6-openrlhf-12train", {})
    assert "20.91B parameters (3.61B active" in table
    for resource in result.resources:
        assert resource.label in table
        for term in resource.terms:
            assert term.label[:40] in table
    optimizer = result.resource("host_node0").term("optimizer_offload").bytes.expected
    assert f"{optimizer / 2**30:.1f}" in table
    assert table.rstrip().endswith(f"verdict: {result.verdict.value}")


def test_check_layout_fails_fast_with_the_table() -> None:
    with pytest.raises(LayoutDoesNotFit) as raised:
        check_layout("gpt-oss-120b", "g5.12xlarge-x6-openrlhf")
    assert raised.value.estimate.verdict is Verdict.DOES_NOT_FIT
    assert "host memory / node 0" in raised.value.table
    assert raised.value.table in str(raised.value)


def test_check_layout_returns_and_warns_when_tight(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="capacity.report"):
        result = check_layout("gpt-oss-20b", "g5.12xlarge-x6-openrlhf")
    assert result.verdict is Verdict.TIGHT
    assert "tight" in caplog.text
