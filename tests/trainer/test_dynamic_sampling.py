"""DAPO's dynamic sampling (trainer/grpo/dynamic_sampling.py) with scripted rounds: which slots
are refilled from which fresh groups, the counts it logs (checked by hand), the cap, and the
fresh prompts each round draws (trainer/grpo/prompts.py)."""

from __future__ import annotations

import pytest
import torch
from mlflow.utils.validation import _validate_metric_name
from pydantic import ValidationError

from trainer.backends import DataParallel
from trainer.grpo import algorithm as algo
from trainer.grpo.config import DynamicSamplingConfig, GRPOConfig
from trainer.grpo.dynamic_sampling import fill_signal_groups, refill_plan, slot_signal
from trainer.grpo.prompts import Prompt, resample_prompts, step_prompts
from trainer.grpo.rollout import Rollout
from trainer.grpo.update import Batch
from trainer.progress import progress_object

ONE = DataParallel(0, 1, torch.device("cpu"))
ON = DynamicSamplingConfig(enabled=True, max_resample_rounds=3)


def _batch(name: str, rewards: list[list[float]]) -> Batch:
    """One group per slot, ``rewards[slot]`` its responses'; each rollout's one token and its
    result say where it came from (``name``, slot, sample)."""
    prompts = [Prompt([slot], "fr", f"{name}{slot}") for slot in range(len(rewards))]
    rollouts, results = [], []
    for slot, group in enumerate(rewards):
        for k in range(len(group)):
            rollouts.append(Rollout(slot, [100 * slot + k], True))
            results.append(f"{name}{slot}.{k}")
    flat = torch.tensor([r for group in rewards for r in group])
    groups = torch.tensor([r.prompt_index for r in rollouts])
    stats = algo.group_stats(flat, groups)
    keep = (~stats.all_equal[stats.index]).float()
    return Batch(prompts, rollouts, flat, algo.grpo_advantages(flat, groups), keep, results)


class Rounds:
    """The scripted rounds: round ``k`` gives ``batches[k - 1]``; the rounds asked for."""

    def __init__(self, *batches: Batch) -> None:
        self.batches = batches
        self.asked: list[int] = []

    def __call__(self, k: int) -> Batch:
        self.asked.append(k)
        return self.batches[k - 1]


STEP = [[1.0, 0.0], [2.0, 2.0], [3.0, 3.0], [0.0, 1.0]]  # slots 1 and 2 carry no signal
ROUND_1 = [[5.0, 5.0], [1.0, 2.0], [4.0, 4.0], [7.0, 7.0]]  # one group with signal (1)
ROUND_2 = [[0.0, 0.0], [0.0, 0.0], [9.0, 8.0], [2.0, 3.0]]  # two (2 and 3): one is surplus


def test_refill_plan_pairs_the_slots_without_signal_with_fresh_groups_in_order():
    assert refill_plan([True, False, False, True, False], [False, True, True]) == {1: 1, 2: 2}
    assert refill_plan([False, True], [True, True]) == {0: 0}  # surplus dropped
    assert refill_plan([True, True], [True]) == {}
    assert slot_signal(_batch("s", STEP)) == [True, False, False, True]


def test_rounds_refill_every_slot_without_signal_and_count_by_hand():
    rounds = Rounds(_batch("r1-", ROUND_1), _batch("r2-", ROUND_2))
    batch, metrics = fill_signal_groups(ON, _batch("s", STEP), rounds, ONE)
    assert rounds.asked == [1, 2]  # after round 2 every slot has signal: no round 3
    # slot 1 <- round 1's group 1; slot 2 <- round 2's group 2 (its group 3 is surplus)
    assert [p.text for p in batch.prompts] == ["s0", "r1-1", "r2-2", "s3"]
    assert batch.rewards.tolist() == [1.0, 0.0, 1.0, 2.0, 9.0, 8.0, 0.0, 1.0]
    assert batch.results == ["s0.0", "s0.1", "r1-1.0", "r1-1.1", "r2-2.0", "r2-2.1", "s3.0", "s3.1"]
    assert [r.prompt_index for r in batch.rollouts] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [r.response_ids for r in batch.rollouts][2:6] == [[100], [101], [200], [201]]
    # a group moves with its own advantages: a gap of 1 is ±½ around the mean, over the
    # unbiased std √½: ±½ / (√½ + 1e-6) ≈ ±0.7071
    a = 0.5 / (0.5**0.5 + 1e-6)
    torch.testing.assert_close(batch.advantages, torch.tensor([a, -a, -a, a, a, -a, -a, a]))
    assert batch.keep.tolist() == [1.0] * 8
    # sampled: 4 + 4 + 4; with signal: 2 (the step's) + 1 + 2; refilled: slots 1 and 2
    assert metrics == {
        "dynamic_sampling/rounds": 2.0,
        "dynamic_sampling/sampled_groups": 12.0,
        "dynamic_sampling/signal_groups": 5.0,
        "dynamic_sampling/signal_rate": pytest.approx(5 / 12),
        "dynamic_sampling/refilled_groups": 2.0,
        "dynamic_sampling/unfilled_groups": 0.0,
        "dynamic_sampling/resample_s": pytest.approx(metrics["dynamic_sampling/resample_s"]),
    }
    assert metrics["dynamic_sampling/resample_s"] >= 0


