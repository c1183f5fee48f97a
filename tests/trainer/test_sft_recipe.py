"""SFT end to end on the tiny model: learning, merge, LoRA on experts, metrics, bad input."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tests_helpers_trainer import recipe_paths
from transformers import AutoModelForCausalLM

from core.modeling import ModelLoadError, NotACausalLMError, check_model_dir
from trainer.metrics import read_metrics
from trainer.sft.config import LoraSettings, SFTConfig
from trainer.sft.merge import AdapterMismatchError, load_adapter
from trainer.sft.recipe import run_sft

FAST = dict(
    micro_batch_size=2, gradient_accumulation_steps=2, max_seq_len=512, merge_check_prompts=2
)


def _run(tmp_path, tiny_model_dir, prepared_data, **cfg):
    config = SFTConfig(**{**FAST, **cfg})
    return run_sft(config, *recipe_paths(tiny_model_dir, prepared_data, tmp_path))


def test_full_fine_tuning_learns_and_writes_metrics(tmp_path, tiny_model_dir, prepared_data):
    result = _run(
        tmp_path,
        tiny_model_dir,
        prepared_data,
        lora=LoraSettings(r=0),
        max_steps=60,
        eval_every=30,
        optim={"learning_rate": 3e-3, "warmup_steps": 3},
    )
    lines = read_metrics(result.metrics_file)
    steps = [m for m in lines if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, 61))
    assert all(m["max_steps"] == 60 and "epoch" in m and "grad_norm" in m for m in steps)
    walls = [m["wall_time_s"] for m in lines]
    assert walls == sorted(walls)  # cumulative
    assert [m["step"] for m in lines if "eval_loss" in m] == [30, 60]
    assert result.last_loss < result.first_loss - 1.0  # it learns
    assert (tmp_path / "work" / "loss.png").stat().st_size > 1000
    assert result.merge["merged_adapter"] is False
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert model.config.model_type == "gpt_oss"


def test_lora_with_experts_merges_exactly_into_plain_weights(
    tmp_path, tiny_model_dir, prepared_data
):
    result = _run(
        tmp_path,
        tiny_model_dir,
        prepared_data,
        lora=LoraSettings(r=4, alpha=8, experts=True),
        max_steps=3,
        optim={"learning_rate": 1e-2},
    )
    merge = result.merge
    assert merge["merged_adapter"] is True
    assert merge["max_abs_diff_in_memory"] <= 1e-4 and merge["max_abs_diff_after_reload"] <= 1e-4
    base = load_file(tiny_model_dir / "model.safetensors")
    merged = load_file(tmp_path / "model" / "model.safetensors")
    assert set(merged) == set(base)  # plain GPT-OSS weights, no lora_ keys
    for name in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "self_attn.q_proj.weight"):
        key = f"model.layers.0.{name}"
        assert not torch.equal(base[key], merged[key]), f"{key} unchanged by the merge"
    assert torch.equal(base["model.embed_tokens.weight"], merged["model.embed_tokens.weight"])
    adapter = json.loads((tmp_path / "work" / "adapter" / "adapter_config.json").read_text())
    assert set(adapter["target_parameters"]) == {
        "mlp.experts.gate_up_proj",
        "mlp.experts.down_proj",
    }
    # the saved adapter on the base gives the merged model's logits
    with_adapter = load_adapter(tiny_model_dir, tmp_path / "work" / "adapter")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        assert torch.allclose(
            with_adapter(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-4
        )


def test_bad_model_and_adapter_inputs_are_clear_errors(tmp_path, tiny_model_dir):
    with pytest.raises(NotACausalLMError, match="no config.json"):
        check_model_dir(tmp_path)
    (tmp_path / "vit").mkdir()
    (tmp_path / "vit" / "config.json").write_text(
        json.dumps({"model_type": "vit", "architectures": ["ViTModel"]})
    )
    with pytest.raises(NotACausalLMError, match="not a causal language model"):
        check_model_dir(tmp_path / "vit")
    with pytest.raises(AdapterMismatchError, match="no adapter_config.json"):
        load_adapter(tiny_model_dir, tmp_path)


def test_corrupt_weights_name_the_model_directory_and_file(tmp_path, tiny_model_dir, prepared_data):
    # issue #17: on main a bare SafetensorError ("HeaderTooSmall"), no file named
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match=rf"{broken}: cannot load .*model.safetensors"):
        _run(tmp_path, broken, prepared_data)
    assert not (tmp_path / "model").exists()


def test_adapter_for_another_base_is_rejected(tmp_path, tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from tests_helpers_trainer import SMALL_CORPUS, SMALL_CORPUS_MODEL

    from trainer.tiny_model import build_tiny_model

    other = build_tiny_model(tmp_path / "other", SMALL_CORPUS_MODEL, SMALL_CORPUS)
    peft = get_peft_model(
        AutoModelForCausalLM.from_pretrained(other), LoraConfig(r=2, target_modules=["q_proj"])
    )
    peft.save_pretrained(tmp_path / "adapter")
    with pytest.raises(AdapterMismatchError, match="does not fit base model"):
        load_adapter(tiny_model_dir, tmp_path / "adapter")


def test_too_small_dataset_for_one_global_batch(tmp_path, tiny_model_dir, prepared_data):
    one = tmp_path / "one.jsonl"
    one.write_text((prepared_data / "train.jsonl").read_text().splitlines()[0] + "\n")
    with pytest.raises(ValueError, match="fewer than one global batch"):
        run_sft(SFTConfig(**FAST), tiny_model_dir, one, None, tmp_path / "m", tmp_path / "w")


def test_sft_refuses_the_megatron_backend():
    from pydantic import ValidationError

    from trainer.sft.config import SFTConfig

    with pytest.raises(ValidationError, match="'megatron' is for GRPO"):
        SFTConfig.model_validate(
            {"optim": {"backend": "megatron", "megatron": {"layout": "tiny-cpu"}}}
        )


def test_sft_from_the_hubs_mxfp4_layout_merges_into_a_plain_model(
    tmp_path, mxfp4_model, prepared_data
):
    """The gpt-oss-20b preset starts SFT from the hub checkpoint, whose experts are MXFP4."""
    model_dir, originals = mxfp4_model
    result = _run(tmp_path, model_dir, prepared_data, max_steps=2, dtype="float32")
    saved = json.loads((tmp_path / "model" / "config.json").read_text())
    assert "quantization_config" not in saved and saved["dtype"] == "float32"
    merged = load_file(tmp_path / "model" / "model.safetensors")
    assert not any(name.endswith(("_blocks", "_scales")) for name in merged)
    for name, original in originals.items():  # LoRA on attention only: experts as loaded
        assert torch.equal(merged[name], original.float()), name
    assert result.merge["max_abs_diff_after_reload"] <= result.merge["tolerance"]
