"""The weight sync of an engine that does not share the policy's module: the policy's weights
streamed into the engine by name, then checked (``sync_check``: the engine's and the
policy's log-probs of a fixed probe, compared over every process and engine copy)."""

from __future__ import annotations

import logging
import time

from trainer.backends import TrainingBackend
from trainer.distributed import DistInfo, all_reduce_max
from trainer.grpo.micro_batch import sequences
from trainer.grpo.prompts import Prompt
from trainer.grpo.rollout import HFRolloutEngine, Rollout, RolloutEngine
from trainer.grpo.sync_check import (
    SyncBudget,
    SyncCheck,
    SyncGap,
    SyncProbe,
    SyncReport,
    sync_gap,
    worst,
)

log = logging.getLogger(__name__)


def sync_engine(
    engine: RolloutEngine,
    backend: TrainingBackend,
    probe: SyncProbe,
    check: SyncCheck,
    pad_id: int,
    info: DistInfo,
    step: int,
    budget: SyncBudget | None = None,
    adapter_only: bool = False,
) -> SyncReport | None:
    """Push the policy's weights (version ``step``) to an engine that does not share them
    (streamed by name; ``adapter_only``, LoRA GRPO: only the adapter's tensors, the one part
    the update changes, into an engine serving the same frozen base + adapter), then check
    that it took them: the engine's and the policy's log-probs of ``probe``, compared over
    all processes and engines (None: the engine is the policy, nothing to sync). Its time
    is held against ``budget`` (warned once when over).

    Before the first sync of a run that starts from the SFT model (``step`` 0) the engine
    holds the weights the policy loaded: that difference is the check's noise floor. A
    resumed run brings its floor back from the checkpoint (``RunState.sync_floor``).

    Raises:
        WeightSyncError: the floor, or the difference after the sync, is past its bound.
    """
    if isinstance(engine, HFRolloutEngine) and engine.model is backend.unwrapped():
        return None
    name = type(engine).__name__
    if check.floor is None and step == 0:
        check.learn_floor(probe_gap(engine, backend, probe, pad_id, info), name)
    started = time.monotonic()
    weights = backend.hf_weights(trainable_only=True) if adapter_only else backend.hf_weights()
    sent = engine.sync_weights(weights)
    seconds = time.monotonic() - started
    gap = probe_gap(engine, backend, probe, pad_id, info)
    if check.floor is None:  # resumed from a checkpoint written before floors were kept
        log.warning(
            "no sync-check noise floor in the checkpoint: taking the difference after this "
            "sync (step %d) as the floor, so this sync is checked only against its ceiling",
            step,
        )
        check.learn_floor(gap, name)
    check.check(gap, step, name)
    budget_s = None
    if budget is not None and info.rank == 0:
        budget.observe(seconds, step)
        budget_s = budget.budget_s
    return SyncReport(gap, check.floor, sent, seconds, budget_s)


def probe_gap(
    engine: RolloutEngine, backend: TrainingBackend, probe: SyncProbe, pad_id: int, info: DistInfo
) -> SyncGap:
    """The engine's and the policy's log-probs of ``probe``, compared token by token: each
    statistic's worst over the copies of the weights the engine serves and the processes.
    Both are of the raw logits (temperature 1), whatever ``rollout.temperature``: the check
    is of the weights, and the probe's scores do not depend on how the engine samples."""
    policy: list[float] = []
    served: list[list[float]] | None = None
    for text in probe.texts:
        micro = sequences(
            [Prompt(text.prompt, "", "")],
            [Rollout(0, text.response, True)],
            pad_id,
            backend.data_parallel.device,
            temperature=1.0,  # raw logits, as the engine's token_log_probs: the weights alone
        )
        policy += backend.log_probs([micro])[0][0, -len(text.response) :].float().tolist()
        scores = engine.token_log_probs_per_engine(text.prompt, text.response)
        served = scores if served is None else [a + b for a, b in zip(served, scores, strict=True)]
    local = worst(sync_gap(s, policy) for s in served)
    return SyncGap(
        all_reduce_max(local.mean, info),
        all_reduce_max(local.p95, info),
        all_reduce_max(local.max, info),
        local.tokens,
    )
