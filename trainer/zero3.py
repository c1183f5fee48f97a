"""ZeRO-3 without a full copy of the model on any rank.

- ``load_partitioned``: a Hugging Face causal LM built partitioned (transformers'
  ``HfDeepSpeedConfig`` makes ``from_config`` run under ``deepspeed.zero.Init``), then filled
  from its safetensors one tensor at a time: rank 0 reads a tensor from the file (plain reads,
  no memory map, so no page of the file stays resident), the ranks gather that one parameter,
  rank 0 copies it in, and DeepSpeed re-partitions it. MXFP4 experts (the hub's gpt-oss) are
  dequantized one matrix at a time as they are read (``model_entries``). SFT and GRPO both
  load this way under ZeRO-3.
- ``gathered_parameters``: the weights under their names, one gathered parameter at a time
  (for a rollout engine that keeps its own copy).
- ``save_gathered``: a Hugging Face directory written by rank 0 one gathered tensor at a time
  (the safetensors header is computed from the partitioned shapes first).
- ``share_fp32_master``: for a model trained in fp32, DeepSpeed's fp32 master partitions made
  the module's own partitions instead of a second copy of them.
- ``gather_windows``: ZeRO-3's bucket and live-parameter sizes bounded by the model's largest
  tensor, so a model smaller than DeepSpeed's absolute defaults is not kept gathered whole.

Every function here is collective: all ranks call it, in the same order.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from core import mxfp4
from core.attention import HF_ATTN_IMPLEMENTATION
from core.modeling import ModelLoadError, check_model_dir

log = logging.getLogger(__name__)

SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}

DEEPSPEED_WINDOW_DEFAULTS = {
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
    "sub_group_size": 1_000_000_000,
}
"""DeepSpeed's defaults (elements) for the ZeRO-3 settings ``gather_windows`` bounds."""


class SafetensorsEntry:
    """Where one tensor lies in a safetensors file."""

    def __init__(self, file: Path, data_start: int, header: dict) -> None:
        self.file = file
        self.dtype = SAFETENSORS_DTYPES[header["dtype"]]
        self.shape = tuple(header["shape"])
        self.begin, self.end = (data_start + o for o in header["data_offsets"])

    def read(self) -> torch.Tensor:
        """The tensor, read from the file into memory of its own."""
        buffer = bytearray(self.end - self.begin)
        with self.file.open("rb") as fh:
            fh.seek(self.begin)
            fh.readinto(buffer)
        if not buffer:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(buffer, dtype=self.dtype).reshape(self.shape)


