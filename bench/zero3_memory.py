"""Per-rank peak memory of GRPO or SFT under DeepSpeed ZeRO-3: does any rank hold the whole model?

Runs the step (``--step grpo``: ``trainer.grpo.recipe.run_grpo``, i.e. load, baseline eval,
one GRPO step, final save and export; ``--step sft``: ``trainer.sft.recipe.run_sft``, i.e.
load, LoRA as the gpt-oss-20b preset has it, one SFT step, eval, merge and its check) as 2
``torchrun`` processes on CPU (gloo), ZeRO-3, on a tiny GPT-OSS model of ≥ 100M parameters
built offline, and reads each rank's peak resident memory (``ru_maxrss``) when the run ends.
A second 2-process run imports the same code, joins the process group and loads the
tokenizer (GRPO: also scores one response, loading the reward's language identifier) but
loads no model: its peak is the fixed overhead.

What a rank must hold is then split exactly:

* training state: this rank's partition of every weight (fp32: for trained weights also the
  optimizer's fp32 master, ``trainer.zero3.share_fp32_master``) and, for the trained ones
  (GRPO: all; SFT: the LoRA adapter), of the gradients and of AdamW's two fp32 moments:
  ``ceil(numel / world)`` elements of each parameter (DeepSpeed pads every parameter to a
  multiple of the world size);
* SFT only, rank 0: the final model whole on its host for the merge, and the merged model
  reloaded for the merge check (``trainer.sft.recipe._final_model``, ``trainer.sft.merge``):
  2 × the model, by design;
* the rest, ``peak − overhead − training state − final model``: the tensors gathered for a
  forward, activations, DeepSpeed's buckets, the optimizer step's temporaries, and any copy
  beyond the partitions (a second master, a whole model). The target is rest ≤ 0.6 × the
  full model's bytes for GRPO, 0.75 for SFT (``TARGETS``): no rank holds a whole copy it
  does not need.

``--code DIR`` measures another checkout's ``trainer`` (e.g. ``git archive main`` unpacked)
with the same model, data and settings: the before/after of docs/benchmarks.md.
``tests/bench/test_zero3_memory.py`` (slow) asserts the target for both steps.

Usage::

    python bench/zero3_memory.py [--step grpo|sft] [--work DIR] [--code DIR] [--kl 0.001]
                                 [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

logger = logging.getLogger("bench.zero3_memory")

WORLD = 2
TARGET = 0.6
"""GRPO: rest / full model bytes must stay at or below this on every rank."""
TARGETS = {"grpo": TARGET, "sft": 0.75}
"""The bound by step. SFT's is higher: LoRA on the experts (peft's ``ParamWrapper``)
materializes ``W + ΔW`` of each expert matrix in the forward, beside the gathered ``W``, a
cost full-parameter GRPO does not have (measured and decomposed in docs/benchmarks.md)."""

MODEL = {
    "vocab_size": 2048,
    "hidden_size": 384,
    "intermediate_size": 512,
    "num_hidden_layers": 12,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_local_experts": 16,
    "num_experts_per_tok": 2,
    "sliding_window": 32,
    "seed": 0,
}
"""~120M parameters (~480 MB in fp32), 12 layers: its largest tensor (one layer's experts'
gate_up_proj) is ~5% of it, as gpt-oss-20b's largest (the embedding) is ~3%."""

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
"""glibc's default threshold (128 KiB), fixed: by default it rises to the size of the largest
block freed (up to 32 MiB), after which freed tensors below it stay in the heap and count in
the RSS as if live. Fixed, a freed tensor goes back to the system; both runs use it."""

GRPO = {
    "rollout": {"n_samples": 2, "max_new_tokens": 8},
    "prompts_per_step": 2,
    "mini_batch_size": 4,
    "micro_batch_size": 2,
    "max_steps": 1,
    "eval_every": 0,
    "eval_prompts": 2,
    "eval_samples": 1,
    "checkpoint_every": 0,
    "dtype": "float32",
    "device": "cpu",
    "cpu_threads": 1,
    "nproc": WORLD,
    "optim": {"backend": "deepspeed", "zero_stage": 3, "learning_rate": 1e-5},
}


