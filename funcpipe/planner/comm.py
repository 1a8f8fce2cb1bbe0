"""Communication costs sized by bytes: ring collectives, all-to-alls and point-to-point messages.

A ring over ``n`` members moves ``(n - 1) / n`` of the buffer per member for an all-gather or a
reduce-scatter and twice that for an all-reduce, in ``n - 1`` (``2 (n - 1)``) steps of one
latency each, on the link the group uses (:meth:`funcpipe.planner.Cluster.link`). An all-to-all
(a pairwise exchange) sends ``(n - 1) / n`` of each member's buffer away, in ``n - 1`` rounds;
where the group spans nodes, the share bound for another node crosses the inter-node network
while the share for the node's other members takes NVLink at the same time
(:func:`all_to_all_nodes`).
"""

from __future__ import annotations

from funcpipe.planner.cluster import Link

__all__ = ["all_gather", "all_reduce", "all_to_all", "all_to_all_nodes", "p2p", "reduce_scatter"]


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


def all_to_all(nbytes: float, n: int, link: Link) -> float:
    """Seconds of an all-to-all in which each of ``n`` members holds ``nbytes``, ``1/n`` of it
    for each member (its own share stays): ``(n-1)/n`` bytes/bw + ``(n-1)`` latencies."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


def all_to_all_nodes(nbytes: float, n: int, per_node: int, intra: Link, inter: Link) -> float:
    """:func:`all_to_all` over ``n`` members of which ``per_node`` share each node: the
    ``(n - per_node) / n`` of the buffer bound for other nodes crosses ``inter`` while the
    ``(per_node - 1) / n`` for the node's other members takes ``intra``; the slower of the two,
    plus ``n - 1`` latencies of ``inter``. Within one node (``per_node >= n``) it is
    :func:`all_to_all` on ``intra``."""
    if per_node >= n:
        return all_to_all(nbytes, n, intra)
    if n <= 1 or nbytes <= 0:
        return 0.0
    remote = (n - per_node) / n * nbytes / inter.bandwidth
    local = (per_node - 1) / n * nbytes / intra.bandwidth
    return max(remote, local) + (n - 1) * inter.latency


def p2p(nbytes: float, link: Link) -> float:
    """Seconds of one point-to-point message of ``nbytes``."""
    if nbytes <= 0:
        return 0.0
    return link.latency + nbytes / link.bandwidth
