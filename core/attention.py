"""The attention kernel a training process runs on GPT-OSS, decided in one place: the model
loaders ask transformers for it and the capacity planner counts its memory.

GPT-OSS adds a learned sink logit to every head's softmax (``GptOssAttention.sinks``, passed to
the attention function as ``s_aux``), so only kernels that take sinks give its outputs. In the
pinned stack (transformers 5.x, torch 2.14, vLLM 0.33: ``images/Dockerfile.gpu``):

- ``eager`` (transformers' ``eager_attention_forward``): materializes the ``S×S`` scores, adds
  the sink column, and takes the softmax in the scores' dtype (bf16 in a bf16 run; torch's
  kernel accumulates in fp32 but the scores and probabilities are rounded to bf16). It runs on
  every device. A GPT-OSS model loaded without ``attn_implementation`` gets it too:
  transformers tries ``sdpa`` first, and GPT-OSS declares ``_supports_sdpa = False``.
- ``flex_attention``: sinks through a log-sum-exp renormalization, CUDA only (it refuses sinks
  on CPU), compiled by ``torch.compile`` on first use; not used here.
- ``kernels-community/vllm-flash-attn3`` (FA3 with sinks, Hopper): fetched from the Hugging
  Face Hub by the ``kernels`` package when the model loads, which the image does not hold and
  a job without Hub access cannot fetch; and its backward takes no sinks (the forward is the
  inference kernel), so it cannot train.

So the HF trainer (backends ``torch`` and ``deepspeed``) runs eager attention on every machine,
H200 included. Megatron-Core runs Transformer Engine's fused attention with
``softmax_type="learnable"`` (the sinks; TE ≥ 2.8, ``core.image_checks``; its release notes put
sinks in the fused backend with cuDNN ≥ 9.13, not measured here) where the GPU has a fused
kernel with sinks (``cluster.nodes.NodeType.flash_attention``: Hopper), else its unfused
softmax, which keeps the scores as eager does. vLLM's engines run their own FA3/Triton kernels
with sinks (fp32 softmax inside the kernel); that is the engine's memory, not this.
"""

from __future__ import annotations

from typing import Literal

AttentionKernel = Literal["eager", "flash"]
"""What the planner tells apart: ``eager`` keeps the ``S×S`` probabilities for backward,
``flash`` (a fused kernel) only a log-sum-exp per row."""

HF_ATTN_IMPLEMENTATION: AttentionKernel = "eager"
"""The ``attn_implementation`` every HF causal LM of this project is loaded with, on every
device: the one kernel of the pinned stack that trains GPT-OSS's sinks (above)."""


def training_attention(trains_hf_module: bool, fused_sinks: bool) -> AttentionKernel:
    """The attention kernel a training process runs.

    Args:
        trains_hf_module: the backend trains the Hugging Face module (``torch``,
            ``deepspeed``: ``plan.TrainerSpec.trains_hf_module``); else its own model
            (``megatron``: Megatron-Core with Transformer Engine).
        fused_sinks: the GPU has a fused attention kernel that takes sinks (Hopper).

    Returns:
        ``eager`` for the HF model on every device (``HF_ATTN_IMPLEMENTATION``); for
        Megatron, ``flash`` (Transformer Engine's fused attention) where ``fused_sinks``,
        else ``eager``.
    """
    if trains_hf_module:
        return HF_ATTN_IMPLEMENTATION
    return "flash" if fused_sinks else "eager"
