"""The producer half of the GRPO loop: each step's rollouts, made now or one step ahead.

The loop (``trainer.grpo.recipe``) is a consumer: for every step it takes that step's
rollouts from a ``RolloutProducer``, scores them and updates the policy, then tells the
producer the policy moved on (``updated``). How far the producer may run ahead is the only
difference between the on-policy loop and the one-step off-policy one
(``rollout.async_steps``):

- ``async_steps=0``: ``take(s)`` generates step ``s`` with the policy's current weights
  (version ``s``, the number of updates they have had); after the update, ``updated(s+1)``
  pushes the new weights to the engine while it is idle.
- ``async_steps=1``: ``take(s)`` collects step ``s``'s rollouts (started during step
  ``s-1``, with version ``s-1``), pushes version ``s`` to the now idle engine and starts
  step ``s+1`` before it returns, so the engine samples step ``s+1`` while the trainer
  trains on step ``s``. Each batch is one update stale; the loss corrects it with the
  behaviour log-probs the engine recorded (``algorithm.decoupled_policy_loss``).

Overlap needs an engine in other processes that can work while this one trains: one with
``submit``/``collect`` (``trainer.grpo.remote.RemoteRolloutEngine``). Any other engine runs
a submitted request when it is collected.

Dynamic sampling (``algorithm.dynamic_sampling``, ``trainer.grpo.dynamic_sampling``) may ask
for more rollouts of the step just taken (``resample``: fresh prompts, generated at once on the
idle engine with the policy's current weights). The producer is then built with
``resampling=True``: ``take`` does not start step ``s+1``, ``start_next`` does, after the
resampling, so the rounds never wait behind the next step's generation and the overlap with
the update stays whole.

A request in flight is never lost: the eval and the checkpoint ``drain`` it (collect it to
a buffer), and the checkpoint keeps the buffer (``pending``/``restore``), so a resumed run
trains on the same rollouts as an uninterrupted one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from trainer.grpo.rollout import Rollout
from trainer.grpo.sync_check import SyncReport

Requests = Callable[[int, int], tuple[list[list[int]], list[list[int]]]]
"""(step, round) → (the prompts this process's engine generates, one seed list per prompt);
round 0 is the step's own prompts, round ``k`` ≥ 1 dynamic sampling's ``k``-th fresh draw."""


@dataclass
class StepRollouts:
    """One step's rollouts and how they were made."""

    step: int
    version: int
    """Updates the sampling weights had had: ``step - version`` is the batch's staleness."""
    rollouts: list[Rollout]
    generate_s: float
    """The engine's seconds generating them."""
    wait_s: float = 0.0
    """The trainer's seconds blocked until they were ready."""
    engine_idle_s: float | None = None
    """Seconds the engine had waited for this request (engines in other processes)."""

    @property
    def staleness(self) -> int:
        return self.step - self.version

    def timing_metrics(self, tokens: float, train_time: float, step_time: float) -> dict:
        """Where the step's time went, on each side. ``rollout_time_s``: the engine
        generating this step's batch; ``rollout_wait_s``: the trainer blocked waiting for it
        (the whole generation when on-policy, what the overlap did not hide when async);
        ``rollout_idle_s``: the engine waiting for work before it (engines in other
        processes); ``tokens_per_s``: ``tokens`` (the step's response tokens, every rank's)
        over the step's time."""
        out = {
            "staleness": self.staleness,
            "rollout_time_s": self.generate_s,
            "rollout_wait_s": self.wait_s,
            "train_time_s": train_time,
            "step_time_s": step_time,
            "tokens_per_s": tokens / max(1e-9, step_time),
        }
        if self.engine_idle_s is not None:
            out["rollout_idle_s"] = self.engine_idle_s
        return out

    def to_json(self) -> dict:
        return {**asdict(self), "rollouts": [r.to_json() for r in self.rollouts]}

    @classmethod
    def from_json(cls, data: dict) -> StepRollouts:
        rollouts = [Rollout.from_json(r) for r in data["rollouts"]]
        return cls(**{**data, "rollouts": rollouts})


class RolloutProducer:
    """Each step's rollouts for the GRPO loop, on-policy or ``async_steps`` = 1 ahead.

    Args:
        engine: the rollout engine (``submit``/``collect``: the request runs elsewhere and
            overlaps, or in ``collect``, here).
        requests: (step, round) → this process's prompts and seeds for that step (round 0)
            or for that round of its dynamic sampling.
        select: turns what the engine returned into this process's rollouts (e.g. the share
            of a data-parallel rank when several ranks drive one engine); identity if None.
        sync: pushes the policy's current weights (the version it is given) into the engine
            and checks them; returns the sync check's report (None when the engine is the
            policy).
        async_steps: 0 (on-policy) or 1 (the engine samples step s+1 while s trains).
        max_steps: the run's last step (nothing is started past it).
        version: the policy's version the engine holds at start (None: unknown, synced on
            first use).
        resampling: dynamic sampling may ``resample`` a step after ``take``: with
            ``async_steps`` = 1 the next step starts in ``start_next``, not in ``take``.
    """

    def __init__(
        self,
        engine,
        requests: Requests,
        sync: Callable[[int], SyncReport | None],
        async_steps: int,
        max_steps: int,
        select: Callable[[list[Rollout]], list[Rollout]] | None = None,
        version: int | None = None,
        resampling: bool = False,
    ) -> None:
        if async_steps not in (0, 1):
            raise ValueError(f"async_steps={async_steps}: 0 (on-policy) or 1 (one step ahead)")
        self.engine = engine
        self.requests = requests
        self.select = select or (lambda rollouts: rollouts)
        self._sync = sync
        self.async_steps = async_steps
        self.max_steps = max_steps
        self.engine_version = version
        self.policy_version = version
        self.resampling = resampling
        self._in_flight: tuple[int, int] | None = None
        """(step, version) of the request the engine is working on."""
        self._ready: dict[int, StepRollouts] = {}
        self._sync_reports: list[SyncReport] = []

    def take(self, step: int) -> StepRollouts:
        """Step ``step``'s rollouts: the ones drained or in flight, else generated now with
        the policy's weights; with ``async_steps`` = 1, step ``step + 1`` is started (with
        the policy's weights as they are now) before this returns, or, when ``resampling``,
        by ``start_next``."""
        batch = self._ready.pop(step, None)
        if batch is None and self._in_flight is not None and self._in_flight[0] == step:
            batch = self._collect()
        if batch is None:
            self._submit(step)
            batch = self._collect()
        if not self.resampling:
            self.start_next(step)
        return batch

    def resample(self, step: int, round_: int) -> StepRollouts:
        """Round ``round_`` (≥ 1) of ``step``'s dynamic sampling: its fresh prompts generated
        now, on the idle engine, with the policy's current weights (the step's version
        on-policy; one update newer than the step's batch when it is stale).

        Raises:
            RuntimeError: a request is in flight (the producer was not built with
                ``resampling``, or ``start_next`` already ran).
        """
        if self._in_flight is not None:
            raise RuntimeError(
                f"step {step}: resampling needs the idle engine, but step {self._in_flight[0]} "
                "is in flight: build the producer with resampling=True and resample before "
                "start_next"
            )
        self._submit(step, round_)
        return self._collect()

    def start_next(self, step: int) -> None:
        """With ``async_steps`` = 1, start step ``step + 1`` (with the policy's weights as
        they are now) unless it is started, ready, or past the last step; else nothing."""
        following = step + 1
        started = self._in_flight is not None and self._in_flight[0] == following
        if not self.async_steps or following >= self.max_steps or started:
            return
        if following not in self._ready:
            self._submit(following)

    def updated(self, version: int) -> None:
        """The policy is now at ``version``: an idle engine takes its weights now, a busy one
        before its next request."""
        self.policy_version = version
        if self._in_flight is None and not self.async_steps:
            self._bring_up_to_date()

    def ready_engine(self):
        """The engine, idle and holding the policy's current weights (for an evaluation):
        a request in flight is collected to the buffer first, and ``take`` returns it."""
        self.drain()
        self._bring_up_to_date()
        return self.engine

    def drain(self) -> None:
        """Collect the request in flight, if any, into the buffer."""
        if self._in_flight is not None:
            batch = self._collect()
            self._ready[batch.step] = batch

    def pending(self) -> list[StepRollouts]:
        """The drained batches not yet taken (for the checkpoint: ``RunState.in_flight``);
        call ``drain`` first."""
        if self._in_flight is not None:
            raise RuntimeError("a request is in flight: drain() before saving what is pending")
        return [self._ready[step] for step in sorted(self._ready)]

    def restore(self, pending: Sequence[StepRollouts]) -> None:
        """Put back what ``pending`` saved (on resume)."""
        for batch in pending:
            self._ready[batch.step] = batch

    def sync_reports(self) -> list[SyncReport]:
        """The sync checks' reports since the last call."""
        out, self._sync_reports = self._sync_reports, []
        return out

    def _bring_up_to_date(self) -> None:
        if self.engine_version != self.policy_version:
            report = self._sync(self.policy_version)
            if report is not None:
                self._sync_reports.append(report)
            self.engine_version = self.policy_version

    def _submit(self, step: int, round_: int = 0) -> None:
        self._bring_up_to_date()
        self.engine.submit(*self.requests(step, round_))
        self._in_flight = (step, self.engine_version)

    def _collect(self) -> StepRollouts:
        step, version = self._in_flight
        waiting = time.monotonic()
        rollouts = self.engine.collect()
        busy, idle = self.engine.last_busy_s, self.engine.last_idle_s
        self._in_flight = None
        wait = time.monotonic() - waiting
        return StepRollouts(step, version, self.select(rollouts), busy, wait, idle)
