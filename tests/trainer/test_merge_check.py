"""The LoRA merge check against the model's own noise (trainer/sft/merge.py): a bf16 merge of
a model whose logits are as large as a real one's passes, a merge with the wrong scale does
not, in bf16 and in fp32."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainer.sft.merge import MergeCheckError, merge_and_save

PROMPTS = [list(range(5, 60)), list(range(100, 180))]


def _adapted(model_dir, dtype: torch.dtype, logit_scale: float = 30.0):
    """The tiny model with a LoRA adapter whose B is not zero (a trained adapter moves the
    logits), its LM head scaled so its logits reach a real model's (|logit| up to ~20: bf16
    steps of 0.125 there)."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager"
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    peft_model = get_peft_model(model, lora)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return peft_model


def _merging_with_scale(peft_model, factor: float):
    """Make ``merge_and_unload`` merge the adapter with ``factor`` × its scale (a wrong
    merge: the reference, base + adapter, is taken before)."""
    merge = peft_model.merge_and_unload

    def wrong():
        for module in peft_model.modules():
            if isinstance(getattr(module, "scaling", None), dict):
                for key in module.scaling:
                    module.scaling[key] *= factor
        return merge()

    peft_model.merge_and_unload = wrong
    return peft_model


def test_a_bf16_merge_is_held_to_the_models_own_noise(tmp_path, tiny_model_dir):
    """Some logit of a correct bf16 merge differs from base + adapter by a bf16 step (the
    fixed 0.05 bound on the max discarded such merges); the mean and the 99th percentile stay
    within the model's own bf16-vs-fp32 noise."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = _adapted(tiny_model_dir, torch.bfloat16)
    report = merge_and_save(model, tokenizer, PROMPTS, tmp_path / "merged")
    assert report["dtype"] == "bfloat16" and report["merged_adapter"] is True
    assert max(report["max_abs_diff_in_memory"], report["max_abs_diff_after_reload"]) > 0.05
    floor = report["noise_floor"]
    assert 0 < floor["mean"] < floor["p99"] <= floor["max"]
    assert report["p99_abs_diff_in_memory"] <= 3 * floor["p99"] + 1e-3
    saved = json.loads((tmp_path / "merged" / "merge_report.json").read_text())
    assert saved["noise_floor"] == floor
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.dtype == torch.bfloat16
    assert not [n for n, _ in merged.named_parameters() if "lora" in n]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("factor", [2.0, 0.0], ids=["doubled", "dropped"])
def test_a_merge_with_the_wrong_scale_is_refused(tmp_path, tiny_model_dir, dtype, factor):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = _merging_with_scale(_adapted(tiny_model_dir, dtype), factor)
    with pytest.raises(MergeCheckError, match="differs from base \\+ adapter"):
        merge_and_save(model, tokenizer, PROMPTS, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    assert not list(tmp_path.glob(".merged*"))  # no half-written directory left
