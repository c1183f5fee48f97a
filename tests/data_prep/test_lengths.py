"""The card's length statistics from a histogram equal numpy's on the full list of lengths."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from data_prep.lengths import LengthHistogram


@given(st.lists(st.one_of(st.integers(0, 40), st.integers(0, 32_000)), min_size=1, max_size=300))
def test_histogram_statistics_equal_numpys(lengths):
    histogram = LengthHistogram()
    for length in lengths:
        histogram.add(length)
    values = np.array(lengths, dtype=np.uint32)  # as the arrays the card used to read
    assert len(histogram) == len(lengths)
    assert histogram.mean() == values.mean()
    assert histogram.max == values.max()
    for q in (0, 5, 25, 50, 90, 95, 99, 100):
        assert histogram.percentile(q) == np.percentile(values, q), q
    # and as the card prints them
    assert f"{histogram.percentile(95):.0f}" == f"{np.percentile(values, 95):.0f}"
