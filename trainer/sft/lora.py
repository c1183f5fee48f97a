"""Wrap a causal LM with a peft LoRA adapter for SFT."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def apply_lora(model, lora) -> torch.nn.Module:
    """Wrap ``model`` with a peft LoRA adapter per ``lora`` (LoraSettings); r=0: unchanged."""
    if lora.r == 0:
        return model
    from peft import LoraConfig, get_peft_model

    from trainer.sft.config import EXPERT_PARAMETERS

    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        target_parameters=list(EXPERT_PARAMETERS) if lora.experts else None,
        modules_to_save=list(lora.modules_to_save) or None,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in peft_model.parameters())
    log.info(
        "LoRA r=%d: %d trainable of %d parameters (%.2f%%)",
        lora.r,
        trainable,
        total,
        100 * trainable / total,
    )
    return peft_model
