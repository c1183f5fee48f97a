"""The planner's vocabulary: byte ranges, named terms, resources with a verdict."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, TypeVar

MIB = 1024**2
GIB = 1024**3

# Verdict thresholds: "tight" once the expected total passes this share of the capacity.
TIGHT_SHARE = 0.9


def format_count(value: float) -> str:
    """Parameters as ``20.91B`` or ``1.42M``."""
    return f"{value / 1e9:.2f}B" if value >= 1e8 else f"{value / 1e6:.2f}M"


def format_bytes(value: float) -> str:
    """Bytes as ``234 GiB``, ``9.7 GiB`` or ``43 MiB``."""
    if value >= 10 * GIB:
        return f"{value / GIB:.0f} GiB"
    if value >= GIB:
        return f"{value / GIB:.1f} GiB"
    return f"{value / MIB:.0f} MiB"


@dataclass(frozen=True)
class Bounds:
    """A quantity in bytes with a low, expected and high estimate (low ≤ expected ≤ high)."""

    low: float
    expected: float
    high: float

    def __post_init__(self) -> None:
        if not self.low <= self.expected <= self.high:
            raise ValueError(f"bounds out of order: {self.low} ≤ {self.expected} ≤ {self.high}")

    @classmethod
    def exact(cls, value: float) -> Bounds:
        """A quantity known exactly."""
        return cls(value, value, value)

    @classmethod
    def spread(cls, expected: float, low_factor: float, high_factor: float) -> Bounds:
        """``expected`` with ``low = expected·low_factor`` and ``high = expected·high_factor``."""
        return cls(expected * low_factor, expected, expected * high_factor)

    def __add__(self, other: Bounds) -> Bounds:
        return Bounds(self.low + other.low, self.expected + other.expected, self.high + other.high)

    def __mul__(self, factor: float) -> Bounds:
        if factor < 0:
            raise ValueError("bounds can only be scaled by a non-negative factor")
        return Bounds(self.low * factor, self.expected * factor, self.high * factor)

    __rmul__ = __mul__

    def maximum(self, other: Bounds) -> Bounds:
        """The larger of two quantities that never live at the same time, bound by bound."""
        return Bounds(
            max(self.low, other.low), max(self.expected, other.expected), max(self.high, other.high)
        )

    def __truediv__(self, divisor: float) -> Bounds:
        return self * (1.0 / divisor)


ZERO = Bounds.exact(0.0)


@dataclass(frozen=True)
class Term:
    """One named contribution to a resource.

    Attributes:
        key: stable identifier (``"optimizer_offload"``) for code and tests.
        label: what the table prints.
        bytes: its size.
        advice: what shrinks it, shown when the resource is tight or does not fit.
    """

    key: str
    label: str
    bytes: Bounds
    advice: str | None = None


class Verdict(StrEnum):
    """Whether a resource holds what the layout asks of it."""

    FITS = "fits"
    TIGHT = "tight"
    DOES_NOT_FIT = "does not fit"


def verdict_for(total: Bounds, capacity: float) -> Verdict:
    """Judge a total against a capacity.

    Does not fit when the expected total exceeds the capacity; tight when the high bound
    does, or the expected total uses more than ``TIGHT_SHARE`` of it; fits otherwise.

    Args:
        total: the resource's summed terms.
        capacity: bytes available.

    Returns:
        The verdict.
    """
    if total.expected > capacity:
        return Verdict.DOES_NOT_FIT
    if total.high > capacity or total.expected > TIGHT_SHARE * capacity:
        return Verdict.TIGHT
    return Verdict.FITS


def sum_terms(terms: Iterable[Term]) -> Bounds:
    """The sum of ``terms``' bytes (``ZERO`` for none)."""
    total = ZERO
    for term in terms:
        total = total + term.bytes
    return total


class _HasKey(Protocol):
    key: str


Keyed = TypeVar("Keyed", bound=_HasKey)


def find_keyed(items: Sequence[Keyed], key: str, what: str, owner: str = "") -> Keyed:
    """The item of ``items`` (terms, resources) whose ``key`` is ``key``.

    Raises:
        KeyError: none is; the message names ``owner`` (when given), ``what`` and the keys.
    """
    for item in items:
        if item.key == key:
            return item
    prefix = f"{owner} has " if owner else ""
    raise KeyError(f"{prefix}no {what} {key!r}; {what}s: {[i.key for i in items]}")


@dataclass(frozen=True)
class Resource:
    """A resource (a GPU, a node's RAM, the volume) with its terms and verdict.

    Attributes:
        key: stable identifier (``"training_gpu"``, ``"host_node0"``, ``"storage"`` ...).
        label: what the table prints.
        capacity: bytes available.
        terms: the contributions.
        verdict: fits / tight / does not fit.
        advice: what to change, when it does not simply fit.
        detail: one extra line for the table (e.g. KV-cache capacity).
    """

    key: str
    label: str
    capacity: float
    terms: tuple[Term, ...]
    verdict: Verdict
    advice: tuple[str, ...] = ()
    detail: str = ""

    @property
    def total(self) -> Bounds:
        """The sum of the terms."""
        return sum_terms(self.terms)

    def term(self, key: str) -> Term:
        """Return the term named ``key``.

        Raises:
            KeyError: no such term in this resource.
        """
        return find_keyed(self.terms, key, "term", self.key)


def advice_for(
    terms: tuple[Term, ...] | list[Term], verdict: Verdict, limit: int = 3
) -> tuple[str, ...]:
    """Collect the advice of the largest terms, when the verdict calls for any.

    Args:
        terms: a resource's terms.
        verdict: its verdict.
        limit: most pieces of advice to return.

    Returns:
        Advice of the biggest contributors first, without repeats; empty when it fits.
    """
    if verdict is Verdict.FITS:
        return ()
    advice: list[str] = []
    for term in sorted(terms, key=lambda t: t.bytes.expected, reverse=True):
        if term.advice and term.advice not in advice and term.bytes.expected > 0:
            advice.append(term.advice)
    return tuple(advice[:limit])
