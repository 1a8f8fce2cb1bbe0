"""Communication costs sized by bytes: ring collectives and point-to-point messages.

A ring over ``n`` members moves ``(n - 1) / n`` of the buffer per member for an all-gather or a
reduce-scatter and twice that for an all-reduce, in ``n - 1`` (``2 (n - 1)``) steps of one
latency each, on the link the group uses (:meth:`funcpipe.planner.Cluster.link`).
"""

from __future__ import annotations

from funcpipe.planner.cluster import Link

__all__ = ["all_gather", "all_reduce", "p2p", "reduce_scatter"]


def all_reduce(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over ``n`` members: ``2 (n-1)/n`` bytes/bw."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def reduce_scatter(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a ring reduce-scatter of ``nbytes`` (the whole buffer) over ``n`` members."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


def all_gather(nbytes: float, n: int, link: Link) -> float:
    """Seconds of a ring all-gather producing ``nbytes`` on each of ``n`` members."""
    return reduce_scatter(nbytes, n, link)


def p2p(nbytes: float, link: Link) -> float:
    """Seconds of one point-to-point message of ``nbytes``."""
    if nbytes <= 0:
        return 0.0
    return link.latency + nbytes / link.bandwidth
