"""Training checkpoints → a standard Hugging Face directory (sharded safetensors + tokenizer).

Three sources end here: a HF directory a training step wrote (the pipeline's ``hf`` branch's
GRPO policy, trained with torch or DeepSpeed), re-sharded and checked; a DeepSpeed checkpoint as
``trainer.checkpoint.save_checkpoint`` writes it (``step-<N>/deepspeed/`` holding ZeRO-0..3
shards), consolidated with DeepSpeed's own
``zero_to_fp32``; and a Megatron checkpoint, exported by megatron-bridge
(``trainer.megatron.bridge.export_megatron_to_hf``). Each way the result is written under a
temp name, gets the tokenizer files and chat template of a template HF directory (the model
the run started from), must load with ``AutoModelForCausalLM.from_pretrained`` with no
missing, unexpected or mis-shaped weight, and only then is put in place
(``core.atomic.publish_dir``: an output folder holding files this project did not write is
refused before any work, never wiped).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from core.atomic import check_output_dir, discard_staging, publish_dir, staging_dir
from core.errors import names_write_failures
from trainer.checkpoint import latest_checkpoint

log = logging.getLogger(__name__)

ExportDType = Literal["auto", "float32", "bfloat16", "float16"]
DEEPSPEED_TAG = "deepspeed"
"""The tag ``DeepSpeedBackend.save_checkpoint`` saves under (it writes no ``latest`` file)."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
"""Files copied from the template directory: tokenizer, chat template, generation defaults."""
# Wrappers whose prefix a checkpoint's parameter names may carry: DDP/DeepSpeed engines,
# torch.compile, a peft model without adapters left in it.
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")
_ADAPTER_MARKERS = ("lora_", ".base_layer.", "modules_to_save", "original_module")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(RuntimeError):
    """A checkpoint that cannot become a loadable HF directory; nothing is left at the output."""


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote.

    Attributes:
        output_dir: the HF directory.
        source: the checkpoint exported (the DeepSpeed tag directory or the Megatron dir).
        source_format: ``hf``, ``deepspeed`` or ``megatron``.
        dtype: weights dtype written.
        tensors: weight tensors in the directory.
        parameters: elements over those tensors.
        shards: safetensors files.
        copied_files: files taken from the template (tokenizer, chat template ...).
    """

    output_dir: Path
    source: Path
    source_format: str
    dtype: str
    tensors: int
    parameters: int
    shards: int
    copied_files: tuple[str, ...] = field(default_factory=tuple)


def resolve_deepspeed_checkpoint(path: str | Path, tag: str | None = None) -> tuple[Path, str]:
    """Find the DeepSpeed checkpoint in ``path`` and its tag.

    ``path`` may be a training work dir or its ``checkpoints/`` root (the newest ``step-<N>``
    is taken), one ``step-<N>`` directory, or the tag directory itself (the one holding
    ``*_model_states.pt``). Without ``tag``, a ``latest`` file names it, else the ``deepspeed``
    tag our backend writes, else the only subdirectory holding model states.

    Returns:
        ``(checkpoint_dir, tag)``, so that ``checkpoint_dir / tag`` holds the shards.

    Raises:
        ExportError: no DeepSpeed checkpoint there.
    """
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"{path}: no such checkpoint directory")
    if tag is None and any(path.glob("*_model_states.pt")):
        return path.parent, path.name
    for root in (path / "checkpoints", path):
        newest = latest_checkpoint(root)
        if newest is not None:
            path = newest
            break
    if tag is None:
        latest = path / "latest"
        if latest.is_file():
            tag = latest.read_text().strip()
        elif (path / DEEPSPEED_TAG).is_dir():
            tag = DEEPSPEED_TAG
        else:
            tags = [
                d.name for d in path.iterdir() if d.is_dir() and any(d.glob("*_model_states.pt"))
            ]
            if len(tags) != 1:
                raise ExportError(
                    f"{path}: expected one DeepSpeed checkpoint (a directory with "
                    f"*_model_states.pt, or a 'latest' file), found {sorted(tags) or 'none'}; "
                    "pass the tag"
                )
            tag = tags[0]
    if not any((path / tag).glob("*_model_states.pt")):
        raise ExportError(f"{path / tag}: no *_model_states.pt; not a DeepSpeed checkpoint")
    return path, tag


def consolidate_deepspeed_checkpoint(
    path: str | Path, tag: str | None = None, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The full model weights of a DeepSpeed checkpoint, cast to ``dtype``.

    ZeRO-1/2/3: DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` rebuilds each
    weight from the fp32 master partitions of every rank (lazily, one tensor at a time, so
    only the cast copy is kept). ZeRO-0 keeps the whole module in ``mp_rank_00_model_states.pt``.

    Raises:
        ExportError: no checkpoint there, or DeepSpeed cannot read it.
    """
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError as exc:
        raise ImportError(
            "exporting a DeepSpeed checkpoint needs DeepSpeed: pip install 'lingo-rl[gpu]' "
            "(on CPU: DS_BUILD_OPS=0 pip install deepspeed)"
        ) from exc
    checkpoint_dir, tag = resolve_deepspeed_checkpoint(path, tag)
    shards = checkpoint_dir / tag
    if not any(shards.glob("*_optim_states.pt")):  # ZeRO-0: the module is saved whole
        state = torch.load(
            shards / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False
        )
        return {k: _cast(v, dtype) for k, v in state["module"].items()}
    printed = io.StringIO()  # zero_to_fp32 reports with print(); keep it in the log instead
    try:
        with contextlib.redirect_stdout(printed):
            lazy = get_fp32_state_dict_from_zero_checkpoint(
                str(checkpoint_dir), tag=tag, lazy_mode=True
            )
            state = {name: _cast(tensor.contiguous(), dtype) for name, tensor in lazy.items()}
    except (ValueError, FileNotFoundError, KeyError) as error:
        raise ExportError(f"{shards}: DeepSpeed cannot consolidate it: {error}") from error
    finally:
        for line in printed.getvalue().splitlines():
            log.info("zero_to_fp32: %s", line)
    return state


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def normalize_state_dict_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip wrapper prefixes (``module.``, ``_orig_mod.``, ``base_model.model.``).

    Raises:
        ExportError: the checkpoint holds a LoRA adapter (export the merged model instead).
    """
    adapters = sorted(k for k in state if any(m in k for m in _ADAPTER_MARKERS))
    if adapters:
        raise ExportError(
            f"the checkpoint holds adapter weights ({', '.join(adapters[:3])}, ...): export the "
            "merged model (the SFT step's model output, trainer.sft.merge) rather than an "
            "adapter checkpoint"
        )
    out = {}
    for key, value in state.items():
        name = key
        stripped = True
        while stripped:
            stripped = False
            for prefix in _WRAPPER_PREFIXES:
                if name.startswith(prefix):
                    name, stripped = name[len(prefix) :], True
        if name in out:
            raise ExportError(f"two checkpoint entries map to {name!r} (one is {key!r})")
        out[name] = value
    return out


def _resolve_dtype(dtype: ExportDType, template_dir: Path) -> torch.dtype:
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}: expected auto, {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    config = json.loads((template_dir / "config.json").read_text())
    declared = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return _DTYPES.get(declared.removeprefix("torch."), torch.float32)


def write_hf_model(
    state: Mapping[str, torch.Tensor],
    template_dir: str | Path,
    output_dir: str | Path,
    dtype: torch.dtype,
    max_shard_size: str | int = "5GB",
):
    """Save ``state`` as a HF model of the template's architecture (``save_pretrained``).

    The model is built on the meta device from the template's config and the weights are
    assigned without copies, so peak memory is one copy of the weights. Tied weights
    (``tie_word_embeddings``) may appear once or twice in ``state``; they are tied again.

    Returns:
        The saved model (its weights are the ones written).

    Raises:
        ExportError: names or shapes that do not fit the template's architecture.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from core.mxfp4 import drop_quantization_config

    config = AutoConfig.from_pretrained(template_dir)
    drop_quantization_config(config)  # an MXFP4 template: the weights written are unpacked
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    expected = set(model.state_dict())
    tied: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    state = {k: _cast(v, dtype) for k, v in state.items()}
    unexpected = sorted(set(state) - expected)
    missing = set(expected - set(state))
    for names in tied.values():  # a tied weight is there if any of its names is
        if len(names) > 1 and not missing.isdisjoint(names) and not set(names) <= missing:
            missing -= set(names)
    if unexpected or missing:
        raise ExportError(
            f"the checkpoint does not fit {template_dir}'s architecture "
            f"({config.model_type}): missing {sorted(missing)[:5]}, unexpected {unexpected[:5]}"
        )
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as error:
        raise ExportError(f"the checkpoint does not fit {template_dir}: {error}") from error
    model.tie_weights()
    model.save_pretrained(output_dir, max_shard_size=max_shard_size)
    return model


