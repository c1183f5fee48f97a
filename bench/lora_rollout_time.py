"""The HF rollout engine's ``generate`` with LoRA on attention + experts, against the base model,
interleaved in one process (issue #42): peft's per-forward path vs the delta built once a call
(``trainer.sft.lora.lora_parameters_fixed``, what ``HFRolloutEngine.generate`` uses).

    python bench/lora_rollout_time.py [--rounds 3] [--prompts 4] [--samples 8] [--tokens 64]

The model is the demo's (``tiny-cpu``'s ``model.tiny``), built from its config into a temp
folder; the adapter is r 16, α 32 with ``B`` = 0 (as at the start of a run), so all three
generate the same tokens. One thread, so the figure is the work's, not the scheduler's. Prints
each round's seconds and the medians' ratios to the base model's.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# bench/data_prep.py would shadow the data_prep package: keep this folder off the import path
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]
sys.path.insert(0, str(ROOT))

MODES = ("full", "lora, delta once a call", "lora, peft per forward")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    import trainer.grpo.rollout as rollout
    from core.modeling import load_tokenizer
    from pipelines.presets import get_preset
    from trainer.grpo.config import RolloutConfig
    from trainer.sft.config import LoraSettings
    from trainer.sft.lora import apply_lora
    from trainer.tiny_model import build_tiny_model

    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="lora-rollout-")) / "model"
    build_tiny_model(folder, get_preset("tiny-cpu").model.tiny)
    tokenizer = load_tokenizer(folder)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    adapted = apply_lora(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
        LoraSettings(r=16, alpha=32, experts=True),
    )
    cfg = RolloutConfig(n_samples=args.samples, max_new_tokens=args.tokens)
    prompts = [
        tokenizer(f"Question {i} : combien de jours dans une semaine ?")["input_ids"]
        for i in range(args.prompts)
    ]
    seeds = [[i * args.samples + j for j in range(args.samples)] for i in range(args.prompts)]
    once = rollout.lora_parameters_fixed
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        for mode in MODES:
            per_forward = mode == MODES[2]
            rollout.lora_parameters_fixed = (
                (lambda model: contextlib.nullcontext()) if per_forward else once
            )
            model = base if mode == MODES[0] else adapted
            engine = rollout.HFRolloutEngine(model, tokenizer, cfg)
            start = time.perf_counter()
            out = engine.generate(prompts, seeds)
            seconds[mode].append(time.perf_counter() - start)
            tokens = sum(len(r.response_ids) for r in out)
            print(f"round {round_ + 1}  {mode:<24} {seconds[mode][-1]:6.2f} s  {tokens} tokens")
    rollout.lora_parameters_fixed = once
    full = statistics.median(seconds[MODES[0]])
    for mode in MODES:
        median = statistics.median(seconds[mode])
        print(f"{mode:<24} median {median:6.2f} s  ÷ full {median / full:.2f}")


if __name__ == "__main__":
    main()
