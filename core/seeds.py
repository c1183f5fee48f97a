"""One seed per sampled response: ``(run seed, step, prompt, sample) → 63-bit int``.

Every response the eval or a GRPO rollout samples has its own random stream, derived from
where it sits in the run, not from the batch it happens to be in. Two samples never share a
stream (the same prompt twice in a step, sample ``k`` of two prompts), and a rerun with the
same run seed draws the same streams. vLLM and OpenAI-compatible endpoints take the seed per
request; the Hugging Face engines seed one ``torch.Generator`` per row (``generation.sampling``).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

SEED_BITS = 63
"""Seeds fit a signed 64-bit integer (vLLM's and OpenAI's ``seed`` field, torch generators)."""


def sample_seed(run_seed: int, step: int | str, prompt: int | str, sample: int) -> int:
    """The seed of sample ``sample`` of prompt ``prompt`` at ``step`` of the run ``run_seed``.

    ``seed = blake2b-64(json([run_seed, step, prompt, sample])) >> 1``: a hash, so nearby
    inputs give unrelated seeds (``seed + k`` schemes make sample ``k`` of one prompt and
    sample ``k - 1`` of the next share a stream).

    Args:
        run_seed: The run's seed (``GRPOConfig.seed``, ``SamplingSettings.seed``).
        step: The training step, or a name for a fixed set of draws (``"held-out"``,
            ``"eval"``).
        prompt: Identifies the prompt within the step: its slot in the step's batch (GRPO),
            or the question id (eval). Two slots holding the same prompt get different seeds.
        sample: Index of the response within the prompt's group.

    Returns:
        An integer in ``[0, 2**63)``.
    """
    key = json.dumps([run_seed, step, prompt, sample]).encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)


def group_seeds(
    run_seed: int, step: int | str, prompts: Sequence[int | str], n: int
) -> list[list[int]]:
    """``n`` seeds for each prompt key: ``[[sample_seed(run_seed, step, p, k) for k] for p]``."""
    return [[sample_seed(run_seed, step, p, k) for k in range(n)] for p in prompts]
