"""Weight-sync bytes per GRPO step, full-parameter vs LoRA (issue #42), on the tiny demo model.

Each variant builds the policy as the GRPO step does (``trainer.backends.build_backend`` from
``update.backend_request``: with ``grpo.lora`` the peft adapter on the frozen base) and a
dedicated HF engine as a rollout-only process does (``engines.engine_builders("hf")
.rollout_only``: the SFT model, with the same adapter when LoRA is on), applies a stand-in
update (seeded noise on every trainable tensor), and runs the step's sync, ``weight_sync
.sync_engine``: the tensors the engine receives (LoRA: the adapter's alone), then the check
that its log-probs of a probe equal the policy's. The bytes are those ``sync_engine`` reports
(``sync_bytes`` in ``training_metrics.jsonl``): what one engine receives per step; the dedicated
engines' channel (``remote.RemoteRolloutEngine``) sends the same tensors in buckets, once per
engine.

    python bench/lora_sync_bytes.py                      # the tiny demo model, r=16 attention
    python bench/lora_sync_bytes.py --r 8 --experts      # also GPT-OSS's expert weights

Prints one JSON line per variant, then the ratio LoRA / full.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.modeling import load_tokenizer  # noqa: E402
from trainer.backends import build_backend  # noqa: E402
from trainer.distributed import DistInfo  # noqa: E402
from trainer.grpo import engines  # noqa: E402
from trainer.grpo.config import GRPOConfig  # noqa: E402
from trainer.grpo.sync_check import SyncCheck, sync_probe  # noqa: E402
from trainer.grpo.update import backend_request  # noqa: E402
from trainer.grpo.weight_sync import sync_engine  # noqa: E402
from trainer.placement import run_placement  # noqa: E402
from trainer.tiny_model import TinyModelConfig, build_tiny_model  # noqa: E402

ONE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
PROBE = "Explain, step by step, why the sky looks blue at noon and red at sunset."


def demo_model_config() -> TinyModelConfig:
    """The tiny-cpu preset's model (the CPU demo's)."""
    from pipelines.presets import get_preset

    return get_preset("tiny-cpu").model.tiny


def measure(model_dir: Path, lora: dict | None) -> dict:
    """One step's sync into a dedicated HF engine: its bytes, tensors, and the check's gap.

    ``lora``: ``grpo.lora``'s fields (None: full-parameter GRPO)."""
    cfg = GRPOConfig.model_validate({"dtype": "float32", "lora": lora or {"r": 0}})
    tokenizer = load_tokenizer(model_dir)
    request = backend_request(cfg, model_dir, torch.float32, ONE, tokenizer.pad_token_id)
    backend, _ = build_backend(request)
    site = engines.EngineSite(cfg, model_dir, tokenizer, run_placement(cfg, ONE), ONE)
    engine = engines.engine_builders("hf").rollout_only(site)
    probe = sync_probe([tokenizer(PROBE)["input_ids"]], 32)
    check = SyncCheck(torch.float32)
    adapter_only = cfg.lora.r > 0
    pad = tokenizer.pad_token_id
    sync_engine(engine, backend, probe, check, pad, ONE, 0, adapter_only=adapter_only)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a stand-in update: every tensor the optimizer would move
        for param in backend.unwrapped().parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    report = sync_engine(engine, backend, probe, check, pad, ONE, 1, adapter_only=adapter_only)
    trainable = [p for p in backend.unwrapped().parameters() if p.requires_grad]
    return {
        "variant": "lora" if adapter_only else "full",
        "lora": cfg.lora.model_dump() if adapter_only else None,
        "sync_bytes": report.bytes,
        "tensors": len(trainable),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "model_parameters": sum(p.numel() for p in backend.unwrapped().parameters()),
        "sync_logprob_max_diff": report.gap.max,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--r", type=int, default=16, help="LoRA rank (grpo.lora.r)")
    parser.add_argument("--alpha", type=int, default=32)
    parser.add_argument(
        "--experts", action="store_true", help="also adapt the experts (grpo.lora.experts)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", demo_model_config())
        full = measure(model_dir, None)
        lora = measure(model_dir, {"r": args.r, "alpha": args.alpha, "experts": args.experts})
    for row in (full, lora):
        print(json.dumps(row))
    ratio = lora["sync_bytes"] / full["sync_bytes"]
    print(
        f"sync bytes per step: full {full['sync_bytes']:,}, LoRA {lora['sync_bytes']:,} "
        f"(r={args.r}{', experts' if args.experts else ''}): ratio {ratio:.4f} "
        f"({100 * ratio:.2f}% of full)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