def copy_template_files(template_dir: str | Path, output_dir: str | Path) -> tuple[str, ...]:
    """Copy the tokenizer, chat template and generation config from ``template_dir``.

    Raises:
        ExportError: the template has no tokenizer (``tokenizer.json`` or
            ``tokenizer_config.json``).
    """
    template_dir, output_dir = Path(template_dir), Path(output_dir)
    copied = []
    for name in TOKENIZER_FILES:
        if (template_dir / name).is_file():
            shutil.copyfile(template_dir / name, output_dir / name)
            copied.append(name)
    if not {"tokenizer.json", "tokenizer_config.json"} & set(copied):
        raise ExportError(
            f"{template_dir}: no tokenizer to copy (looked for {', '.join(TOKENIZER_FILES)})"
        )
    return tuple(copied)


def check_loadable(
    output_dir: str | Path, expected: Mapping[str, torch.Tensor] | None = None
) -> tuple[int, int]:
    """Load ``output_dir`` with ``AutoModelForCausalLM.from_pretrained`` and its tokenizer.

    Args:
        output_dir: the exported directory.
        expected: weights the directory must hold exactly (name → tensor).

    Returns:
        ``(tensors, parameters)`` of the loaded model's state dict.

    Raises:
        ExportError: a missing, unexpected or mis-shaped weight, a weight that differs from
            ``expected``, or a tokenizer without the template's chat template.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(
        output_dir, dtype="auto", attn_implementation="eager", output_loading_info=True
    )
    problems = {k: v for k, v in info.items() if k != "error_msgs" and v}
    if problems or info.get("error_msgs"):
        raise ExportError(f"{output_dir} does not load cleanly: {problems or info['error_msgs']}")
    loaded = model.state_dict()
    if expected is not None:
        wrong = [
            k
            for k, v in expected.items()
            if k not in loaded or loaded[k].dtype != v.dtype or not torch.equal(loaded[k], v)
        ]
        if wrong:
            raise ExportError(f"{output_dir}: weights differ after reload: {wrong[:5]}")
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    if (Path(output_dir) / "chat_template.jinja").is_file() and not tokenizer.chat_template:
        raise ExportError(f"{output_dir}: the tokenizer lost its chat template")
    return len(loaded), sum(v.numel() for v in loaded.values())


def export_deepspeed(
    checkpoint: str | Path,
    template_dir: str | Path,
    output_dir: str | Path,
    dtype: ExportDType = "auto",
    max_shard_size: str | int = "5GB",
    tag: str | None = None,
) -> ExportResult:
    """Export a DeepSpeed checkpoint (ZeRO-0..3) as a HF directory.

    Args:
        checkpoint: a work dir, ``checkpoints/`` root, ``step-<N>`` dir or tag dir (see
            ``resolve_deepspeed_checkpoint``).
        template_dir: the HF directory of the trained model's architecture (the model
            training started from): config, tokenizer and chat template come from it.
        output_dir: where the HF directory goes (an earlier output of ours is replaced; a
            folder holding other files is refused).
        dtype: weights dtype; ``auto`` keeps the template's.
        max_shard_size: largest safetensors file (``"5GB"``, or bytes).
        tag: the DeepSpeed tag, when it cannot be found.

    Returns:
        What was written.

    Raises:
        ExportError: the checkpoint cannot be read, does not fit the template, or the result
            does not load; nothing is left at ``output_dir``.
    """
    template_dir, output_dir = Path(template_dir), Path(output_dir)
    check_output_dir(output_dir)
    checkpoint_dir, tag = resolve_deepspeed_checkpoint(checkpoint, tag)
    torch_dtype = _resolve_dtype(dtype, template_dir)
    state = normalize_state_dict_keys(
        consolidate_deepspeed_checkpoint(checkpoint_dir, tag, torch_dtype)
    )
    return _write_export(
        state, checkpoint_dir / tag, "deepspeed", template_dir, output_dir, torch_dtype,
        max_shard_size,
    )  # fmt: skip


def export_hf_directory(
    hf_dir: str | Path,
    template_dir: str | Path,
    output_dir: str | Path,
    dtype: ExportDType = "auto",
    max_shard_size: str | int = "5GB",
) -> ExportResult:
    """Export a HF directory a training step wrote (the ``hf`` branch's GRPO policy, under
    ZeRO-3 its weights gathered on rank 0) in the same standard form as the other two sources:
    re-sharded safetensors in ``dtype``, the template's tokenizer, chat template and
    generation config, checked to load with exactly these weights.

    Raises:
        ExportError: no safetensors weights in ``hf_dir``, weights that do not fit the
            template, or a result that does not load; nothing is left at ``output_dir``.
    """
    from safetensors.torch import load_file

    hf_dir, template_dir, output_dir = Path(hf_dir), Path(template_dir), Path(output_dir)
    check_output_dir(output_dir)
    shards = sorted(hf_dir.glob("*.safetensors")) if hf_dir.is_dir() else []
    if not shards:
        raise ExportError(f"{hf_dir}: no *.safetensors weights; not a HF model directory")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(shard))
    torch_dtype = _resolve_dtype(dtype, template_dir)
    return _write_export(
        normalize_state_dict_keys(state), hf_dir, "hf", template_dir, output_dir, torch_dtype,
        max_shard_size,
    )  # fmt: skip


@names_write_failures("output_dir")
def _write_export(
    state: dict[str, torch.Tensor],
    source: Path,
    source_format: str,
    template_dir: Path,
    output_dir: Path,
    torch_dtype: torch.dtype,
    max_shard_size: str | int,
) -> ExportResult:
    """Write ``state`` as the template's architecture under a temp name, add the template's
    files, check that it loads with exactly these weights, then rename it into place."""
    tmp = staging_dir(output_dir)
    try:
        model = write_hf_model(state, template_dir, tmp, torch_dtype, max_shard_size)
        state.clear()
        copied = copy_template_files(template_dir, tmp)
        written = {k: v for k, v in model.state_dict().items() if v.device.type != "meta"}
        tensors, parameters = check_loadable(tmp, written)
    except BaseException:
        discard_staging(tmp)
        raise
    dtype = str(torch_dtype).removeprefix("torch.")
    return _publish_export(
        tmp, output_dir, source, source_format, dtype, tensors, parameters, copied
    )


def _publish_export(
    tmp: Path,
    output_dir: Path,
    source: Path,
    source_format: str,
    dtype: str,
    tensors: int,
    parameters: int,
    copied: tuple[str, ...],
) -> ExportResult:
    """Rename a checked export from its temp name into place, and say what it holds."""
    shards = len(list(tmp.glob("*.safetensors")))
    publish_dir(tmp, output_dir)
    log.info("exported %s (%s) → %s (%d shards)", source, source_format, output_dir, shards)
    return ExportResult(
        output_dir=output_dir,
        source=source,
        source_format=source_format,
        dtype=dtype,
        tensors=tensors,
        parameters=parameters,
        shards=shards,
        copied_files=copied,
    )


def export_megatron(
    megatron_dir: str | Path, template_dir: str | Path, output_dir: str | Path
) -> ExportResult:
    """Export a Megatron checkpoint as a HF directory with megatron-bridge.

    The bridge writes config and sharded safetensors in the template's architecture; the
    tokenizer and chat template are then copied from ``template_dir`` and the result must load.

    Raises:
        ExportError: the result does not load; nothing is left at ``output_dir``.
    """
    megatron_dir, template_dir, output_dir = (
        Path(megatron_dir),
        Path(template_dir),
        Path(output_dir),
    )
    if not megatron_dir.is_dir():
        raise ExportError(f"{megatron_dir}: no such Megatron checkpoint directory")
    check_output_dir(output_dir)
    bridge = importlib.import_module("trainer.megatron.bridge")  # megatron-core: GPU image
    tmp = staging_dir(output_dir)
    try:
        bridge.export_megatron_to_hf(str(megatron_dir), str(template_dir), str(tmp))
        copied = copy_template_files(template_dir, tmp)
        tensors, parameters = check_loadable(tmp)
        config = json.loads((tmp / "config.json").read_text())
    except BaseException:
        discard_staging(tmp)
        raise
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "unknown")
    return _publish_export(
        tmp, output_dir, megatron_dir, "megatron", dtype, tensors, parameters, copied
    )


EXPORTERS = {
    "hf": export_hf_directory,
    "deepspeed": export_deepspeed,
    # megatron-bridge picks the dtype and the shard size
    "megatron": lambda checkpoint, template, output, **_: export_megatron(
        checkpoint, template, output
    ),
}
"""The exporter of each checkpoint format a training step writes: ``hf`` (a HF directory: the
``hf`` branch's GRPO policy), ``deepspeed`` (a GRPO work dir, ``checkpoints/`` root or
``step-<N>`` dir) or ``megatron`` (a Megatron checkpoint: megatron-bridge's ``dtype`` and
shard size)."""


def export_checkpoint(
    source_format: str,
    checkpoint: str | Path,
    template_dir: str | Path,
    output_dir: str | Path,
    **options: Any,
) -> ExportResult:
    """Export a checkpoint of ``source_format`` (``EXPORTERS``) as a standard HF directory;
    ``options``: the exporter's ``dtype`` and ``max_shard_size``.

    Raises:
        ValueError: ``source_format`` is not one of ``EXPORTERS`` (the message names them).
    """
    try:
        exporter = EXPORTERS[source_format]
    except KeyError:
        expected = ", ".join(repr(name) for name in EXPORTERS)
        raise ValueError(f"source_format={source_format!r}: expected one of {expected}") from None
    return exporter(checkpoint, template_dir, output_dir, **options)
