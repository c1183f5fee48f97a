"""core.seeds: one reproducible 63-bit seed per (run seed, step, prompt, sample)."""

from hypothesis import given
from hypothesis import strategies as st

from core.seeds import group_seeds, sample_seed

keys = st.one_of(st.integers(min_value=0, max_value=10**6), st.text(max_size=12))


@given(st.integers(min_value=0, max_value=2**32), keys, keys, st.integers(0, 64))
def test_seed_is_reproducible_and_fits_int64(run_seed, step, prompt, sample):
    seed = sample_seed(run_seed, step, prompt, sample)
    assert seed == sample_seed(run_seed, step, prompt, sample)
    assert 0 <= seed < 2**63


def test_no_two_samples_of_a_run_share_a_seed():
    """Every (step, prompt slot, sample) of a long run: no collision, and none of the
    ``seed + k`` overlaps (sample k of prompt p = sample k-1 of prompt p+1)."""
    seeds = [
        s for step in range(20) for group in group_seeds(42, step, range(32), 16) for s in group
    ]
    assert len(set(seeds)) == len(seeds) == 20 * 32 * 16
    assert sample_seed(42, 0, 0, 0) != sample_seed(43, 0, 0, 0)
    assert sample_seed(42, 0, "1", 0) != sample_seed(42, 0, 1, 0)  # keys keep their type
    assert group_seeds(42, 3, [5, 5], 2)[0] == group_seeds(42, 3, [5], 2)[0]
