"""Log-probabilities and entropy of logits (optionally tempered), in row chunks, and the
clamp every log-ratio takes before ``exp``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to ±this before ``exp`` so one wild token cannot overflow."""


def _over_row_chunks(
    fn: Callable[[Tensor], Tensor], logits: Tensor, chunk_rows: int, temperature: float = 1.0
) -> Tensor:
    """Apply ``fn`` (``[n, V] -> [n]``) to row chunks of ``logits`` upcast to >= float32 and
    divided by ``temperature`` (not at all at 1: the raw logits, bit for bit)."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive int, got {chunk_rows}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    dtype = torch.promote_types(logits.dtype, torch.float32)
    rows = logits.reshape(-1, logits.shape[-1])
    parts = [fn(_tempered(chunk.to(dtype), temperature)) for chunk in rows.split(chunk_rows)]
    out = torch.cat(parts) if parts else rows.new_zeros(0, dtype=dtype)
    return out.reshape(logits.shape[:-1])


def _entropy_rows(logits: Tensor) -> Tensor:
    shifted = logits - logits.amax(-1, keepdim=True).detach()
    probs = torch.softmax(shifted, -1)
    # -inf logits have zero probability; zero them so 0·(-inf) does not make NaN.
    finite = shifted.masked_fill(probs == 0, 0.0)
    return torch.logsumexp(shifted, -1) - (probs * finite).sum(-1)


def _tempered(logits: Tensor, temperature: float) -> Tensor:
    """``logits / temperature``; the logits themselves at 1 (no rounding, no copy)."""
    return logits if temperature == 1.0 else logits / temperature


def entropy_from_logits(
    logits: Tensor, *, temperature: float = 1.0, chunk_rows: int = 1024
) -> Tensor:
    """Entropy of the tempered softmax: ``H = logsumexp(z) - Σ_v softmax(z)_v · z_v``,
    ``z = logits / temperature``.

    ``z`` is shifted by its (detached) max, which leaves ``H`` unchanged and avoids
    cancellation between two large numbers. Computed in float32 (or float64) a chunk of rows
    at a time, so a bfloat16 ``[B, T, V]`` is never upcast (or divided) whole in the forward
    pass.

    Args:
        logits: ``[..., T, V]``.
        temperature: the sampling temperature the distribution is of (> 0; 1: raw logits).
        chunk_rows: rows (tokens) per chunk.

    Returns:
        ``[..., T]`` entropies in nats.
    """
    return _over_row_chunks(_entropy_rows, logits, chunk_rows, temperature)


def token_log_probs(
    logits: Tensor, token_ids: Tensor, *, temperature: float = 1.0, chunk_rows: int = 1024
) -> Tensor:
    """Log-probabilities of the given tokens under the tempered softmax:
    ``log p(x_t) = z_{x_t} - logsumexp(z)``, ``z = logits / temperature``.

    The policy a rollout engine samples from at temperature ``T`` is ``softmax(logits / T)``;
    its log-probs (the importance ratio's, the KL's, the mismatch's) are these with the same
    ``T``, as verl's and OpenRLHF's actors divide the logits by the rollout temperature.
    Gathers the chosen logit and subtracts a per-row logsumexp computed a chunk of rows at a
    time in float32, so no ``[..., T, V]`` log-softmax (or divided copy) is materialized.

    Args:
        logits: ``[..., T, V]`` (any float dtype).
        token_ids: ``[..., T]`` integer ids in ``[0, V)``.
        temperature: > 0; 1 (the default) is the raw logits, computed exactly as without it.
        chunk_rows: rows (tokens) per logsumexp chunk.

    Returns:
        ``[..., T]`` log-probs in float32 (float64 for float64 logits).

    Raises:
        ValueError: ``token_ids`` shape is not ``logits.shape[:-1]`` or not integer, or
            ``temperature`` is not > 0.
    """
    if token_ids.shape != logits.shape[:-1] or token_ids.dtype.is_floating_point:
        raise ValueError(
            f"token_ids must be integer with shape {tuple(logits.shape[:-1])} (logits without "
            f"the vocab dim), got {token_ids.dtype} {tuple(token_ids.shape)}"
        )
    chosen = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
    normalizer = _over_row_chunks(
        lambda rows: torch.logsumexp(rows, -1), logits, chunk_rows, temperature
    )
    return _tempered(chosen.to(normalizer.dtype), temperature) - normalizer