def safetensors_entries(model_dir: str | Path) -> dict[str, SafetensorsEntry]:
    """Every tensor of a HF directory's ``*.safetensors`` files, by name (headers only)."""
    entries: dict[str, SafetensorsEntry] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors files to load")
    for file in files:
        with file.open("rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        header.pop("__metadata__", None)
        for name, entry in header.items():
            entries[name] = SafetensorsEntry(file, 8 + length, entry)
    return entries


class DequantizedEntry:
    """An MXFP4 expert matrix stored as ``<name>_blocks`` / ``<name>_scales``: read both,
    dequantized to ``dtype`` (``core.mxfp4.dequantize``)."""

    def __init__(self, blocks: SafetensorsEntry, scales: SafetensorsEntry, dtype: torch.dtype):
        self.blocks, self.scales, self.dtype = blocks, scales, dtype
        self.shape = mxfp4.dequantized_shape(blocks.shape)

    def read(self) -> torch.Tensor:
        return mxfp4.dequantize(self.blocks.read(), self.scales.read(), self.dtype)


def model_entries(
    model_dir: str | Path, dtype: torch.dtype = torch.bfloat16
) -> dict[str, SafetensorsEntry | DequantizedEntry]:
    """The model's weights by their Hugging Face names (headers only): the safetensors
    entries, each MXFP4 pair replaced by the matrix it packs, dequantized to ``dtype`` when
    read (``model_dir``'s ``config.json`` must say MXFP4 for pairs to be unpacked)."""
    entries: dict = safetensors_entries(model_dir)
    if not mxfp4.is_mxfp4(model_dir):
        return entries
    blocks_suffix, scales_suffix = mxfp4.PACKED_SUFFIXES
    for name in [n.removesuffix(blocks_suffix) for n in entries if n.endswith(blocks_suffix)]:
        scales = entries.pop(f"{name}{scales_suffix}", None)
        if scales is None:
            raise ModelLoadError(f"{model_dir}: {name}{blocks_suffix} has no {scales_suffix}")
        entries[name] = DequantizedEntry(entries.pop(f"{name}{blocks_suffix}"), scales, dtype)
    return entries


def gather_windows(model_dir: str | Path, world_size: int = 1) -> dict[str, int]:
    """ZeRO-3 settings for ``model_dir`` on ``world_size`` ranks: each of DeepSpeed's absolute
    window sizes, bounded by the model's largest tensor (in elements).

    DeepSpeed keeps parameters gathered while they fit ``stage3_max_live_parameters`` and are
    reused within ``stage3_max_reuse_distance`` (10⁹ elements each): a model under a billion
    parameters stays gathered whole through a decode loop. Bounded by the largest tensor (which
    must be gathered anyway), at most about one tensor is live beyond the one in use.

    ``sub_group_size`` counts *partition* elements: the optimizer steps over sub-groups of
    parameter partitions, closed once they reach it, with a flat gradient copy and Adam's
    temporaries of a sub-group's size. Bounded by the largest tensor's partition
    (``ceil(largest / world_size)``), a sub-group is about one large partition, not several.
    """
    largest = max(math.prod(e.shape) for e in model_entries(model_dir).values())
    windows = {key: min(default, largest) for key, default in DEEPSPEED_WINDOW_DEFAULTS.items()}
    windows["sub_group_size"] = min(windows["sub_group_size"], math.ceil(largest / world_size))
    return windows


def share_fp32_master(optimizer) -> int:
    """Make each fp32 master partition of a ZeRO-3 optimizer the module's own partition when the
    two have the same dtype and device (a model trained in fp32, optimizer not offloaded);
    returns how many sub-groups now share their memory.

    DeepSpeed 0.19 means to share them (``_create_fp32_partitions`` in
    ``deepspeed/runtime/zero/stage3.py``: "In such cases we don't need another copy of the
    weights"), but its test compares a ``torch.device`` with the accelerator's device *name*
    (``tensor.device == self.device``, ``'cpu'`` or ``'cuda:0'``), which is never equal, so it
    clones: one more partition of the model per rank. Shared, the optimizer updates the
    module's partition in place and DeepSpeed's copy back after the step copies it onto itself.
    """
    if getattr(optimizer, "offload_optimizer", True) or getattr(optimizer, "swap_optimizer", True):
        return 0
    shared = 0
    pairs = zip(
        optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat, strict=True
    )
    for module_flat, master in pairs:
        if module_flat is None or master.data_ptr() == module_flat.data_ptr():
            continue
        if (module_flat.dtype, module_flat.device) != (master.dtype, master.device):
            continue
        master.data = module_flat.data  # the clone is freed: nothing else refers to it
        shared += 1
    return shared


def mark_expert_leaves(module: torch.nn.Module) -> int:
    """Flag each GPT-OSS experts module (``GptOssExperts``) as a ZeRO-3 leaf: its parameters,
    and those of anything inside it, are gathered together when it runs. Returns how many.

    peft's LoRA on the experts' 3-D weights (``target_parameters``) moves them, for the length
    of each forward, into a parametrization registered inside the experts module (peft
    ``ParamWrapper._activate_lora``: ``register_parametrization``, then
    ``_remove_parametrizations``). The experts module's own parameters then differ between
    the forward (its biases only) and the trace DeepSpeed builds from it after the step (every
    weight), and from the next forward on DeepSpeed 0.19's prefetch fails ("tracing error ...
    expected the next 2 parameters in the parameter fetch queue", ``fetch_sub_module`` in
    ``runtime/zero/partitioned_param_coordinator.py``) wherever an expert weight is larger
    than ``stage3_param_persistence_threshold``. A leaf's parameters are gathered
    recursively (``iter_params(..., recurse=z3_leaf_module(...))``): the same set, moved or
    not. Only where peft wraps the experts (its ``ParamWrapper``): GRPO's full-parameter
    models are left as they are.
    """
    from deepspeed.utils import set_z3_leaf_modules

    if not any(type(m).__name__ == "ParamWrapper" for m in module.modules()):
        return 0
    classes = {type(m) for m in module.modules() if type(m).__name__ == "GptOssExperts"}
    return len(set_z3_leaf_modules(module, sorted(classes, key=str))) if classes else 0


def init_deepspeed_comm(device: torch.device) -> None:
    """DeepSpeed's communication on the process group torchrun set up (gloo on CPU)."""
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError(
            "backend 'deepspeed' needs DeepSpeed: pip install 'lingo-rl[gpu]' "
            "(on CPU: DS_BUILD_OPS=0 pip install deepspeed)"
        ) from exc
    if device.type != "cuda":
        skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")


SHM_COMM_OP = "deepspeed_shm_comm"


def skip_shm_comm_op() -> None:
    """Tell DeepSpeed not to build its CPU shared-memory all-reduce (``deepspeed_shm_comm``).

    DeepSpeed's ``TorchBackend`` JIT-compiles that op when its communication starts on CPU,
    the first process under torch's file lock in ``TORCH_EXTENSIONS_DIR``; a rank killed
    while compiling leaves the lock behind and every later DeepSpeed process on the machine
    waits on it forever (seen: a killed-run test, then each DeepSpeed test after it hung).
    Training on gloo never uses the op (it serves DeepSpeed's inference all-reduce), so the
    op is marked incompatible, which ``deepspeed.comm.torch.build_shm_op`` reads.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def load_partitioned(
    path: str | Path, dtype: torch.dtype, ds_config: dict, device: torch.device
) -> torch.nn.Module:
    """The causal LM in ``path`` built partitioned over the ranks (ZeRO-3) and loaded.

    ``ds_config`` must be the configuration later given to ``deepspeed.initialize``. No rank
    holds more than one gathered tensor (plus DeepSpeed's own windows) at any time.

    Raises:
        ModelLoadError: the files lack a weight of the model, or hold one of another shape.
    """
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    init_deepspeed_comm(device)
    path = check_model_dir(path)
    config = AutoConfig.from_pretrained(path)
    if mxfp4.is_mxfp4(path):
        mxfp4.log_dequantization(path, dtype, "the partitioned loader (one matrix at a time)")
        mxfp4.drop_quantization_config(config)  # the model is built unpacked
    # the kernel the planner counts (core.attention), on every device
    kwargs = {"dtype": dtype, "attn_implementation": HF_ATTN_IMPLEMENTATION}
    # transformers builds under zero.Init while this object lives; dropped right after, so a
    # later rank-0-only load (an export) is a plain one. The build's random initialization
    # (overwritten below) draws from a forked generator: like from_pretrained, the load leaves
    # the caller's random stream as it was, so what comes next (LoRA's initialization) draws
    # the same numbers whichever way the model was loaded.
    hf_ds_config = HfDeepSpeedConfig(ds_config)
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    finally:
        unset_hf_deepspeed_config()
        del hf_ds_config
    entries = model_entries(path, dtype)
    problems = []
    for name, param in model.named_parameters():
        shape = tuple(getattr(param, "ds_shape", param.shape))
        if name not in entries:
            problems.append(f"{name} is missing")
        elif entries[name].shape != shape:
            problems.append(
                f"{name} has shape {list(entries[name].shape)}, the model {list(shape)}"
            )
    if problems:  # every rank read the same headers: all raise, none waits in a collective
        raise ModelLoadError(f"{path}: the weights do not fit the model: {'; '.join(problems[:5])}")
    first = dist.get_rank() == 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if first:
                    param.data.copy_(entries[name].read())
        for name, buffer in model.named_buffers():
            if name in entries:  # buffers are whole on every rank: rank 0's value to all
                value = entries[name].read() if first else torch.empty_like(buffer, device="cpu")
                value = value.to(buffer.device, buffer.dtype)
                dist.broadcast(value, src=0)
                buffer.copy_(value)
    return model


def gathered_parameters(
    module: torch.nn.Module, trainable_only: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for each parameter (``trainable_only``: each one that requires a
    gradient, a LoRA adapter's), gathered whole, one at a time.

    The tensor is valid only until the next item is requested: the parameter is released
    (re-partitioned) then, so the consumer copies it before moving on. Collective: every rank
    iterates to the end.
    """
    import deepspeed

    for name, param in module.named_parameters():
        if trainable_only and not param.requires_grad:
            continue
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            yield name, param.detach()


def save_gathered(
    module: torch.nn.Module, directory: str | Path, config, dtype: torch.dtype, writer: bool
) -> None:
    """Write ``module`` (partitioned or not) as a HF directory: ``config`` (its ``dtype`` set)
    and one ``model.safetensors`` streamed one gathered tensor at a time; ``writer``: this rank
    writes (rank 0). Collective."""
    directory = Path(directory)
    params = dict(module.named_parameters())
    buffers = {
        n: b for n, b in module.named_buffers() if n in set(module.state_dict()) and n not in params
    }
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in [*params.items(), *buffers.items()]:
        shape = list(getattr(tensor, "ds_shape", tensor.shape))
        size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": _DTYPE_NAMES[dtype],
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    fh = None
    if writer:
        directory.mkdir(parents=True, exist_ok=True)
        fh = (directory / "model.safetensors").open("wb")
        fh.write(struct.pack("<Q", len(encoded)) + encoded)
    try:
        # in the header's order: the parameters (gathered one at a time), then the buffers
        for _, tensor in itertools.chain(gathered_parameters(module), buffers.items()):
            if fh is not None:
                fh.write(_bytes(tensor, dtype))
    finally:
        if fh is not None:
            fh.close()
    if writer:
        config.dtype = dtype
        mxfp4.drop_quantization_config(config)  # the weights written are never packed
        config.save_pretrained(directory)
        generation = getattr(module, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(directory)


def _bytes(tensor: torch.Tensor, dtype: torch.dtype) -> memoryview:
    flat = tensor.detach().to("cpu", dtype).contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())
