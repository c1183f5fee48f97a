"""Wrap a causal LM with a peft LoRA adapter for SFT."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

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


@contextlib.contextmanager
def lora_parameters_fixed(model: torch.nn.Module) -> Iterator[None]:
    """While the adapter does not change (sampling), each LoRA-wrapped parameter (peft's
    ``ParamWrapper``: ``lora.experts``, the experts' stacked weights) is its base plus the
    adapter's delta built once, not at every forward.

    peft's ``ParamWrapper.forward`` registers a parametrization, builds the whole expert
    stack's delta and removes it again on every call: one per layer per decoded token. Here
    each wrapper's ``_activate_lora`` is entered once for the block, under
    ``torch.nn.utils.parametrize.cached()`` (which it enters itself), so the first access of
    the weight computes base + delta and the later forwards reuse it: the same operations on
    the same values, done once. Its own per-forward activation is a no-op meanwhile; on exit
    the parametrizations go as peft removes them. A model without such wrappers (no LoRA,
    attention-only LoRA) is left as it is. Not for parameters ZeRO-3 partitions (the cached
    sum would hold a gathered copy): ``HFRolloutEngine`` uses it only outside lockstep.
    """
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:  # no peft: no wrappers
        yield
        return
    wrappers = [
        module
        for module in model.modules()
        if isinstance(module, ParamWrapper) and not module.disable_adapters and not module.merged
    ]
    with contextlib.ExitStack() as stack:
        for wrapper in wrappers:
            stack.enter_context(wrapper._activate_lora(wrapper.active_adapters))
            wrapper._activate_lora = _already_active  # the instance's, over the class's
            stack.callback(delattr, wrapper, "_activate_lora")
        yield


def _already_active(active_adapters: list[str]) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()
