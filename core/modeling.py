"""Load causal LMs and tokenizers from HF directories and choose dtypes: what eval's engines,
SFT and GRPO share."""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)


class NotACausalLMError(ValueError):
    """A model directory that does not hold a causal language model."""


def cache_keyword(model) -> str:
    """The forward keyword that takes a KV cache: ``cache`` in recent transformers,
    ``past_key_values`` before (megatron-bridge 0.6 pins transformers ≤ 5.12.1)."""
    forward = getattr(model, "module", model).forward  # a DeepSpeed engine wraps the model
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def output_cache(output):
    """The KV cache a forward with ``use_cache=True`` returned, under either name."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


class ModelLoadError(RuntimeError):
    """A model directory whose weights cannot be loaded (corrupt or truncated files)."""


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` → bf16 on a GPU that supports it, else fp32."""
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def check_model_dir(path: str | Path) -> Path:
    """A local HF model directory with a causal-LM config, or a clear error."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.exists():
        raise NotACausalLMError(f"{path}: no config.json; expected a Hugging Face model directory")
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = AutoConfig.from_pretrained(path)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        architectures = json.loads(config_file.read_text()).get("architectures")
        raise NotACausalLMError(
            f"{path}: model_type {config.model_type!r} ({architectures}) is not a causal "
            "language model; SFT and GRPO need one (e.g. gpt_oss)"
        )
    return path


def load_tokenizer(path: str | Path):
    """The tokenizer saved with a model; it must know the harmony special tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    missing = [
        t
        for t in ("<|start|>", "<|message|>", "<|channel|>", "<|return|>")
        if t not in tokenizer.get_vocab()
    ]
    if missing:
        raise ValueError(f"{path}: tokenizer lacks the harmony special tokens {missing}")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_generation_config(path: str | Path):
    """The ``GenerationConfig`` a model loaded from ``path`` gets: the one saved with it, else
    (as transformers does when loading the model) one made from its ``config.json``; None
    when the directory has neither."""
    from transformers import AutoConfig, GenerationConfig

    if (Path(path) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(path)
    if (Path(path) / "config.json").is_file():
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path))
    return None


def load_causal_lm(path: str | Path, dtype: torch.dtype, device: torch.device | None = None):
    """``AutoModelForCausalLM.from_pretrained`` with the attention kernel the trainer runs on
    every device (``core.attention.HF_ATTN_IMPLEMENTATION``: eager, the one that trains
    GPT-OSS's sinks); MXFP4 experts (the hub's gpt-oss) dequantized to ``dtype``
    (``core.mxfp4``)."""
    from transformers import AutoModelForCausalLM

    from core.attention import HF_ATTN_IMPLEMENTATION
    from core.mxfp4 import from_pretrained_kwargs

    path = check_model_dir(path)
    kwargs = {
        "dtype": dtype,
        "attn_implementation": HF_ATTN_IMPLEMENTATION,
        **from_pretrained_kwargs(path, dtype),
    }
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except Exception as exc:  # e.g. SafetensorError "HeaderTooSmall": the file is not named
        weights = sorted(p.name for p in path.glob("*.safetensors")) or ["no *.safetensors"]
        raise ModelLoadError(
            f"{path}: cannot load the model's weights ({', '.join(weights)}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if device is not None:
        model.to(device)
    return model
