"""Chimera (Li & Hoefler, SC'21): two pipelines over the same ranks in opposite directions."""

from __future__ import annotations

from funcpipe.schedule.gen_common import build, check_sizes, placement_v
from funcpipe.schedule.ir import Instr, Program, backward, forward

__all__ = ["chimera"]


def chimera(*, ranks: int, microbatches: int) -> Program:
    """Chimera: a down pipeline and an up pipeline, each 1F1B-like, merged on every rank.

    ``2p`` stages: ``0 .. p-1`` form the down pipeline (stage ``j`` on rank ``j``) and
    ``p .. 2p-1`` the up pipeline (stage ``p + j`` on rank ``p - 1 - j``), so the placement is
    :func:`~funcpipe.schedule.generators.placement_v` but there is no edge ``p-1 -> p``: the
    ``edges`` are the two chains, both ``p - 1`` and ``2p - 1`` are sinks (each computes the
    loss), and ``replica_of[p + j] = j`` (every rank holds two replicas, whose gradients are
    summed). Even microbatches enter the down pipeline (``entries[k] = 0``), odd ones the up
    pipeline (``entries[k] = p``); any ``ranks >= 1`` and ``microbatches >= 1`` work (an odd
    ``m`` gives the down pipeline one more; ``m = 1`` leaves the up pipeline idle).

    Order of work, as in the paper: each pipeline runs 1F1B-like on its microbatches, injecting
    one every two slots, and the two are merged. In slot units (the paper's model, forward =
    full backward): the ``i``-th microbatch of a pipeline runs its forward at pipeline position
    ``j`` in slot ``2i + j`` and its backward in slot ``2i + 2p - 1 - j``. Every rank runs its
    work in slot order, a backward first and the down pipeline first when slots tie. For an even
    ``p`` and ``m <= p`` no two pieces of work ever share a rank's slot (the paper's
    conflict-free merge).

    Measured, ``p`` even, ``m`` even and ``>= p``:

    - the paper's cost model (``Costs(f=1, b=0.5, w=0.5)``: forward = full backward = 1):
      makespan ``2m + p - 2``, bubble fraction ``(p - 2) / (2m + p - 2)``, the paper's formula
      (Chimera's ``p - 2`` bubbles against 1F1B's ``2(p - 1)``).
    - default costs (full backward = 2 F): makespan ``3m + 2(p - 2)``, bubble fraction
      ``2(p - 2) / (3m + 2(p - 2))`` (1F1B: ``3(p - 1)`` idle per rank). Never slower than 1F1B,
      for any ``p`` and ``m``.
    - peak activations ``<= p`` on every rank (``p + 1`` for an odd ``p``); for ``m = p``, rank
      ``r`` holds ``p/2 + 1 + min(r, p - 1 - r)``: from ``p/2 + 1`` to ``p``, as in the paper.
    """
    p, m = check_sizes("chimera", ranks, microbatches)
    work: list[list[tuple[int, int, int, Instr]]] = [[] for _ in range(p)]
    for k in range(m):
        up = k % 2
        i = k // 2
        for j in range(p):  # position in its pipeline
            rank, stage = (p - 1 - j, p + j) if up else (j, j)
            work[rank].append((2 * i + j, 1, up, forward(stage, k)))
            work[rank].append((2 * i + 2 * p - 1 - j, 0, up, backward(stage, k)))
    program = [[item[3] for item in sorted(items, key=lambda x: x[:3])] for items in work]
    edges = [(s, s + 1) for s in range(p - 1)] + [(p + s, p + s + 1) for s in range(p - 1)]
    return build(
        "chimera",
        program,
        placement_v(p),
        m,
        edges=edges,
        entries=[p if k % 2 else 0 for k in range(m)],
        replica_of=[s % p for s in range(2 * p)],
    )
