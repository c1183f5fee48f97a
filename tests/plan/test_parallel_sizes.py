"""ParallelSizes holds the one set of divisibility rules; they are Megatron-Core's
(``parallel_state.initialize_model_parallel``): world = tp × pp × cp × dp for the dense grid and
world = etp × ep × expert-dp × pp for the expert grid."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from plan import ParallelSizes, ParallelSizesError


def test_a_size_below_one_is_refused_by_name():
    with pytest.raises(ParallelSizesError, match="ep=0 must be ≥ 1"):
        ParallelSizes(ep=0)
    with pytest.raises(ParallelSizesError, match="dp=0 must be ≥ 1"):
        ParallelSizes(dp=0)


def test_the_defaults_are_pure_data_parallelism():
    assert ParallelSizes().for_world(6) == ParallelSizes(dp=6)


@pytest.mark.parametrize(
    ("sizes", "world", "fragments"),
    [
        # the dense grid: 6 GPUs cannot hold TP 4
        (ParallelSizes(tp=4), 6, ["training_gpus 6", "tp × pp × cp = 4 × 1 × 1 = 4"]),
        # CP counts in the dense grid: TP 2 × CP 2 = 4 does not divide 6
        (ParallelSizes(tp=2, cp=2), 6, ["training_gpus 6", "tp × pp × cp = 2 × 1 × 2 = 4"]),
        # a given DP must be the quotient (8 / 2 = 4)
        (ParallelSizes(tp=2, dp=2), 8, ["dp=2", "training_gpus 8", "needs dp=4"]),
        # the expert grid: ETP 1 × EP 8 × PP 2 = 16 does not divide 8 (TP 1 × PP 2 does)
        (ParallelSizes(pp=2, ep=8), 8, ["training_gpus 8", "etp × ep × pp = 1 × 8 × 2 = 16"]),
        # ETP counts in the expert grid: 2 × 4 × 1 = 8 does not divide 4
        (ParallelSizes(tp=2, ep=4, etp=2), 4, ["etp × ep × pp = 2 × 4 × 1 = 8"]),
        (ParallelSizes(), 0, ["training_gpus 0 must be ≥ 1"]),
    ],
)
def test_each_rule_alone_names_the_size_and_the_world(sizes, world, fragments):
    (problem,) = sizes.problems(world, "training_gpus")
    for fragment in fragments:
        assert fragment in problem
    with pytest.raises(ParallelSizesError) as raised:
        sizes.for_world(world, "training_gpus")
    assert raised.value.problems == [problem]


def test_both_grids_are_reported_at_once():
    dense, expert = ParallelSizes(tp=8, ep=8).problems(12)
    assert "world size 12 is not a multiple of tp × pp × cp" in dense
    assert "world size 12 is not a multiple of etp × ep × pp" in expert


def test_verl_gpt_oss_layout_on_64_gpus():
    sizes = ParallelSizes(tp=8, pp=8, ep=8).for_world(64)
    assert sizes.dp == 1 and sizes.expert_data_parallel(64) == 1


def _megatron_core_accepts(tp, pp, ep, etp, cp, world):
    """Megatron-Core 0.19's own arithmetic (``initialize_model_parallel``): the two
    ``world_size % … != 0`` raises, restated without torch.distributed."""
    return world % (tp * pp * cp) == 0 and world % (etp * ep * pp) == 0


sizes_ = st.integers(1, 8)


@given(sizes_, sizes_, sizes_, sizes_, sizes_, st.integers(1, 128))
def test_the_rules_accept_exactly_what_megatron_core_accepts(tp, pp, ep, etp, cp, world):
    sizes = ParallelSizes(tp=tp, pp=pp, ep=ep, etp=etp, cp=cp)
    assert (not sizes.problems(world)) == _megatron_core_accepts(tp, pp, ep, etp, cp, world)
    if not sizes.problems(world):
        fitted = sizes.for_world(world)
        assert fitted.tp * fitted.pp * fitted.cp * fitted.dp == world
