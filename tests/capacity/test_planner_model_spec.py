"""Parameter counts from the architecture: exact against transformers, and published figures."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tests_helpers_capacity import HAND_CONFIG
from transformers import GptOssConfig, GptOssForCausalLM

from capacity.model_presets import MODEL_PRESETS
from capacity.model_spec import (
    ModelSpec,
    ModelSpecError,
    count_lora_parameters,
    count_parameters,
    load_model_spec,
)
from capacity.quantities import GIB
from capacity.rollout_memory import rollout_weight_bytes


def _torch_count(config: dict) -> int:
    model = GptOssForCausalLM(GptOssConfig(**config))
    return sum(p.numel() for p in model.parameters())


def test_hand_counted_config() -> None:
    # Per layer: q 4·4+4=20, k 4·2+2=10, v 10, o 4·4+4=20, sinks 2 → attention 62;
    # router 3·4+3=15; experts 3·(4·12+12+6·4+4)=264; norms 2·4=8 → 349.
    # Model: 2·349 + embedding 40 + lm_head 40 + final norm 4 = 782.
    counts = count_parameters(ModelSpec.from_config(HAND_CONFIG))
    assert counts.per_layer == 349
    assert counts.attention == 124
    assert counts.experts == 528
    assert counts.total == 782
    # Active: no embedding table, 2 of 3 experts: 782 - 40 - 528 + 352.
    assert counts.active == 566
    assert counts.total == _torch_count(HAND_CONFIG)


@settings(max_examples=6, deadline=None)
@given(
    hidden=st.sampled_from([8, 16, 24]),
    intermediate=st.sampled_from([8, 12]),
    layers=st.integers(1, 3),
    heads_kv=st.sampled_from([(2, 1), (4, 2), (4, 4)]),
    head_dim=st.sampled_from([2, 4]),
    experts_topk=st.sampled_from([(2, 1), (4, 2)]),
    bias=st.booleans(),
    tied=st.booleans(),
)
def test_count_equals_transformers(
    hidden: int,
    intermediate: int,
    layers: int,
    heads_kv: tuple[int, int],
    head_dim: int,
    experts_topk: tuple[int, int],
    bias: bool,
    tied: bool,
) -> None:
    config = {
        **HAND_CONFIG,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads_kv[0],
        "num_key_value_heads": heads_kv[1],
        "head_dim": head_dim,
        "num_local_experts": experts_topk[0],
        "num_experts_per_tok": experts_topk[1],
        "attention_bias": bias,
        "tie_word_embeddings": tied,
    }
    torch.manual_seed(0)
    assert count_parameters(ModelSpec.from_config(config)).total == _torch_count(config)


def test_tiny_preset_matches_its_model() -> None:
    config = {
        k: v
        for k, v in MODEL_PRESETS["tiny-gpt-oss"].items()
        if k not in ("architectures", "torch_dtype")
    }
    assert count_parameters(load_model_spec("tiny-gpt-oss")).total == _torch_count(config)


# Published: gpt-oss model card (OpenAI, Aug 2025), table "Total / Active parameters" and the
# per-component split (MLP incl. router, attention, embedding + unembedding).
@pytest.mark.parametrize(
    ("preset", "total", "active", "mlp", "attention", "vocab"),
    [
        ("gpt-oss-20b", 20.91e9, 3.61e9, 19.12e9, 0.64e9, 1.16e9),
        ("gpt-oss-120b", 116.83e9, 5.13e9, 114.71e9, 0.96e9, 1.16e9),
    ],
)
def test_gpt_oss_published_counts(
    preset: str, total: float, active: float, mlp: float, attention: float, vocab: float
) -> None:
    counts = count_parameters(load_model_spec(preset))
    assert counts.total == pytest.approx(total, rel=0.005)
    assert counts.active == pytest.approx(active, rel=0.005)
    assert counts.experts + counts.router == pytest.approx(mlp, rel=0.005)
    assert counts.attention == pytest.approx(attention, rel=0.01)
    assert counts.embedding + counts.unembedding == pytest.approx(vocab, rel=0.005)


# Published checkpoint sizes of the MXFP4 releases: 12.8 GiB (20b), 60.8 GiB (120b).
@pytest.mark.parametrize(("preset", "gib"), [("gpt-oss-20b", 12.8), ("gpt-oss-120b", 60.8)])
def test_mxfp4_checkpoint_sizes(preset: str, gib: float) -> None:
    counts = count_parameters(load_model_spec(preset))
    assert rollout_weight_bytes(counts, "mxfp4") / GIB == pytest.approx(gib, rel=0.02)


def test_lora_count_by_hand() -> None:
    spec = ModelSpec.from_config(HAND_CONFIG)
    # Attention, r=2: q 2·(4+4) + k 2·(4+2) + v 2·(4+2) + o 2·(4+4) = 56 per layer → 112.
    assert count_lora_parameters(spec, 2, experts=False) == 112
    # Experts add 3 · 2·((4+12) + (6+4)) = 156 per layer → 112 + 312.
    assert count_lora_parameters(spec, 2, experts=True) == 424
    assert count_lora_parameters(spec, 0, experts=True) == 0


def test_load_from_directory_file_and_mapping(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HAND_CONFIG), encoding="utf-8")
    from_dir = load_model_spec(tmp_path)
    from_file = load_model_spec(str(tmp_path / "config.json"))
    from_mapping = load_model_spec(HAND_CONFIG)
    assert from_dir.hidden_size == from_file.hidden_size == from_mapping.hidden_size == 4
    assert from_dir.layer_types == ("sliding_attention", "full_attention")
    assert from_dir.num_sliding_layers == 1


def test_load_errors_name_the_input(tmp_path) -> None:
    with pytest.raises(ModelSpecError, match="no-such-model"):
        load_model_spec("no-such-model")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}), encoding="utf-8")
    with pytest.raises(ModelSpecError, match="llama"):
        load_model_spec(tmp_path)
    broken = {k: v for k, v in HAND_CONFIG.items() if k != "vocab_size"}
    with pytest.raises(ModelSpecError, match="vocab_size"):
        load_model_spec(broken)
