"""The scheduling problem :func:`funcpipe.schedule.auto.auto` and its exact refinement
(:mod:`funcpipe.schedule.exact`) both solve, and the compact instructions they order.

Internally an instruction is a tuple ``(op, stage, microbatch)`` with the op codes
:data:`OP_F`, :data:`OP_I`, :data:`OP_W`, :data:`OP_B` (``OPS[op]`` is its :class:`Op`); an
:data:`Order` is each rank's instructions in order. The heuristic builds a :class:`Problem`
from the user's arguments and hands it to the solver; the solver returns an :data:`Order`.
"""

from __future__ import annotations

from dataclasses import dataclass

from funcpipe.schedule.ir import Op

__all__ = ["OPS", "OP_B", "OP_F", "OP_I", "OP_W", "Order", "Problem"]

OP_F, OP_I, OP_W, OP_B = 0, 1, 2, 3
OPS = (Op.F, Op.I, Op.W, Op.B)
Order = list[list[tuple[int, int, int]]]  # per rank, the instructions in order


@dataclass(frozen=True)
class Problem:
    """One scheduling problem: ``p`` ranks, ``m`` microbatches, ``v`` stages per rank placed
    by ``placement`` (``kind`` "loop" or "v"), per-stage costs ``f``, ``b`` (I), ``w``, ``full``
    (B) and the message latency ``comm``, and each rank's memory ``cap``."""

    p: int
    m: int
    v: int
    kind: str  # "loop" or "v"
    placement: tuple[int, ...]
    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    comm: float
    cap: tuple[float, ...]  # per rank: activations (weight 1 each) or bytes (``weights``)
    full: tuple[float, ...] = ()  # a full backward B per stage (b + w unless measured)
    # what one F of each stage holds until its I (1 each: peak_activations' unit; bytes with
    # auto(max_memory=...): max(activation, for_w)), and what stays from its I to its W
    # (1 each; bytes: for_w). A B frees the weight.
    weights: tuple[float, ...] = ()
    kept: tuple[float, ...] = ()

    def weight(self, s: int) -> float:
        return self.weights[s] if self.weights else 1.0

    def after_i(self, s: int) -> float:
        return self.kept[s] if self.kept else 1.0

    @property
    def n(self) -> int:
        return len(self.placement)

    def local(self, r: int) -> tuple[int, ...]:
        return tuple(s for s, q in enumerate(self.placement) if q == r)

    def hops(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Latency of stage s's output to s + 1, and of its input gradient to s - 1."""
        place, n, c = self.placement, self.n, self.comm
        down = tuple(c if s + 1 < n and place[s] != place[s + 1] else 0.0 for s in range(n))
        up = tuple(c if s > 0 and place[s] != place[s - 1] else 0.0 for s in range(n))
        return down, up
