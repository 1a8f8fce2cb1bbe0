"""Classic schedules: GPipe, 1F1B, interleaved 1F1B, looped BFS, and forward-only programs.

Numbers in the docstrings are what :func:`funcpipe.schedule.simulate.simulate` measures with its
default costs (F = B = W = 1 per stage, so a full backward costs 2; comm = 0); the tests pin them.
``p`` is ``ranks``, ``m`` ``microbatches``, ``v`` ``chunks``; rank ``r`` counts from 0.
"""

from __future__ import annotations

from funcpipe.errors import InvalidArgument
from funcpipe.schedule.gen_common import build, check_int, check_sizes, placement_loop, placement_v
from funcpipe.schedule.ir import (
    COMM_OPS,
    GRAD,
    Instr,
    Op,
    Program,
    backward,
    forward,
    keep_groups,
)

__all__ = [
    "forward_only",
    "gpipe",
    "interleave_groups",
    "interleaved_1f1b",
    "looped_bfs",
    "one_f_one_b",
    "to_eval",
]


def gpipe(*, ranks: int, microbatches: int) -> Program:
    """GPipe (fill-drain): every rank runs all its forwards, then all its backwards.

    Stage ``r`` on rank ``r``; forwards and full backwards both in microbatch order.

    - makespan ``(m + p - 1)(F + B + W)``; bubble fraction ``(p - 1) / (m + p - 1)``.
    - peak activations ``m`` on every rank.
    """
    p, m = check_sizes("gpipe", ranks, microbatches)
    program = [
        [forward(r, k) for k in range(m)] + [backward(r, k) for k in range(m)] for r in range(p)
    ]
    return build("gpipe", program, placement_loop(p, 1), m)


def one_f_one_b(*, ranks: int, microbatches: int) -> Program:
    """1F1B (PipeDream-flush / Megatron): warm-up forwards, then one forward one backward.

    Rank ``r`` runs ``w = min(p - 1 - r, m)`` warm-up forwards, then ``m - w`` pairs
    (forward of microbatch ``w + i``, full backward of microbatch ``i``), then the last ``w``
    backwards. Stage ``r`` on rank ``r``.

    - makespan ``(m + p - 1)(F + B + W)`` for every ``m``; bubble fraction
      ``(p - 1) / (m + p - 1)``, as GPipe.
    - peak activations ``min(p - r, m)`` on rank ``r`` (``min(p, m)`` on rank 0).
    """
    p, m = check_sizes("one_f_one_b", ranks, microbatches)
    program = []
    for r in range(p):
        w = min(p - 1 - r, m)
        ops = [forward(r, k) for k in range(w)]
        for i in range(m - w):
            ops += [forward(r, w + i), backward(r, i)]
        ops += [backward(r, k) for k in range(m - w, m)]
        program.append(ops)
    return build("1f1b", program, placement_loop(p, 1), m)


def interleave_groups(ranks: int, microbatches: int) -> tuple[int, ...]:
    """The microbatch groups of :func:`interleaved_1f1b`: sizes, in order, summing to ``m``.

    ``m < p``: one group of ``m``. Otherwise ``m // p`` groups as equal as possible, the larger
    ones first, so every group holds between ``p`` and ``2p - 1`` microbatches (exactly ``p``
    each when ``p`` divides ``m``: Megatron's grouping).
    """
    p, m = check_sizes("interleave_groups", ranks, microbatches)
    if m < p:
        return (m,)
    k = m // p
    size, extra = divmod(m, k)
    return (size + 1,) * extra + (size,) * (k - extra)


def interleaved_1f1b(*, ranks: int, microbatches: int, chunks: int) -> Program:
    """Interleaved 1F1B (Megatron-LM virtual pipeline): ``v = chunks`` stages per rank.

    Loop placement: ``N = p * v`` stages, stage ``s`` on rank ``s % p``. Microbatches are cut
    into groups (:func:`interleave_groups`): ``m // p`` groups of sizes as equal as possible,
    larger first, each of ``p`` to ``2p - 1`` microbatches (``p`` each when ``p`` divides ``m``,
    as in Megatron); ``m < p`` makes one group of ``m``. Every rank runs its forwards group by
    group, and within a group chunk by chunk (chunk 0 of every microbatch of the group, then
    chunk 1, ...); its backwards in the same groups with the chunks reversed. Rank ``r`` starts
    with ``w = min((v - 1) * g0 + 2 * (p - 1 - r), m * v)`` warm-up forwards (``g0`` the first
    group's size), then alternates one forward and one full backward, then drains the backwards.
    The larger groups come first because a group larger than the first would put a backward
    ahead of its own forward on the last rank.

    Requires ``chunks >= 2`` (use :func:`one_f_one_b` for one chunk per rank); any ``m >= 1``.

    - ``m >= p`` (not only multiples of ``p``): makespan ``(m * v + p - 1)(F + B + W)`` in
      chunk-stage costs, i.e. an idle time of ``(p - 1)(F + B + W) / v`` per rank in
      full-stage costs; bubble fraction ``(p - 1) / (m * v + p - 1)``.
    - ``m < p``: correct but not optimal (one short group; ranks wait for each other).
    - peak activations on rank ``r``: ``min((v - 1) * g0 + 2 * (p - 1 - r) + 1, m * v)``
      chunk-stage activations; for ``p | m`` that is ``(v + 1) * p - 1`` on rank 0, i.e.
      ``p + (p - 1) / v`` full-stage activations.
    """
    p, m = check_sizes("interleaved_1f1b", ranks, microbatches)
    v = check_int(
        "interleaved_1f1b",
        "chunks",
        chunks,
        least=2,
        rule="interleaving needs chunks >= 2 (use one_f_one_b for one chunk per rank)",
    )
    groups = interleave_groups(p, m)
    fwd: list[tuple[int, int]] = []  # (chunk, microbatch) in a rank's forward order
    bwd: list[tuple[int, int]] = []
    first = 0
    for g in groups:
        for c in range(v):
            fwd += [(c, first + k) for k in range(g)]
        for c in reversed(range(v)):
            bwd += [(c, first + k) for k in range(g)]
        first += g
    n = m * v
    program = []
    for r in range(p):
        w = min((v - 1) * groups[0] + 2 * (p - 1 - r), n)
        fs = [forward(c * p + r, k) for c, k in fwd]
        bs = [backward(c * p + r, k) for c, k in bwd]
        ops = fs[:w]
        for i in range(n - w):
            ops += [fs[w + i], bs[i]]
        ops += bs[n - w :]
        program.append(ops)
    return build("interleaved", program, placement_loop(p, v), m)