def test_the_cap_leaves_the_slots_it_could_not_fill_without_signal():
    capped = DynamicSamplingConfig(enabled=True, max_resample_rounds=1)
    rounds = Rounds(_batch("r1-", ROUND_1), _batch("r2-", ROUND_2))
    batch, metrics = fill_signal_groups(capped, _batch("s", STEP), rounds, ONE)
    assert rounds.asked == [1]
    assert [p.text for p in batch.prompts] == ["s0", "r1-1", "s2", "s3"]
    assert batch.keep.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]  # slot 2: none
    assert metrics["dynamic_sampling/rounds"] == 1.0
    assert metrics["dynamic_sampling/sampled_groups"] == 8.0
    assert metrics["dynamic_sampling/signal_groups"] == 3.0
    assert metrics["dynamic_sampling/refilled_groups"] == 1.0
    assert metrics["dynamic_sampling/unfilled_groups"] == 1.0


def test_a_batch_full_of_signal_samples_no_round_and_off_changes_nothing():
    full = _batch("s", [[1.0, 0.0], [0.0, 2.0]])
    rounds = Rounds()
    batch, metrics = fill_signal_groups(ON, full, rounds, ONE)
    assert batch is full and rounds.asked == []
    assert metrics["dynamic_sampling/rounds"] == 0.0
    assert metrics["dynamic_sampling/signal_rate"] == 1.0
    step = _batch("s", STEP)
    assert fill_signal_groups(DynamicSamplingConfig(), step, rounds, ONE) == (step, {})
    assert rounds.asked == []


def test_the_metric_names_are_valid_for_mlflow_and_leave_the_progress_object_alone():
    once = DynamicSamplingConfig(enabled=True, max_resample_rounds=1)
    _, metrics = fill_signal_groups(once, _batch("s", STEP), Rounds(_batch("r", ROUND_1)), ONE)
    for name in metrics:
        _validate_metric_name(name)  # raises on a name MLflow refuses
    line = {"step": 3, "max_steps": 10, "epoch": 0.3, "wall_time_s": 12.0, "loss": 0.5}
    assert progress_object({**line, **metrics}, 1.0) == progress_object(line, 1.0)


def _prompts(n: int, weights=None) -> list[Prompt]:
    return [Prompt([i], "fr", f"p{i}", (weights or [1.0] * n)[i]) for i in range(n)]


def test_each_round_draws_fresh_prompts_the_same_way_every_time():
    prompts = _prompts(40)
    own = set(step_prompts(prompts, 5, 4, seed=7))
    first = resample_prompts(prompts, 5, 1, 4, seed=7)
    second = resample_prompts(prompts, 5, 2, 4, seed=7)
    assert len(set(first)) == len(set(second)) == 4
    assert not own & set(first) and not (own | set(first)) & set(second)
    assert resample_prompts(prompts, 5, 2, 4, seed=7) == second  # a resumed run draws the same
    assert resample_prompts(prompts, 6, 1, 4, seed=7) != first
    # too few prompts left: the step's own are still avoided while others remain …
    few = _prompts(10)
    mine = set(step_prompts(few, 0, 4, seed=1))
    assert not mine & set(resample_prompts(few, 0, 2, 4, seed=1))
    # … and a set no larger than a step is drawn from whole
    assert sorted(resample_prompts(_prompts(4), 0, 1, 4, seed=1)) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="rounds count from 1"):
        resample_prompts(prompts, 5, 0, 4, seed=7)


def test_heavier_prompts_are_drawn_more_often():
    prompts = _prompts(20, [30.0] + [1.0] * 19)
    free = [step for step in range(400) if 0 not in step_prompts(prompts, step, 2, seed=3)]
    drawn = sum(0 in resample_prompts(prompts, step, 1, 2, seed=3) for step in free)
    # 2 drawn of the 18 the step left: uniformly 0.11 of the rounds; by weight (30 against
    # 17 × 1) 30/47 + 17/47 × 30/46 = 0.87
    assert len(free) > 20 and drawn / len(free) > 0.7


def test_the_config_section():
    cfg = GRPOConfig.model_validate(
        {"algorithm": {"dynamic_sampling": {"enabled": True, "max_resample_rounds": 5}}}
    )
    assert cfg.algorithm.dynamic_sampling == DynamicSamplingConfig(
        enabled=True, max_resample_rounds=5
    )
    assert not GRPOConfig().algorithm.dynamic_sampling.enabled  # off by default
    with pytest.raises(ValidationError, match="max_resample_rounds"):
        GRPOConfig.model_validate({"algorithm": {"dynamic_sampling": {"max_resample_rounds": 0}}})
    with pytest.raises(ValidationError, match="max_rounds"):
        GRPOConfig.model_validate({"algorithm": {"dynamic_sampling": {"max_rounds": 2}}})
