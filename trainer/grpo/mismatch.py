"""How far the rollout engine's policy is from the trainer's, on every token of every step.

The engine records the log-prob of each token it samples (``Rollout.log_probs``: its own
kernels, precision and, on MoE models, its own expert routing); before the update the trainer
scores the same tokens (the proximal log-probs). Per response token, with the sign
convention of verl's rollout correction::

    d = log π_trainer(x_t) − log π_engine(x_t)

and per step, over every response token of every data-parallel replica:

- ``rollout_kl``: the token mean of ``k3 = exp(d) − 1 − d`` (``algorithm.kl_k3``, clamped
  to 10 per token), an unbiased, non-negative estimate of KL(π_engine ‖ π_trainer) from the
  engine's own samples (verl's ``rollout_corr/k3_kl``; NeMo-RL gates a similar
  ``gen_kl_error``);
- ``rollout_logprob_diff_p50`` / ``_p99`` / ``_max``: percentiles of ``|d|`` (from a
  histogram summed over the replicas, so N processes report what one does: 100 log-spaced
  bins a decade from 1e-9 to 1e3, each reported by its upper edge, ≤ 2.3% above the value);
- ``rollout_seq_beyond_mask_fraction``: the share of sequences whose geometric-mean ratio
  ``exp(mean_t d)`` is outside ``algorithm.seq_mask_low`` … ``seq_mask_high``: the sequences
  ``rollout_correction: seq_mask`` drops (or would drop).

``MismatchGate`` bounds ``rollout_kl`` against the run's own floor, as the sync check does
(``trainer.grpo.sync_check``), one floor per staleness (``rollout.async_steps``): the first step
measured at a staleness learns that staleness's floor, and later steps at it may reach
``factor × floor + max_mismatch_kl``; past it the run warns or stops
(``rollout.mismatch_action``). On-policy (staleness 0) the floor is kernel noise alone; one
update stale (every step but the first of an async run) ``d`` also holds the policy's own move
over one update, so its floor is learned apart, from the first stale step. Kernel noise and a
one-update lag are in their floors, so they alone never trip the gate; an engine that drifts,
or that samples with weights older than the update it is said to have (a sync skipped or
lost), does.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trainer.grpo.algorithm import kl_k3

log = logging.getLogger(__name__)

DECADES = (-9, 3)
BINS_PER_DECADE = 100
EDGES = torch.logspace(
    DECADES[0], DECADES[1], (DECADES[1] - DECADES[0]) * BINS_PER_DECADE + 1, dtype=torch.float64
)
"""Upper edges of the ``|d|`` histogram's bins (bin 0: at most 1e-9; one more past 1e3)."""


class RolloutMismatchError(RuntimeError):
    """The engine's rollouts drifted from the trainer's policy past the configured bound."""


