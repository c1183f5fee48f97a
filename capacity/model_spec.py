"""A model's shape read from its HF ``config.json``, and its parameters counted per tensor.

The count follows the tensors ``transformers``' ``GptOssForCausalLM`` creates, so it equals
``sum(p.numel() for p in model.parameters())`` exactly (a test checks this on small configs):

- ``embed_tokens``: ``V·H``; ``lm_head``: ``V·H`` (untied) or 0 (tied);
- per layer, attention: ``q_proj`` ``H·nh·d (+nh·d)``, ``k_proj``/``v_proj`` ``H·kv·d (+kv·d)``,
  ``o_proj`` ``nh·d·H (+H)`` (biases when ``attention_bias``), ``sinks`` ``nh``;
- per layer, router: ``E·H + E``; experts: ``E·(H·2I + 2I + I·H + H)`` (``gate_up_proj``,
  its bias, ``down_proj``, its bias);
- norms: two RMSNorm weights ``H`` per layer and the final norm ``H``.

*Active* parameters follow the gpt-oss model card: the embedding table is a lookup, not
compute, so it is left out; of the experts only ``top-k / E`` count.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from capacity.model_presets import MODEL_PRESETS
from plan.specs import whole

SUPPORTED_MODEL_TYPES = ("gpt_oss",)


class ModelSpecError(ValueError):
    """A model reference or config that the planner cannot read."""


LARGEST_DIMENSION = 1 << 24
"""No architecture field of a real model comes near this (gpt-oss-120b: vocabulary 201,088,
hidden size 2,880); beyond it a config's value is a mistake and the memory arithmetic would
overflow."""


def _whole_number(name: str, field: str, value: Any) -> int:
    """``value`` as a whole number from 1 to ``LARGEST_DIMENSION``, or ``ModelSpecError``."""
    try:
        number = whole(value, field)
    except ValueError:
        raise ModelSpecError(f"{name}: {field} must be a whole number, got {value!r}") from None
    if not 1 <= number <= LARGEST_DIMENSION:
        raise ModelSpecError(
            f"{name}: {field} must be between 1 and {LARGEST_DIMENSION:,}, got {value!r}"
        )
    return number


@dataclass(frozen=True)
class ModelSpec:
    """The architecture fields that decide memory and storage.

    Attributes:
        name: where the spec came from (preset name, path or ``"config"``).
        vocab_size: ``V``.
        hidden_size: ``H``.
        intermediate_size: ``I``, each expert's SwiGLU width.
        num_layers: ``L``.
        num_heads: query heads ``nh``.
        num_kv_heads: key/value heads ``kv``.
        head_dim: ``d``.
        num_experts: ``E``.
        experts_per_token: ``k`` (top-k routing).
        sliding_window: window of the sliding-attention layers.
        layer_types: ``"sliding_attention"`` or ``"full_attention"`` per layer.
        attention_bias: whether q/k/v/o projections carry biases.
        tie_word_embeddings: whether ``lm_head`` shares the embedding table.
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    experts_per_token: int
    sliding_window: int | None
    layer_types: tuple[str, ...]
    attention_bias: bool
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str = "config") -> ModelSpec:
        """Build a spec from an HF ``config.json`` mapping.

        Args:
            config: the parsed ``config.json`` (or ``GptOssConfig.to_dict()``).
            name: label for reports and error messages.

        Returns:
            The spec.

        Raises:
            ModelSpecError: the model type is not supported or a required field is missing.
        """
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelSpecError(
                f"{name}: model_type {model_type!r} is not supported by the capacity planner; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:

            def count(field: str, fallback: str | None = None, default: Any = None) -> int:
                value = config.get(field)
                if value is None and fallback is not None:
                    value = config.get(fallback)
                if value is None:
                    if default is not None:
                        return default
                    raise KeyError(field)
                return _whole_number(name, field, value)

            num_layers = count("num_hidden_layers")
            num_heads = count("num_attention_heads")
            hidden_size = count("hidden_size")
            num_experts = count("num_local_experts")
            experts_per_token = count("num_experts_per_tok", "experts_per_token")
            num_kv_heads = count("num_key_value_heads", default=num_heads)
            if experts_per_token > num_experts:
                raise ModelSpecError(
                    f"{name}: num_experts_per_tok {experts_per_token} is more than "
                    f"num_local_experts {num_experts}"
                )
            if num_kv_heads > num_heads or num_heads % num_kv_heads:
                raise ModelSpecError(
                    f"{name}: num_key_value_heads {num_kv_heads} does not divide "
                    f"num_attention_heads {num_heads}"
                )
            window = config.get("sliding_window")
            layer_types = config.get("layer_types") or [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
            ]
            if not isinstance(layer_types, list) or len(layer_types) != num_layers:
                raise ModelSpecError(
                    f"{name}: layer_types must list one type per layer ({num_layers})"
                )
            return cls(
                name=name,
                vocab_size=count("vocab_size"),
                hidden_size=hidden_size,
                intermediate_size=count("intermediate_size"),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=count("head_dim", default=max(hidden_size // num_heads, 1)),
                num_experts=num_experts,
                experts_per_token=experts_per_token,
                sliding_window=None
                if window is None
                else _whole_number(name, "sliding_window", window),
                layer_types=tuple(layer_types),
                attention_bias=bool(config.get("attention_bias", True)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            )
        except KeyError as missing:
            raise ModelSpecError(f"{name}: config.json lacks the field {missing}") from None

    @property
    def num_sliding_layers(self) -> int:
        """Layers whose attention looks back only ``sliding_window`` tokens."""
        if self.sliding_window is None:
            return 0
        return sum(1 for kind in self.layer_types if kind == "sliding_attention")


@dataclass(frozen=True)
class ParameterCount:
    """Parameters per tensor group, summed over layers.

    Attributes:
        embedding: ``embed_tokens``.
        unembedding: ``lm_head`` (0 when tied).
        attention: q/k/v/o weights and biases and the attention sinks.
        router: router weights and biases.
        experts: all experts' ``gate_up_proj``/``down_proj`` weights and biases.
        expert_matrices: the ``gate_up_proj``/``down_proj`` weights alone (what MXFP4 packs).
        norms: RMSNorm weights.
        per_layer: the parameters of one decoder layer (what ZeRO-3 gathers at once).
        active_experts: the experts' share that one token uses (``k/E`` of ``experts``).
    """

    embedding: int
    unembedding: int
    attention: int
    router: int
    experts: int
    expert_matrices: int
    norms: int
    per_layer: int
    active_experts: int

    @property
    def total(self) -> int:
        """All parameters."""
        return (
            self.embedding
            + self.unembedding
            + self.attention
            + self.router
            + self.experts
            + self.norms
        )

    @property
    def active(self) -> int:
        """Parameters one token uses in compute (model-card convention: no embedding table)."""
        return self.total - self.embedding - self.experts + self.active_experts

    @property
    def dense(self) -> int:
        """Everything but the experts (what tensor parallelism splits and EP replicates)."""
        return self.total - self.experts


def count_parameters(spec: ModelSpec) -> ParameterCount:
    """Count a model's parameters tensor by tensor from its architecture.

    Args:
        spec: the model's shape.

    Returns:
        The count per tensor group.
    """
    h, i, e = spec.hidden_size, spec.intermediate_size, spec.num_experts
    q_width = spec.num_heads * spec.head_dim
    kv_width = spec.num_kv_heads * spec.head_dim
    bias = 1 if spec.attention_bias else 0
    attention = (
        (h * q_width + bias * q_width)
        + 2 * (h * kv_width + bias * kv_width)
        + (q_width * h + bias * h)
        + spec.num_heads
    )
    router = e * h + e
    expert_matrices = e * (h * 2 * i + i * h)
    experts = expert_matrices + e * (2 * i + h)
    norms = 2 * h
    per_layer = attention + router + experts + norms
    layers = spec.num_layers
    embedding = spec.vocab_size * h
    return ParameterCount(
        embedding=embedding,
        unembedding=0 if spec.tie_word_embeddings else embedding,
        attention=layers * attention,
        router=layers * router,
        experts=layers * experts,
        expert_matrices=layers * expert_matrices,
        norms=layers * norms + h,
        per_layer=per_layer,
        active_experts=layers * experts * spec.experts_per_token // e,
    )


def count_lora_parameters(spec: ModelSpec, rank: int, experts: bool) -> int:
    """Count the LoRA adapter parameters of ``rank`` on gpt-oss.

    Attention targets ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (``r·(in + out)`` each).
    With ``experts``, peft's ``target_parameters`` also wraps ``gate_up_proj`` and
    ``down_proj``; each of the ``E`` experts then gets its own ``r·(in + out)`` pair.

    Args:
        spec: the model's shape.
        rank: LoRA rank ``r``; 0 means full fine-tuning (no adapter).
        experts: whether the expert matrices are adapted too.

    Returns:
        The adapter's parameter count.
    """
    if rank <= 0:
        return 0
    h, i = spec.hidden_size, spec.intermediate_size
    q_width = spec.num_heads * spec.head_dim
    kv_width = spec.num_kv_heads * spec.head_dim
    per_layer = rank * ((h + q_width) + 2 * (h + kv_width) + (q_width + h))
    if experts:
        per_layer += spec.num_experts * rank * ((h + 2 * i) + (i + h))
    return spec.num_layers * per_layer


def load_model_spec(model: str | Path | Mapping[str, Any]) -> ModelSpec:
    """Resolve a preset name, a model directory, a ``config.json`` path or a config mapping.

    Args:
        model: ``"gpt-oss-20b"``-style preset name, a directory holding ``config.json``, the
            file itself, or the parsed mapping.

    Returns:
        The spec.

    Raises:
        ModelSpecError: the name is no preset and no readable ``config.json`` is there.
    """
    if isinstance(model, Mapping):
        return ModelSpec.from_config(model, name=str(model.get("_name_or_path") or "config"))
    if isinstance(model, str) and model in MODEL_PRESETS:
        return ModelSpec.from_config(MODEL_PRESETS[model], name=model)
    path = Path(model)
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise ModelSpecError(
            f"model {str(model)!r} is neither a preset ({', '.join(sorted(MODEL_PRESETS))}) "
            f"nor a directory or file holding config.json"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelSpecError(
            f"{config_path}: not a model's config.json (not UTF-8 JSON: {error})"
        ) from error
    if not isinstance(config, dict):
        raise ModelSpecError(f"{config_path}: not a model's config.json (not a JSON object)")
    return ModelSpec.from_config(config, name=str(path))
