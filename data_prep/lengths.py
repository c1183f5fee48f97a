"""Length statistics for the dataset card, in memory that does not grow with the row count.

A :class:`LengthHistogram` counts how many rows have each length. Lengths are bounded by
``max_field_chars``, so the histogram holds at most that many entries whatever the number of
rows, and gives exactly what numpy gives on the full list of lengths: ``mean`` equals
``np.mean``, ``percentile(q)`` equals ``np.percentile(values, q)`` (its default ``linear``
method, re-done here with the same float64 operations), ``max`` equals ``np.max``.
"""

from __future__ import annotations

import math


class LengthHistogram:
    """Counts of lengths (non-negative integers), with the statistics the card shows."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def add(self, length: int) -> None:
        self.counts[length] = self.counts.get(length, 0) + 1

    def __len__(self) -> int:
        """How many lengths were added."""
        return sum(self.counts.values())

    @property
    def max(self) -> int:
        return max(self.counts)

    def mean(self) -> float:
        # numpy sums integers exactly in float64 (all partial sums < 2**53) and divides once
        return sum(value * n for value, n in self.counts.items()) / len(self)

    def percentile(self, q: float) -> float:
        """``np.percentile(values, q)`` with the default ``linear`` method."""
        n = len(self)
        virtual = (n - 1) * (q / 100)
        if virtual >= n - 1:
            return float(self.max)
        below = math.floor(virtual)
        a, b = self._sorted_at(below), self._sorted_at(below + 1)
        gamma = virtual - below
        # numpy's _lerp: from the nearer end, so the result is exact at gamma 0 and 1
        return b - (b - a) * (1 - gamma) if gamma >= 0.5 else a + (b - a) * gamma

    def _sorted_at(self, position: int) -> int:
        """The value at ``position`` (0-based) of the sorted lengths."""
        seen = 0
        for value in sorted(self.counts):
            seen += self.counts[value]
            if seen > position:
                return value
        raise IndexError(position)