def looped_bfs(*, ranks: int, microbatches: int, chunks: int) -> Program:
    """Looped breadth-first (BFS) pipeline: ``v = chunks`` stages per rank, loop placement.

    Each rank runs the forward of every microbatch on its first chunk, then on its next chunk,
    ...; then the backwards chunk by chunk in reverse chunk order, each chunk's microbatches in
    reverse order (the last forward is the first backward). ``chunks=1`` is a GPipe variant.

    - makespan ``(m * v + p - 1)(F + B + W)`` for ``m >= p``; bubble fraction
      ``(p - 1) / (m * v + p - 1)``, as interleaved 1F1B, at a higher memory cost.
    - peak activations ``m * v`` on every rank (every chunk's activations of every microbatch).
    """
    p, m = check_sizes("looped_bfs", ranks, microbatches)
    v = check_int("looped_bfs", "chunks", chunks)
    program = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        ops = [forward(s, k) for s in stages for k in range(m)]
        ops += [backward(s, k) for s in reversed(stages) for k in reversed(range(m))]
        program.append(ops)
    return build("looped-bfs", program, placement_loop(p, v), m)


def forward_only(
    *, ranks: int, microbatches: int, chunks: int | None = None, placement: str = "loop"
) -> Program:
    """A forward-only (evaluation, ``training=False``) program.

    ``placement="loop"`` (stage ``s`` on rank ``s % p``, ``chunks`` stages per rank, default 1)
    or ``placement="v"`` (:func:`~funcpipe.schedule.generators.placement_v`; ``chunks`` must be
    2, the default there). Every rank runs the forward of every microbatch on its first chunk,
    then on its next chunk (breadth first), which is optimal here: makespan
    ``(v - 1) * max(m, p) + m + p - 1`` (loop) and ``2m + 2p - 2`` (V: the last rank runs
    ``2m`` forwards from time ``p - 1`` and the last of them has ``p - 1`` stages still to go) in
    units of F.
    Nothing is kept for a backward, so peak activations are 1 per rank.
    """
    p, m = check_sizes("forward_only", ranks, microbatches)
    if not isinstance(placement, str) or placement.lower() not in ("loop", "v"):
        raise InvalidArgument(
            f"forward_only: placement={placement!r}; use 'loop' (stage s on rank s % ranks) or "
            "'v' (two chunks per rank in a V)"
        )
    kind = placement.lower()
    if kind == "v":
        v = 2 if chunks is None else check_int("forward_only", "chunks", chunks)
        if v != 2:
            raise InvalidArgument(
                f"forward_only: chunks={chunks!r} with placement='v'; the V placement holds "
                "exactly 2 chunks per rank (pass chunks=2 or leave it unset, or use "
                "placement='loop')"
            )
        stage_rank = placement_v(p)
    else:
        v = 1 if chunks is None else check_int("forward_only", "chunks", chunks)
        stage_rank = placement_loop(p, v)
    program = []
    for r in range(p):
        stages = [s for s, owner in enumerate(stage_rank) if owner == r]
        program.append([forward(s, k) for s in stages for k in range(m)])
    return build("forward", program, stage_rank, m, training=False)


def _keeps(i: Instr) -> bool:
    if i.op is Op.F:
        return True
    return i.op in COMM_OPS and i.kind != GRAD


def to_eval(program: Program) -> Program:
    """The forward-only (evaluation) version of ``program``.

    Drops every B, I, W, R and REDUCE (and, in a lowered program, the gradient SEND/RECV), keeps
    the forwards (and activation messages) in their order, and sets ``training=False``. Sound
    for every sound program, V-shaped ones included: removing instructions cannot create a
    dependency cycle and a forward depends only on forwards.
    """
    if not isinstance(program, Program):
        raise InvalidArgument(
            f"to_eval takes a funcpipe.schedule.ir.Program, got {type(program).__name__}; build "
            "one with a generator (e.g. one_f_one_b) or parse_program(text)"
        )
    ranks = tuple(keep_groups(instrs, _keeps) for instrs in program.ranks)
    return program.replace(ranks=ranks, training=False)
