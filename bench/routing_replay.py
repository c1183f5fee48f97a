"""Routing replay against an engine whose expert routing is perturbed: the mismatch without
and with ``algorithm.router_replay: rollout``.

The tiny GPT-OSS (``trainer.tiny_model.SMALLEST``) is the fp32 policy; the engine is an HF
engine on a copy of it whose router weights carry Gaussian noise of ``sigma`` × their std,
so its routing flips at near-ties as another kernel's would. It samples 4 prompts × 4
responses (recording its log-probs and routing); one GRPO update (``update.policy_update``) of the
policy on them reports ``rollout_kl``, the |d| percentiles and ``router_mismatch_rate``,
once without replay and once with.

Usage::

    python bench/routing_replay.py [--sigma 0.1 0.3]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.seeds import group_seeds  # noqa: E402
from trainer.backends.torch import TorchBackend  # noqa: E402
from trainer.grpo import algorithm as algo  # noqa: E402
from trainer.grpo import update  # noqa: E402
from trainer.grpo.config import GRPOConfig, RolloutConfig  # noqa: E402
from trainer.grpo.prompts import Prompt  # noqa: E402
from trainer.grpo.rollout import HFRolloutEngine  # noqa: E402
from trainer.grpo.routing import moe_routers  # noqa: E402

FIGURES = ("rollout_kl", "rollout_logprob_diff_p50", "rollout_logprob_diff_p99")


def perturbed_engine_batch(model, tokenizer, sigma: float, seed: int = 11) -> update.Batch:
    """4 prompts (random ids: 9 to 41 tokens) × 4 responses of up to 16 tokens sampled by an
    HF engine on a copy of ``model`` whose routers' weights carry noise, with the engine's
    log-probs and routing; rewards by position (a signal in every group)."""
    engine_model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in moe_routers(engine_model):
            noise = torch.randn(router.weight.shape, generator=gen)
            router.weight.add_(sigma * router.weight.std() * noise)
    vocab = int(model.config.vocab_size)
    prompts = [
        Prompt(torch.randint(5, vocab, (n,), generator=gen).tolist(), "fr", f"p{n}")
        for n in (41, 12, 27, 9)
    ]
    engine = HFRolloutEngine(engine_model, tokenizer, RolloutConfig(n_samples=4, max_new_tokens=16))
    return sampled_batch(engine, prompts, 4, seed)


def sampled_batch(engine, prompts: list[Prompt], samples: int, seed: int = 0) -> update.Batch:
    """``samples`` responses to each of ``prompts`` from ``engine``, as the GRPO update takes
    them (rewards by position: a signal in every group)."""
    rollouts = engine.generate(
        [p.ids for p in prompts], group_seeds(seed, 0, range(len(prompts)), samples)
    )
    rewards = torch.arange(len(rollouts), dtype=torch.float32) % 3
    groups = torch.tensor([r.prompt_index for r in rollouts])
    advantages = algo.get_advantage_estimator("grpo")(rewards, groups)
    keep = torch.ones_like(rewards)
    return update.Batch(prompts, rollouts, rewards, advantages, keep, [None] * len(rollouts))


def update_stats(model, batch: update.Batch, replay: str, samples: int = 4) -> dict:
    """The statistics of one update of a copy of ``model`` (on its device) on ``batch``, one
    mini-batch of all its rollouts."""
    rollouts = len(batch.rollouts)
    cfg = GRPOConfig.model_validate(
        {
            "rollout": {"n_samples": samples, "max_new_tokens": 16},
            "prompts_per_step": rollouts // samples,
            "mini_batch_size": rollouts,
            "micro_batch_size": samples,
            "algorithm": {"router_replay": replay},
            "optim": {"learning_rate": 1e-6},
            "dtype": "float32",
        }
    )
    backend = TorchBackend(copy.deepcopy(model), cfg.optim, 10)
    return update.policy_update(cfg, backend, batch, 0, 0)


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.tiny_model import SMALLEST, build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sigma", type=float, nargs="+", default=[0.1, 0.3])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    directory = build_tiny_model(Path(tempfile.mkdtemp()) / "model", SMALLEST)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    print("| sigma | replay | rollout_kl | |d| p50 | |d| p99 | router_mismatch_rate |")
    print("|---|---|---|---|---|---|")
    for sigma in args.sigma:
        batch = perturbed_engine_batch(model, tokenizer, sigma)
        for replay in ("off", "rollout"):
            stats = update_stats(model, batch, replay)
            cells = " | ".join(f"{stats[k]:.2g}" for k in (*FIGURES, "router_mismatch_rate"))
            print(f"| {sigma:g} | {replay} | {cells} |")


if __name__ == "__main__":
    main()
