"""MXFP4 checkpoints (the hub's gpt-oss) are dequantized on purpose: recognized from
``config.json``, unpacked exactly, loaded as bf16 with a log line, and saved without a
quantization config. The checkpoint is the tests' own packer's (``tests/mxfp4_checkpoint.py``)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from mxfp4_checkpoint import HUB_QUANTIZATION_CONFIG
from safetensors.torch import load_file

from core import mxfp4
from core.modeling import load_causal_lm


def test_the_packer_writes_the_hub_layout(mxfp4_model):
    model_dir, originals = mxfp4_model
    stored = load_file(model_dir / "model.safetensors")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert name not in stored
    experts, hidden, width = originals[name].shape  # [4, 64, 2·96]
    assert stored[f"{name}_blocks"].dtype == torch.uint8
    assert stored[f"{name}_blocks"].shape == (experts, width, hidden // 32, 16)
    assert stored[f"{name}_scales"].shape == (experts, width, hidden // 32)
    quantization = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    assert quantization == HUB_QUANTIZATION_CONFIG and quantization["quant_method"] == "mxfp4"


def test_the_packed_pairs_dequantize_to_the_original_matrices(mxfp4_model):
    model_dir, originals = mxfp4_model
    stored = load_file(model_dir / "model.safetensors")
    assert len(originals) == 4  # gate_up_proj and down_proj of 2 layers
    for name, original in originals.items():
        blocks, scales = stored[f"{name}_blocks"], stored[f"{name}_scales"]
        assert mxfp4.dequantized_shape(tuple(blocks.shape)) == tuple(original.shape)
        assert torch.equal(mxfp4.dequantize(blocks, scales, torch.bfloat16), original), name
        as_fp32 = mxfp4.dequantize(blocks, scales, torch.float32)
        assert torch.equal(as_fp32, original.float()), name  # bf16 holds MXFP4 values exactly


def test_mismatched_blocks_and_scales_are_a_clear_error():
    with pytest.raises(ValueError, match="do not pair"):
        mxfp4.dequantize(
            torch.zeros(2, 8, 2, 16, dtype=torch.uint8), torch.zeros(2, 8, 3), torch.bfloat16
        )


def test_load_causal_lm_dequantizes_and_says_so(mxfp4_model, caplog):
    model_dir, originals = mxfp4_model
    with caplog.at_level(logging.INFO, logger="core.mxfp4"):
        model = load_causal_lm(model_dir, torch.bfloat16)
    lines = [r.getMessage() for r in caplog.records if r.name == "core.mxfp4"]
    assert len(lines) == 1 and "MXFP4 experts" in lines[0] and "bfloat16" in lines[0], lines
    assert str(model_dir) in lines[0]
    state = model.state_dict()
    for name, original in originals.items():
        assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], original), name
    assert getattr(model.config, "quantization_config", None) is None
    assert type(model.model.layers[0].mlp.experts).__name__ == "GptOssExperts"  # trainable


def test_a_model_saved_from_an_mxfp4_load_carries_no_quantization_config(mxfp4_model, tmp_path):
    model_dir, originals = mxfp4_model
    load_causal_lm(model_dir, torch.bfloat16).save_pretrained(tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    assert not mxfp4.is_mxfp4(tmp_path / "saved")
    reloaded = load_causal_lm(tmp_path / "saved", torch.bfloat16).state_dict()
    for name, original in originals.items():
        assert torch.equal(reloaded[name], original), name


def test_another_quantization_is_refused_by_name(mxfp4_model, tmp_path):
    model_dir, _ = mxfp4_model
    other = tmp_path / "fp8"
    shutil.copytree(model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(mxfp4.UnsupportedQuantizationError, match=r"config\.json.*'fp8'"):
        load_causal_lm(other, torch.bfloat16)


def test_a_plain_directory_is_not_mxfp4(tiny_model_dir):
    assert mxfp4.quantization_method(tiny_model_dir) is None
    assert not mxfp4.is_mxfp4(tiny_model_dir)
    assert mxfp4.from_pretrained_kwargs(tiny_model_dir, torch.bfloat16) == {}
