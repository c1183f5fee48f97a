"""Measured memory of a training step, to hold the planner's estimate against.

On CPU, torch's profiler (``profile_memory=True``) records every allocation and free of
torch's CPU allocator with the allocator's running total; its maximum over a step is the
step's peak of tensor memory above what existed before. tracemalloc does not see torch's
allocator, and the process RSS of a small step moves more with glibc's caching than with the
step. On CUDA, ``torch.cuda.max_memory_allocated`` gives the same quantity directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by ``tensors`` (their elements, not their storage's spare room)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def cpu_allocator_peak(step: Callable[[], None]) -> int:
    """Run ``step`` under the profiler; return torch's CPU allocator peak above its start.

    Raises:
        RuntimeError: the profiler recorded no allocation (nothing to measure).
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        step()
    peak = 0
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        total = getattr(event.extra_fields, "total_allocated", None)
        if total is not None:
            peak = max(peak, total)
    if peak <= 0:
        raise RuntimeError("the profiler recorded no allocations")
    return peak