@dataclass
class MismatchMeter:
    """Sums over the micro-batches of one step (``add``), reduced once over the replicas
    (``metrics``).

    Args:
        seq_mask_low: the masking bound's lower end on the geometric-mean ratio.
        seq_mask_high: … its upper end.
    """

    seq_mask_low: float
    seq_mask_high: float
    k3_sum: float = 0.0
    tokens: float = 0.0
    sequences: float = 0.0
    beyond: float = 0.0
    largest: float = 0.0
    histogram: torch.Tensor = field(
        default_factory=lambda: torch.zeros(len(EDGES) + 1, dtype=torch.float64)
    )

    @torch.no_grad()
    def add(self, trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> None:
        """One micro-batch: ``[B, T]`` trainer and engine log-probs of the same tokens, and
        the ``[B, T]`` response mask (every response token, kept groups or not)."""
        counted = mask.bool()
        trainer, engine = trainer.double().cpu(), engine.double().cpu()
        counted = counted.cpu()
        d = torch.where(counted, trainer - engine, torch.zeros_like(trainer))
        self.k3_sum += float((kl_k3(torch.zeros_like(d), d) * counted).sum())  # δ = d
        self.tokens += float(counted.sum())
        size = abs(d[counted])
        if size.numel():
            self.largest = max(self.largest, float(size.max()))
            self.histogram += torch.bincount(
                torch.bucketize(size, EDGES), minlength=len(EDGES) + 1
            ).double()
        tokens = counted.sum(-1)
        rows = tokens > 0
        mean = d.sum(-1)[rows] / tokens[rows]
        outside = (mean < math.log(self.seq_mask_low)) | (mean > math.log(self.seq_mask_high))
        self.sequences += float(rows.sum())
        self.beyond += float(outside.sum())

    def merge(self, other: MismatchMeter) -> None:
        """Add ``other``'s sums (a micro-batch measured elsewhere: the loss function of a
        backend that runs it on the last pipeline stage only returns it to every stage)."""
        self.k3_sum += other.k3_sum
        self.tokens += other.tokens
        self.sequences += other.sequences
        self.beyond += other.beyond
        self.largest = max(self.largest, other.largest)
        self.histogram += other.histogram

    def metrics(self, group=None, world: int = 1) -> dict[str, float]:
        """The step's metrics over the replicas of ``group`` (``world`` of them; one
        all-reduce of the sums, one of the largest ``|d|``); {} when nothing was added."""
        totals = torch.cat(
            [torch.tensor([self.k3_sum, self.tokens, self.sequences, self.beyond]), self.histogram]
        )
        largest = torch.tensor([self.largest], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(totals, group=group)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        k3_sum, tokens, sequences, beyond = totals[:4].tolist()
        if tokens == 0:
            return {}
        histogram = totals[4:]
        return {
            "rollout_kl": k3_sum / tokens,
            "rollout_logprob_diff_p50": _percentile(histogram, 0.50),
            "rollout_logprob_diff_p99": _percentile(histogram, 0.99),
            "rollout_logprob_diff_max": float(largest[0]),
            "rollout_seq_beyond_mask_fraction": beyond / max(sequences, 1.0),
        }


def _percentile(histogram: torch.Tensor, q: float) -> float:
    """The nearest-rank ``q`` quantile of the histogram's values: its bin's upper edge."""
    rank = max(1, math.ceil(q * float(histogram.sum())))
    index = int(torch.searchsorted(histogram.cumsum(0), torch.tensor(float(rank)).double()))
    return float(EDGES[index]) if index < len(EDGES) else math.inf


@dataclass
class MismatchGate:
    """``rollout.max_mismatch_kl`` against the run's own floor at each staleness.

    Args:
        max_mismatch_kl: what later steps may add to ``factor × floor`` (None: no gate; the
            metrics are logged all the same).
        factor: how many times their staleness's floor they may reach.
        action: ``warn`` (log and go on) or ``stop`` (raise ``RolloutMismatchError``).
        floors: staleness → floor, those already known (a resumed run;
            ``RunState.mismatch_floor`` and ``stale_mismatch_floor``).
    """

    max_mismatch_kl: float | None
    factor: float = 3.0
    action: str = "warn"
    floors: dict[int, float] = field(default_factory=dict)

    def bound(self, staleness: int = 0) -> float | None:
        """What a step at ``staleness`` may reach (None: no gate, or its floor not learned)."""
        floor = self.floors.get(staleness)
        if self.max_mismatch_kl is None or floor is None:
            return None
        return self.factor * floor + self.max_mismatch_kl

    def check(self, rollout_kl: float, step: int, staleness: int) -> bool:
        """Learn the floor of ``staleness`` from its first step, bound the later ones; True
        when ``rollout_kl`` is past the bound (and the action is ``warn``).

        Raises:
            RolloutMismatchError: past the bound with ``action="stop"``.
        """
        if staleness not in self.floors:
            self.floors[staleness] = rollout_kl
            return False
        bound = self.bound(staleness)
        if bound is None or rollout_kl <= bound:
            return False
        floor = self.floors[staleness]
        where = f"step {step}"
        if staleness:
            where += f" ({staleness} update(s) stale)"
            learned = f"its first step {staleness} update(s) stale"
            cause = (
                f"the engine samples with older weights than the {staleness} update(s) it is "
                "said to lag (a weight sync skipped or lost; see sync_logprob_max_diff), or "
                "from another policy than the one trained"
            )
        else:
            learned = "its first step"
            cause = "the engine samples from another policy than the one trained"
        message = (
            f"{where}: the rollout engine's log-probs of this step's response tokens are "
            f"{rollout_kl:.4g} nats per token (k3 KL, rollout_kl) from the trainer's, past the "
            f"bound {bound:.4g} ({self.factor:g} × the run's floor {floor:.4g}, learned at "
            f"{learned}, + rollout.max_mismatch_kl {self.max_mismatch_kl:g}): {cause} (a stale "
            "or scrambled layer after a sync, a lower-precision kernel, expert routing that "
            "flips; see router_mismatch_rate); try algorithm.rollout_correction seq_mask or "
            "seq_tis, or algorithm.router_replay: rollout on MoE models"
        )
        if self.action == "stop":
            raise RolloutMismatchError(message + ". The run stops here.")
        log.warning("%s", message)
        return True