SFT = {
    # LoRA as the gpt-oss-20b preset trains it: r 8 on attention and experts, with gradient
    # checkpointing
    "lora": {"r": 8, "alpha": 16, "experts": True},
    "gradient_checkpointing": True,
    "max_steps": 1,
    "micro_batch_size": 1,
    "gradient_accumulation_steps": 1,
    "max_seq_len": 256,
    "eval_max_examples": 2,
    "merge_check_prompts": 1,
    "checkpoint_every": 0,
    "dtype": "float32",
    "device": "cpu",
    "cpu_threads": 1,
    "nproc": WORLD,
    "optim": {"backend": "deepspeed", "zero_stage": 3, "learning_rate": 1e-4},
}
STEPS = ("grpo", "sft")
FINAL_MODEL_COPIES = {"grpo": 0, "sft": 2}
"""Whole copies of the model rank 0 holds by design at the end of the step: SFT's final model
for the merge, and the merged model reloaded for its check."""


@dataclass
class RankMemory:
    """One rank's figures, in bytes (ratio: rest / full model bytes)."""

    rank: int
    peak_rss: int
    overhead: int
    training_state: int
    final_model: int
    rest: int
    ratio: float


@dataclass
class Zero3Memory:
    """What one measurement found."""

    step: str
    code: str
    parameters: int
    model_bytes: int
    world_size: int
    kl_loss_coef: float
    ranks: list[RankMemory]

    @property
    def worst_ratio(self) -> float:
        return max(r.ratio for r in self.ranks)

    @property
    def target(self) -> float:
        return TARGETS[self.step]


def training_state_bytes(
    numels: list[int], world: int, element_size: int, frozen: list[int] = ()
) -> int:
    """One rank's partition of the trained weights (= the fp32 master for an fp32 model), of
    their gradients (model dtype) and of AdamW's two fp32 moments; and of the ``frozen``
    weights (the weights alone)."""
    trained = sum(math.ceil(n / world) for n in numels)
    kept = sum(math.ceil(n / world) for n in frozen)
    return trained * (4 + element_size + 8) + kept * element_size


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _write_peak(out: Path, kind: str) -> None:
    rank = int(os.environ["RANK"])
    (out / f"{kind}-rank{rank}.json").write_text(json.dumps({"peak_rss": _peak_rss_bytes()}))


def _worker(args) -> None:
    """One torchrun process: the step's run or the overhead probe; writes its peak RSS."""
    sys.path.insert(0, str(Path(args.code).resolve()))
    out, data = Path(args.out), Path(args.data)
    if args.worker == "overhead":
        import deepspeed
        import deepspeed.runtime.engine  # noqa: F401  what deepspeed.initialize imports
        import torch
        import transformers.models.gpt_oss.modeling_gpt_oss  # noqa: F401

        from core.modeling import load_tokenizer
        from trainer.distributed import barrier, init_distributed
        from trainer.zero3 import init_deepspeed_comm

        # everything the run imports
        if args.step == "grpo":
            import trainer.grpo.recipe  # noqa: F401
        else:
            import peft  # noqa: F401

            import trainer.sft.recipe  # noqa: F401
        info = init_distributed("cpu", 1)
        init_deepspeed_comm(torch.device("cpu"))
        load_tokenizer(args.model)
        if args.step == "grpo":
            from reward.scoring import ComplianceScorer

            # the reward's language identifier loads at the first score (~130 MiB, any model)
            ComplianceScorer().score_batch(["Bonjour, je suis une réponse."], ["fr"])
        barrier(info)
    elif args.step == "grpo":
        from trainer.grpo.config import GRPOConfig
        from trainer.grpo.recipe import run_grpo

        cfg = GRPOConfig.model_validate(json.loads(args.config))
        run_grpo(
            cfg, args.model, data / "train.jsonl", data / "eval.jsonl", out / "model", out / "work"
        )
    else:
        from trainer.sft.config import SFTConfig
        from trainer.sft.recipe import run_sft

        cfg = SFTConfig.model_validate(json.loads(args.config))
        run_sft(
            cfg, args.model, data / "train.jsonl", data / "eval.jsonl", out / "model", out / "work"
        )
    _write_peak(out, args.worker)


def _launch(
    step: str, kind: str, work: Path, code: Path, model: Path, data: Path, config: dict
) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={WORLD}",
        str(Path(__file__).resolve()),
        "--step",
        step,
        "--worker",
        kind,
        "--code",
        str(code),
        "--model",
        str(model),
        "--data",
        str(data),
        "--out",
        str(work),
        "--config",
        json.dumps(config),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(code), **MALLOC_ENV}
    subprocess.run(command, env=env, check=True)


def prepare(work: Path) -> tuple[Path, Path]:
    """The bench model and the prepared data in ``work`` (built once, then reused)."""
    sys.path.insert(0, str(REPO))
    from data_prep.config import DataPrepConfig
    from data_prep.prepare import prepare_dataset
    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    model, data = work / "model", work / "data"
    if not (model / "model.safetensors").exists():
        build_tiny_model(model, TinyModelConfig(**MODEL))
    if not (data / "train.jsonl").exists():
        data.mkdir(parents=True, exist_ok=True)
        prepare_dataset(
            DataPrepConfig(workers=1),
            data / "train.jsonl",
            data / "eval.jsonl",
            data / "quarantine.jsonl",
        )
    return model, data


