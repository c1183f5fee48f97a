"""The typed configuration of the SFT step."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from core.config_model import ConfigModel
from trainer.backends.config import OptimConfig, ProcessSettings

ATTENTION_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


class LoraSettings(ConfigModel):
    """LoRA via peft; ``r = 0`` means full fine-tuning (no adapter)."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(16, ge=0)
    alpha: int = 32
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: list(ATTENTION_MODULES))
    experts: bool = False
    """Also adapt the MoE experts' 3-D weights (peft ``target_parameters``)."""
    modules_to_save: list[str] = Field(default_factory=list)
    """Modules trained fully beside the adapter (e.g. ``embed_tokens``, ``lm_head``)."""


class SFTConfig(ProcessSettings):
    """How the SFT step trains.

    The global batch is ``micro_batch_size × gradient_accumulation_steps × processes``
    examples; the loss is the mean over its assistant tokens (analysis and final channels).
    """

    model_config = ConfigDict(extra="forbid")

    lora: LoraSettings = LoraSettings()
    optim: OptimConfig = OptimConfig(learning_rate=2e-4, warmup_steps=10)
    max_seq_len: int = Field(1024, ge=16)
    overlong: Literal["drop", "truncate"] = "drop"
    """A prompt+completion longer than max_seq_len is dropped, or its completion cut (counted)."""
    micro_batch_size: int = Field(4, ge=1)
    gradient_accumulation_steps: int = Field(4, ge=1)
    max_steps: int = Field(0, ge=0)
    """Optimizer steps; 0 means ``num_epochs`` passes over the data."""
    num_epochs: float = Field(1.0, gt=0)
    eval_every: int = Field(0, ge=0)
    """Evaluate every this many steps (0: only at the end)."""
    eval_max_examples: int = Field(256, ge=1)
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint every this many steps (0: never)."""
    keep_checkpoints: int = Field(2, ge=1)
    merge_check_prompts: int = Field(4, ge=1)

    @field_validator("optim")
    @classmethod
    def _hf_backend(cls, optim: OptimConfig) -> OptimConfig:
        if not optim.trainer.trains_hf_module:
            raise ValueError(
                f"optim.backend {optim.backend!r} is for GRPO; SFT trains the HF model with "
                "'torch' or 'deepspeed' (the Megatron branch converts the SFT-merged model "
                "afterwards)"
            )
        return optim
