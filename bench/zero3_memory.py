"""Per-rank peak memory of GRPO under DeepSpeed ZeRO-3: does any rank hold the whole model?

Runs the GRPO step (``trainer.grpo.recipe.run_grpo``: load, baseline eval, one GRPO step,
final save and export) as 2 ``torchrun`` processes on CPU (gloo), ZeRO-3, full-parameter
AdamW, on a tiny GPT-OSS model of ≥ 100M parameters built offline, and reads each rank's peak
resident memory (``ru_maxrss``) when the run ends. A second 2-process run imports the same
code, joins the process group, loads the tokenizer and scores one response (the reward's
language identifier) but loads no model: its peak is the fixed overhead.

What a rank must hold is then split exactly:

* training state: this rank's partition of the weights (fp32: they are the optimizer's fp32
  master too, ``trainer.zero3.share_fp32_master``), of the gradients and of AdamW's two fp32
  moments: ``ceil(numel / world)`` elements of each parameter (DeepSpeed pads every parameter
  to a multiple of the world size);
* the rest, ``peak − overhead − training state``: the tensors gathered for a forward,
  activations, DeepSpeed's buckets, the optimizer step's temporaries, and any copy beyond the
  partitions (a second master, a whole model). The target is rest ≤ 0.6 × the full model's
  bytes: no rank holds a whole copy.

``--code DIR`` measures another checkout's ``trainer`` (e.g. ``git archive main`` unpacked)
with the same model, data and settings: the before/after of docs/benchmarks.md.
``tests/bench/test_zero3_memory.py`` (slow) asserts the target.

Usage::

    python bench/zero3_memory.py [--work DIR] [--code DIR] [--kl 0.001] [--json OUT.json]
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
"""rest / full model bytes must stay at or below this on every rank."""

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


@dataclass
class RankMemory:
    """One rank's figures, in bytes (ratio: rest / full model bytes)."""

    rank: int
    peak_rss: int
    overhead: int
    training_state: int
    rest: int
    ratio: float


@dataclass
class Zero3Memory:
    """What one measurement found."""

    code: str
    parameters: int
    model_bytes: int
    world_size: int
    kl_loss_coef: float
    ranks: list[RankMemory]

    @property
    def worst_ratio(self) -> float:
        return max(r.ratio for r in self.ranks)


def training_state_bytes(numels: list[int], world: int, element_size: int) -> int:
    """One rank's partition of the weights (= the fp32 master for an fp32 model), of the
    gradients (model dtype) and of AdamW's two fp32 moments."""
    partition = sum(math.ceil(n / world) for n in numels)
    return partition * (4 + element_size + 8)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _write_peak(out: Path, kind: str) -> None:
    rank = int(os.environ["RANK"])
    (out / f"{kind}-rank{rank}.json").write_text(json.dumps({"peak_rss": _peak_rss_bytes()}))


def _worker(args) -> None:
    """One torchrun process: the GRPO run or the overhead probe; writes its peak RSS."""
    sys.path.insert(0, str(Path(args.code).resolve()))
    out = Path(args.out)
    if args.worker == "overhead":
        import deepspeed
        import deepspeed.runtime.engine  # noqa: F401  what deepspeed.initialize imports
        import transformers.models.gpt_oss.modeling_gpt_oss  # noqa: F401

        import trainer.grpo.recipe  # noqa: F401  everything the run imports
        from core.modeling import load_tokenizer
        from reward.scoring import ComplianceScorer
        from trainer.distributed import barrier, init_distributed

        info = init_distributed("cpu", 1)
        deepspeed.init_distributed(dist_backend="gloo")
        load_tokenizer(args.model)
        # the reward's language identifier loads at the first score (~130 MiB, any model size)
        ComplianceScorer().score_batch(["Bonjour, je suis une réponse."], ["fr"])
        barrier(info)
    else:
        from trainer.grpo.config import GRPOConfig
        from trainer.grpo.recipe import run_grpo

        cfg = GRPOConfig.model_validate(json.loads(args.config))
        data = Path(args.data)
        run_grpo(
            cfg, args.model, data / "train.jsonl", data / "eval.jsonl", out / "model", out / "work"
        )
    _write_peak(out, args.worker)


def _launch(kind: str, work: Path, code: Path, model: Path, data: Path, config: dict) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={WORLD}",
        str(Path(__file__).resolve()),
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


def measure(work: Path, code: Path = REPO, kl_loss_coef: float = 0.0) -> Zero3Memory:
    """Run the overhead probe and the GRPO run with ``code``'s trainer; the figures."""
    sys.path.insert(0, str(REPO))
    from trainer.zero3 import safetensors_entries

    work.mkdir(parents=True, exist_ok=True)
    model, data = prepare(work)
    run = work / f"run-{code.name}-kl{kl_loss_coef:g}"
    shutil.rmtree(run, ignore_errors=True)  # a fresh GRPO run, not a resume
    run.mkdir()
    config = {**GRPO, "algorithm": {"kl_loss_coef": kl_loss_coef}}
    _launch("overhead", run, code, model, data, config)
    _launch("grpo", run, code, model, data, config)
    entries = safetensors_entries(model).values()
    numels = [math.prod(e.shape) for e in entries]
    element_size = 4  # the bench model is fp32 and runs in fp32
    model_bytes = sum(numels) * element_size
    state = training_state_bytes(numels, WORLD, element_size)
    ranks = []
    for rank in range(WORLD):
        peak = json.loads((run / f"grpo-rank{rank}.json").read_text())["peak_rss"]
        overhead = json.loads((run / f"overhead-rank{rank}.json").read_text())["peak_rss"]
        rest = peak - overhead - state
        ranks.append(RankMemory(rank, peak, overhead, state, rest, rest / model_bytes))
    return Zero3Memory(str(code), sum(numels), model_bytes, WORLD, kl_loss_coef, ranks)


def report(result: Zero3Memory) -> str:
    mib = 1024**2
    lines = [
        f"code: {result.code}",
        f"model: {result.parameters / 1e6:.1f}M parameters, {result.model_bytes / mib:.0f} MiB "
        f"(fp32); {result.world_size} ranks, ZeRO-3, AdamW, kl_loss_coef {result.kl_loss_coef}",
        "rank  peak RSS  overhead  weights+grad+Adam partition  rest  rest / model",
    ]
    for r in result.ranks:
        lines.append(
            f"{r.rank:>4}  {r.peak_rss / mib:>6.0f} MiB  {r.overhead / mib:>5.0f} MiB  "
            f"{r.training_state / mib:>20.0f} MiB  {r.rest / mib:>5.0f} MiB  {r.ratio:>6.2f}"
        )
    verdict = "meets" if result.worst_ratio <= TARGET else "misses"
    lines.append(f"worst rest / model {result.worst_ratio:.2f}: {verdict} the target ≤ {TARGET}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default="/tmp/zero3-memory")
    parser.add_argument("--code", default=str(REPO), help="checkout whose trainer is measured")
    parser.add_argument("--kl", type=float, default=0.0, help="kl_loss_coef (>0: a reference)")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--worker", choices=["overhead", "grpo"], help=argparse.SUPPRESS)
    for hidden in ("--model", "--data", "--out", "--config"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = measure(Path(args.work), Path(args.code).resolve(), args.kl)
    text = report(result)
    print(text)  # noqa: T201  the bench's report
    if args.json:
        figures = {**asdict(result), "worst_ratio": result.worst_ratio}
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0 if result.worst_ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
