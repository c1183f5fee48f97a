"""Sampling one token per row with the row's own random stream (Hugging Face engines).

A row's draws come from its own ``torch.Generator``, seeded by ``core.seeds.sample_seed``, so
what a response samples does not depend on which other rows share its batch: the draws of
row ``i`` at token ``t`` are the ``t``-th of its generator whatever the batch. (The logits
themselves are the batch's forward: with different padding or batch sizes they may differ in
the last bits, which can flip a near-tie; with the same batch the results are exact.)

The token is drawn by the exponential race ``argmax(p / E)``, ``E ~ Exp(1)`` i.i.d. per
vocabulary entry: the index that wins is distributed as ``multinomial(p)`` (as vLLM samples).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def row_generators(seeds: Sequence[int], device: torch.device | str) -> list[torch.Generator]:
    """One generator per row on ``device``, seeded with that row's seed."""
    return [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]


def exponential_noise(
    rows: int, vocab: int, generators: Sequence[torch.Generator] | None, device
) -> torch.Tensor:
    """``E ~ Exp(1)`` of shape ``(rows, vocab)``: row ``i`` from ``generators[i]``, or from the
    global generator when ``generators`` is None."""
    noise = torch.empty((rows, vocab), dtype=torch.float32, device=device)
    if generators is None:
        return noise.exponential_()
    if len(generators) != rows:
        raise ValueError(f"{len(generators)} generators for {rows} rows: give one per row")
    for row, generator in enumerate(generators):
        noise[row].exponential_(generator=generator)
    return noise


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    generators: Sequence[torch.Generator] | None = None,
) -> torch.Tensor:
    """One token per row from ``softmax(logits / temperature)``, nucleus-filtered to ``top_p``.

    Args:
        logits: ``(rows, vocab)``.
        temperature: > 0.
        top_p: Keep the smallest prefix of tokens (by probability) whose mass reaches it.
        generators: One per row (its own stream); None draws from the global generator.

    Returns:
        ``(rows,)`` token ids.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always the top token)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    noise = exponential_noise(probs.shape[0], probs.shape[1], generators, probs.device)
    return torch.argmax(probs / noise, dim=-1)


class PerRowSampler:
    """A ``transformers`` logits processor that samples each row with its own generator.

    Used with greedy ``generate`` (``do_sample=False``): it draws the row's token with
    ``sample_tokens`` and leaves only that token finite, so the greedy step picks it.
    """

    def __init__(
        self, temperature: float, top_p: float, generators: Sequence[torch.Generator]
    ) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.generators = list(generators)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        tokens = sample_tokens(scores, self.temperature, self.top_p, self.generators)
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(-1, tokens[:, None], 0.0)
