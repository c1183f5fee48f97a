"""The producer/consumer seam of the GRPO loop (trainer/grpo/producer.py): which weights
sample which step, when the engine is synced, and that nothing in flight is lost."""

from __future__ import annotations

import json

import pytest

from trainer.grpo.producer import RolloutProducer
from trainer.grpo.recipe import RunState
from trainer.grpo.rollout import LocalRequests, Rollout


class FakeEngine(LocalRequests):
    """An engine in this process whose rollouts say which weights sampled them (``version`` as
    the token); ``submit``/``collect`` are the in-process engines' own (``LocalRequests``)."""

    overlaps = False

    def __init__(self) -> None:
        self.version = None
        self.log: list[tuple] = []

    def generate(self, prompts, seeds):
        self.log.append(("generate", prompts[0][0], self.version))
        return [Rollout(i, [self.version], True, [-0.5]) for i, _ in enumerate(prompts)]

    def sync_weights(self, version) -> None:
        self.log.append(("sync", version))
        self.version = version


class FakeRemote(FakeEngine):
    """Engines elsewhere: ``submit`` then ``collect``, one request at a time (as
    ``RemoteRolloutEngine``, whose ``_send`` refuses anything else while one is in flight)."""

    overlaps = True

    def __init__(self) -> None:
        super().__init__()
        self.pending = None
        self.last_busy_s = self.last_idle_s = 0.0

    def submit(self, prompts, seeds) -> None:
        assert self.pending is None, "a second request while one is in flight"
        self.pending = (prompts, seeds)

    def collect(self):
        assert self.pending is not None
        out, self.pending = self.generate(*self.pending), None
        return out

    def sync_weights(self, version) -> None:
        assert self.pending is None, "a sync while the engine is generating"
        super().sync_weights(version)


def _producer(engine, async_steps, max_steps=4, version=0, resampling=False) -> RolloutProducer:
    def sync(v):
        engine.sync_weights(v)
        return 0.0

    def requests(step, round_):  # the engine logs the prompt: the step, or (step, round)
        return [[(step, round_) if round_ else step]], [[step]]

    producer = RolloutProducer(
        engine, requests, sync, async_steps, max_steps, resampling=resampling
    )
    producer.updated(version)
    return producer


def _run(producer: RolloutProducer, start: int, steps: int) -> list[tuple[int, int, int]]:
    """(step, version that sampled it, staleness) for each step; 'updates' the policy."""
    seen = []
    for step in range(start, steps):
        made = producer.take(step)
        assert made.rollouts[0].response_ids == [made.version]
        seen.append((step, made.version, made.staleness))
        producer.updated(step + 1)
    return seen


@pytest.mark.parametrize("engine_type", [FakeEngine, FakeRemote])
def test_on_policy_samples_each_step_with_its_own_weights(engine_type):
    engine = engine_type()
    assert _run(_producer(engine, 0), 0, 4) == [(0, 0, 0), (1, 1, 0), (2, 2, 0), (3, 3, 0)]
    # synced after every update, while idle: generate 0, sync 1, generate 1, …
    assert engine.log[:4] == [("sync", 0), ("generate", 0, 0), ("sync", 1), ("generate", 1, 1)]


def test_one_step_off_policy_samples_the_next_step_before_the_update():
    engine = FakeRemote()
    producer = _producer(engine, 1)
    seen = _run(producer, 0, 4)
    assert seen == [(0, 0, 0), (1, 0, 1), (2, 1, 1), (3, 2, 1)]
    # step 1 was submitted (with version 0) before step 0's update: the overlap
    assert engine.log[:4] == [("sync", 0), ("generate", 0, 0), ("generate", 1, 0), ("sync", 1)]
    assert engine.pending is None  # nothing started past the last step


def test_async_needs_nothing_but_one_request_in_flight():
    with pytest.raises(ValueError, match="async_steps=2"):
        _producer(FakeRemote(), 2)


def test_an_eval_drains_the_request_in_flight_and_the_step_gets_it_back():
    engine = FakeRemote()
    producer = _producer(engine, 1)
    producer.take(0)  # step 1 in flight, sampled by version 0
    producer.updated(1)
    ready = producer.ready_engine()
    assert ready is engine and engine.version == 1 and engine.pending is None
    made = producer.take(1)
    assert (made.step, made.version) == (1, 0)  # the batch sampled before the eval's sync
    assert producer.sync_reports() == [0.0, 0.0]  # start, eval


def test_what_is_in_flight_at_a_checkpoint_survives_a_resume():
    whole = _run(_producer(FakeRemote(), 1), 0, 4)

    engine = FakeRemote()
    producer = _producer(engine, 1)
    first = _run(producer, 0, 2)  # step 2 is in flight when the checkpoint is taken
    producer.drain()
    state = RunState(step=2, in_flight=producer.pending())
    saved = RunState.from_json(json.loads(json.dumps(state.to_json())))  # the checkpoint's JSON
    assert [batch.step for batch in saved.in_flight] == [2]

    resumed = _producer(FakeRemote(), 1, version=2)
    resumed.restore(saved.in_flight)
    assert first + _run(resumed, 2, 4) == whole


def test_pending_refuses_while_a_request_is_in_flight():
    producer = _producer(FakeRemote(), 1)
    producer.take(0)
    with pytest.raises(RuntimeError, match="drain"):
        producer.pending()


def test_a_failing_engine_surfaces_in_take():
    class Broken(FakeRemote):
        def collect(self):
            self.pending = None
            raise RuntimeError("rollout engine 0 failed: boom")

    producer = _producer(Broken(), 1)
    with pytest.raises(RuntimeError, match="boom"):
        producer.take(0)


def test_async_dynamic_sampling_resamples_before_the_next_step_starts():
    """``resampling``: the rounds of step s run on the idle engine with the policy's current
    weights, then ``start_next`` starts step s+1 (still one update stale)."""
    engine = FakeRemote()
    producer = _producer(engine, 1, resampling=True)
    seen = []
    for step in range(4):
        made = producer.take(step)
        assert engine.pending is None  # step + 1 not started: the engine is free for rounds
        extra = producer.resample(step, 1)
        assert (extra.step, extra.version) == (step, step)  # the policy's weights now
        producer.start_next(step)
        producer.start_next(step)  # a second call starts nothing
        seen.append((step, made.version, made.staleness))
        producer.updated(step + 1)
    # the same versions and staleness as without rounds
    assert seen == [(0, 0, 0), (1, 0, 1), (2, 1, 1), (3, 2, 1)]
    assert engine.log[:6] == [
        ("sync", 0),
        ("generate", 0, 0),
        ("generate", (0, 1), 0),  # step 0's round, before step 1 starts
        ("generate", 1, 0),
        ("sync", 1),  # step 1's round samples with the weights of step 0's update
        ("generate", (1, 1), 1),
    ]
    assert engine.pending is None  # nothing started past the last step


def test_on_policy_dynamic_sampling_resamples_with_the_steps_weights():
    engine = FakeEngine()
    producer = _producer(engine, 0, resampling=True)
    producer.take(0)
    assert producer.resample(0, 1).version == 0
    producer.start_next(0)  # on-policy: nothing to start
    assert engine.log == [("sync", 0), ("generate", 0, 0), ("generate", (0, 1), 0)]


def test_resampling_while_the_next_step_is_in_flight_is_refused():
    producer = _producer(FakeRemote(), 1)  # not built for resampling: take starts step 1
    producer.take(0)
    with pytest.raises(RuntimeError, match="resampling=True"):
        producer.resample(0, 1)
