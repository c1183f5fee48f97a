"""What eager attention's bf16 softmax costs in log-probs against an fp32 softmax, on CPU.

The HF trainer runs GPT-OSS's attention eager (``core.attention``): the scores, the sink
column and the softmax's output are bf16 in a bf16 run. vLLM's kernels keep the scores and the
softmax in fp32 inside the kernel. The sync check's floor (``trainer.grpo.sync_check``) holds
that difference among others, and a floor past ``FLOOR_CEILING`` (bf16: 0.5 nats, mean or
p95) stops a run before its first step. This measures the attention part alone: the same bf16
weights, once with transformers' eager attention and once with the same math in fp32
(``eager_fp32`` below, registered with transformers' ``AttentionInterface``), and an fp32
model as the reference; per response token, |Δ log-prob| mean, p95 and max.

A proxy, said plainly: the tiny GPT-OSS (``trainer.tiny_model.TinyModelConfig()``: 2 layers,
4 heads of 32) at random initialization, whose attention is nearly uniform; ``--q-scale``
multiplies the query projections to sharpen it (score std ~1.5 at 30, ~5 at 100, closer to a
trained model's). gpt-oss-20b has 24 layers of 64 heads; its figure is measured on a GPU
against vLLM (``bench/gpu_checks.py``: the sync check's floor).

Usage::

    python bench/attention_precision.py [--q-scale 1 30 100] [--tokens 512]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.tiny_model import TinyModelConfig, build_tiny_model  # noqa: E402

FP32_ATTENTION = "eager_fp32"


class _Fp32Sinks:
    """An attention module as ``eager_attention_forward`` reads it, with fp32 sinks."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module

    def __getattr__(self, name: str):
        value = getattr(self._module, name)
        return value.float() if name == "sinks" else value


def eager_fp32(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' GPT-OSS eager attention with the scores, sinks and softmax in fp32."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    mask = attention_mask.float() if attention_mask is not None else None
    out, weights = eager_attention_forward(
        _Fp32Sinks(module), query.float(), key.float(), value.float(), mask, scaling, dropout
    )
    return out.to(query.dtype), weights


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(FP32_ATTENTION, eager_fp32)
    AttentionMaskInterface.register(FP32_ATTENTION, eager_mask)  # eager's additive mask


def _log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def _stats(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a - b).abs().flatten().sort().values
    p95 = d[max(0, int(0.95 * len(d)) - 1)]
    return f"mean {d.mean():.4f}  p95 {p95:.4f}  max {d[-1]:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--q-scale", type=float, nargs="+", default=[1.0, 30.0, 100.0])
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    _register()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", TinyModelConfig(seed=0))
        for scale in args.q_scale:
            runs = {}
            for name, impl, dtype in (
                ("bf16 eager", "eager", torch.bfloat16),
                ("bf16 fp32-softmax", FP32_ATTENTION, torch.bfloat16),
                ("fp32", "eager", torch.float32),
            ):
                model = AutoModelForCausalLM.from_pretrained(
                    model_dir, dtype=dtype, attn_implementation=impl
                ).eval()
                with torch.no_grad():
                    for layer in model.model.layers:
                        layer.self_attn.q_proj.weight.mul_(scale)
                runs[name] = model
            vocab = runs["fp32"].config.vocab_size
            ids = torch.randint(
                0, vocab, (4, args.tokens), generator=torch.Generator().manual_seed(1)
            )
            lp = {name: _log_probs(model, ids) for name, model in runs.items()}
            print(f"q scale {scale:g}: |Δ log-prob| per token over {lp['fp32'].numel()} tokens")
            pairs = (
                ("bf16 eager", "bf16 fp32-softmax"),
                ("bf16 eager", "fp32"),
                ("bf16 fp32-softmax", "fp32"),
            )
            for a, b in pairs:
                print(f"  {a} vs {b}:".ljust(38) + _stats(lp[a], lp[b]))


if __name__ == "__main__":
    main()
