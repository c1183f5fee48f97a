"""The plan of a run: what shape it has, stated once, that every layer above reads.

Today it holds ``ParallelSizes`` (the one "layout": tp, pp, ep, etp, cp, dp) and the one set
of rules a world of processes must meet to hold them. It imports only ``core`` and
``cluster``'s machine facts.
"""

from plan.parallel_sizes import ParallelSizes, ParallelSizesError

__all__ = ["ParallelSizes", "ParallelSizesError"]