def _trained_numels(step: str, run: Path, numels: list[int]) -> tuple[list[int], list[int]]:
    """``(trained, frozen)`` parameter sizes: GRPO trains every weight; SFT the LoRA adapter
    its run saved (``work/adapter``), the model's weights frozen."""
    if step == "grpo":
        return numels, []
    from trainer.zero3 import safetensors_entries

    adapter = safetensors_entries(run / "work" / "adapter").values()
    return [math.prod(e.shape) for e in adapter], numels


def measure(
    work: Path, code: Path = REPO, kl_loss_coef: float = 0.0, step: str = "grpo"
) -> Zero3Memory:
    """Run the overhead probe and the step with ``code``'s trainer; the figures."""
    sys.path.insert(0, str(REPO))
    from trainer.zero3 import safetensors_entries

    work.mkdir(parents=True, exist_ok=True)
    model, data = prepare(work)
    run = work / f"run-{step}-{code.name}-kl{kl_loss_coef:g}"
    shutil.rmtree(run, ignore_errors=True)  # a fresh run, not a resume
    run.mkdir()
    config = {**GRPO, "algorithm": {"kl_loss_coef": kl_loss_coef}} if step == "grpo" else SFT
    _launch(step, "overhead", run, code, model, data, config)
    _launch(step, "run", run, code, model, data, config)
    numels = [math.prod(e.shape) for e in safetensors_entries(model).values()]
    element_size = 4  # the bench model is fp32 and runs in fp32
    model_bytes = sum(numels) * element_size
    trained, frozen = _trained_numels(step, run, numels)
    state = training_state_bytes(trained, WORLD, element_size, frozen)
    ranks = []
    for rank in range(WORLD):
        peak = json.loads((run / f"run-rank{rank}.json").read_text())["peak_rss"]
        overhead = json.loads((run / f"overhead-rank{rank}.json").read_text())["peak_rss"]
        final = FINAL_MODEL_COPIES[step] * model_bytes if rank == 0 else 0
        rest = peak - overhead - state - final
        ranks.append(RankMemory(rank, peak, overhead, state, final, rest, rest / model_bytes))
    return Zero3Memory(step, str(code), sum(numels), model_bytes, WORLD, kl_loss_coef, ranks)


def report(result: Zero3Memory) -> str:
    mib = 1024**2
    trained = "full-parameter AdamW" if result.step == "grpo" else "LoRA r 8 (AdamW)"
    lines = [
        f"step: {result.step}; code: {result.code}",
        f"model: {result.parameters / 1e6:.1f}M parameters, {result.model_bytes / mib:.0f} MiB "
        f"(fp32); {result.world_size} ranks, ZeRO-3, {trained}, kl_loss_coef "
        f"{result.kl_loss_coef}",
        "rank  peak RSS  overhead  training state partition  final model  rest  rest / model",
    ]
    for r in result.ranks:
        lines.append(
            f"{r.rank:>4}  {r.peak_rss / mib:>6.0f} MiB  {r.overhead / mib:>5.0f} MiB  "
            f"{r.training_state / mib:>17.0f} MiB  {r.final_model / mib:>7.0f} MiB  "
            f"{r.rest / mib:>5.0f} MiB  {r.ratio:>6.2f}"
        )
    verdict = "meets" if result.worst_ratio <= result.target else "misses"
    lines.append(
        f"worst rest / model {result.worst_ratio:.2f}: {verdict} the target ≤ {result.target}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step", choices=STEPS, default="grpo", help="the step measured")
    parser.add_argument("--work", default="/tmp/zero3-memory")
    parser.add_argument("--code", default=str(REPO), help="checkout whose trainer is measured")
    parser.add_argument(
        "--kl", type=float, default=0.0, help="GRPO's kl_loss_coef (>0: a reference)"
    )
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--worker", choices=["overhead", "run"], help=argparse.SUPPRESS)
    for hidden in ("--model", "--data", "--out", "--config"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = measure(Path(args.work), Path(args.code).resolve(), args.kl, args.step)
    text = report(result)
    print(text)  # noqa: T201  the bench's report
    if args.json:
        figures = {**asdict(result), "worst_ratio": result.worst_ratio}
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0 if result.worst_ratio <= result.target else 1


if __name__ == "__main__":
    sys.exit(main())
