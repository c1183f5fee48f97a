"""Test-only patches that let megatron-bridge 0.6.2 / megatron-core 0.19.2 run on a CPU.

Nothing in ``trainer/`` imports this: production runs on GPUs, unpatched, and the same round
trip runs there unpatched under ``@pytest.mark.gpu``. Each patch below names the call it
replaces, where megatron makes it, and why replacing it cannot change a number the tests
compare. They are applied only where CUDA is absent, and undone on exit (except the import
shim, which only matters while ``megatron.bridge`` is first imported).

The path they unblock (HF → Megatron → ``torch_dist`` save → load → logits → HF export) was
traced with a recorder on every patched call; the call sites it hits are listed per patch.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator

LORA_LAYERS = "megatron.bridge.peft.lora_layers"
TE_IMPORT_LINE = "import transformer_engine.pytorch as te\n"


# --- Patch 1: lora_layers_without_transformer_engine --------------------------------------
# Call: megatron/bridge/peft/lora_layers.py:20 `import transformer_engine.pytorch as te`, at
# module level. `import megatron.bridge` reaches it through models/conversion/model_bridge.py
# → peft_bridge.py → peft/canonical_lora.py, so without Transformer Engine (a CUDA-only
# package built from source) megatron.bridge cannot even be imported.
# Patch: that one module is compiled with `te` bound to a stand-in namespace instead. `te` is
# used only inside `TEFusedLoRALinear` (LoRA on TE layers), which conversion never builds.
# Installing a fake `transformer_engine` package instead would be wrong: megatron-core would
# then believe TE is present (its HAVE_TE checks import it) and build TE modules.
class _TEStandIn(types.SimpleNamespace):
    """Answers the attribute lookups lora_layers.py makes at class-definition time."""


def _te_stand_in() -> _TEStandIn:
    def placeholder(name: str) -> type:
        return type(name, (), {"__doc__": "Transformer Engine is not installed (CPU test)."})

    ops = types.SimpleNamespace(Sequential=placeholder("Sequential"))
    return _TEStandIn(
        ops=ops, Linear=placeholder("Linear"), LayerNormLinear=placeholder("LayerNormLinear")
    )


class _LoraLayersLoader(importlib.machinery.SourceFileLoader):
    def get_code(self, fullname: str) -> types.CodeType:
        path = self.get_filename(fullname)
        source = self.get_data(path).decode("utf-8")
        if TE_IMPORT_LINE not in source:
            raise ImportError(
                f"{path}: the line {TE_IMPORT_LINE.strip()!r} is gone; "
                "check whether patch lora_layers_without_transformer_engine is still needed"
            )
        source = source.replace(TE_IMPORT_LINE, "te = __lingo_te_stand_in__\n")
        return compile(source, path, "exec", dont_inherit=True)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__dict__["__lingo_te_stand_in__"] = _te_stand_in()
        super().exec_module(module)


class _LoraLayersFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != LORA_LAYERS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.origin is None:
            return None
        spec.loader = _LoraLayersLoader(fullname, spec.origin)
        return spec


def transformer_engine_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def install_lora_layers_import_shim() -> None:
    """Patch 1, before ``megatron.bridge`` is first imported (no-op where TE is installed)."""
    if transformer_engine_installed() or LORA_LAYERS in sys.modules:
        return
    if not any(isinstance(f, _LoraLayersFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _LoraLayersFinder())


def import_megatron_bridge() -> types.ModuleType:
    """``megatron.bridge``, imported with patch 1 where Transformer Engine is missing."""
    install_lora_layers_import_shim()
    import megatron.bridge

    return megatron.bridge


# --- Patches 2-6, applied for the duration of a test -------------------------------------
class _NoCudaStream:
    """Stands in for the all-to-all dispatcher's CUDA side stream (patch 6)."""

    def __getattr__(self, name):
        raise RuntimeError(f"no CUDA stream on this CPU test machine (stream.{name})")


@contextlib.contextmanager
def cpu_patches() -> Iterator[None]:
    """Apply patches 2-6 (CUDA is absent), undo them on exit."""
    import torch

    if torch.cuda.is_available():
        raise RuntimeError("cpu_patches() is for machines without CUDA; run the gpu test there")
    import megatron.core.fusions.fused_softmax as fused_softmax
    from megatron.core.tensor_parallel import random as megatron_random
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    # Patch 2: current_device_is_cpu.
    # Call: `torch.cuda.current_device()` used as the device to allocate on or move to.
    # Hit at: models/common/embeddings/yarn_rotary_pos_embedding.py:122,126 (inv_freq moved
    # to the GPU at the first forward); transformer/dot_product_attention.py:132 (the
    # learnable softmax offset = attention sinks); transformer/moe/router.py:98,100 (router
    # weight and bias); utils.py:715 (GlobalMemoryBuffer); dist_checkpointing/strategies/
    # state_dict_saver.py:252 (the save-failure flag broadcast over gloo).
    # Why safe: without CUDA the real call can only raise. Answering "cpu" puts each tensor
    # where the model already is (built with use_cpu_initialization); values are untouched.
    # Calls that need a real GPU (streams, device properties) still raise as before.
    patch(torch.cuda, "current_device", lambda: torch.device("cpu"))

    # Patch 3: synchronize_is_noop.
    # Call: dist_checkpointing/strategies/filesystem_async.py:248 `torch.cuda.synchronize()`
    # after the device→host copies of `preload_tensors`, on every torch_dist save.
    # Why safe: it waits for queued CUDA work; there is none, the copies ran synchronously.
    patch(torch.cuda, "synchronize", lambda device=None: None)

    # Patch 4: attention_masks_on_cpu.
    # Call: transformer/utils.py:40 `get_default_causal_mask` and :44
    # `get_sliding_window_causal_mask` allocate with `device="cuda"`; fused_softmax.py:322,327
    # calls them in the unfused (torch) softmax path the local layer spec uses.
    # Why safe: the same boolean masks, built by the same triu/tril calls, on the CPU.
    def sliding_window_causal_mask(sq, skv, window_size):
        ones = torch.ones(sq, skv, dtype=torch.bool)
        upper = torch.triu(ones, diagonal=skv - sq - window_size[0])
        return ~torch.tril(upper, diagonal=skv - sq + window_size[1])

    def default_causal_mask(sq):
        return torch.triu(torch.ones(sq, sq), diagonal=1).bool()

    patch(fused_softmax, "get_sliding_window_causal_mask", sliding_window_causal_mask)
    patch(fused_softmax, "get_default_causal_mask", default_causal_mask)

    # Patch 5: rng_tracker_fork_is_noop.
    # Call: transformer/dot_product_attention.py:217
    # `with tensor_parallel.get_cuda_rng_tracker().fork():` around attention dropout; the
    # tracker's states are CUDA generator states, added by model_parallel_cuda_manual_seed,
    # which needs CUDA (megatron.core.tensor_parallel.random:316 raises "cuda rng state
    # model-parallel-rng is not added").
    # Why safe: the fork only swaps which CUDA generator dropout draws from. GPT-OSS has
    # attention_dropout 0.0 and the tests run in eval mode, so nothing is drawn.
    @contextlib.contextmanager
    def fork(self, name=None):
        yield

    patch(megatron_random.CudaRNGStatesTracker, "fork", fork)

    # Patch 6: alltoall_dispatcher_stream_placeholder (only matters for EP > 1).
    # Call: transformer/moe/token_dispatcher.py:469 `torch.cuda.Stream()` in
    # MoEAlltoAllTokenDispatcher.__init__ (the bridge's dispatcher for EP > 1), stored once
    # in the class attribute `cuda_dtoh_stream` for the device→host copies of its forward.
    # Why safe: conversion builds the dispatcher but never runs it; with the attribute set
    # to a placeholder the constructor skips creating the stream, and a forward that did
    # need it would fail loudly on the placeholder instead of computing anything.
    patch(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _NoCudaStream())
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
