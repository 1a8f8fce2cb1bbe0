"""What the schedule generators share: argument checks, placements and program assembly.

Private to the ``gen_*`` modules; :mod:`funcpipe.schedule.generators` re-exports the public names
(:func:`placement_loop`, :func:`placement_v`).

Cost units used in every generator docstring: F, B (input gradient), W (weight gradient) are the
per-stage costs, a full backward costs B + W, and "the simulator" means
:func:`funcpipe.schedule.simulate.simulate` with its default ``Costs()`` (F = B = W = 1,
comm = 0). Peak activations count (stage, microbatch) pairs alive on a rank, as
:func:`funcpipe.schedule.simulate.peak_activations` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from funcpipe.errors import InvalidArgument
from funcpipe.schedule.ir import Instr, Program, keep_groups

__all__ = ["placement_loop", "placement_v"]


def check_int(fn: str, name: str, value: object, *, least: int = 1, rule: str = "") -> int:
    """``value`` itself when it is an int >= ``least`` (a bool is not), else InvalidArgument.

    The message names the function, the argument and its value, then ``rule`` (default: the
    bound itself).
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        rule = rule or f"{name} must be a whole number (int) >= {least}"
        raise InvalidArgument(f"{fn}: {name}={value!r}; {rule}")
    return value


def check_bool(fn: str, name: str, value: object) -> bool:
    """``value`` itself when it is a bool, else InvalidArgument naming ``fn`` and ``name``."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"{fn}: {name}={value!r}; pass True or False")
    return value


def check_sizes(fn: str, ranks: object, microbatches: object) -> tuple[int, int]:
    """The common ``ranks`` (>= 1) and ``microbatches`` (>= 1) options."""
    return check_int(fn, "ranks", ranks), check_int(fn, "microbatches", microbatches)


def placement_loop(ranks: int, chunks: int) -> tuple[int, ...]:
    """Loop placement: ``ranks * chunks`` stages, stage ``s`` on rank ``s % ranks``.

    Rank ``r`` holds stages ``r, r + ranks, r + 2 * ranks, ...`` (one per chunk).
    """
    p = check_int("placement_loop", "ranks", ranks)
    v = check_int("placement_loop", "chunks", chunks)
    return tuple(s % p for s in range(p * v))


def placement_v(ranks: int) -> tuple[int, ...]:
    """V placement: ``2 * ranks`` stages; stage ``s`` on rank ``s`` for ``s < ranks``, else on
    rank ``2 * ranks - 1 - s``.

    Rank ``r`` holds stages ``r`` and ``2 * ranks - 1 - r``, so rank 0 holds the first and the
    last stage.
    """
    p = check_int("placement_v", "ranks", ranks)
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))


def only_microbatches(ranks: Iterable[Iterable[Instr]], microbatches: int) -> list[list[Instr]]:
    """Drop every instruction of a microbatch >= ``microbatches``.

    Generators use it to run a schedule written for more microbatches (one that needs, say,
    ``m >= 2p``) with fewer. That is always sound: per-rank orders without a dependency cycle
    keep none when instructions are removed, since what remains keeps its order on every rank,
    and no remaining instruction depends on a removed microbatch. A pair that loses a half
    leaves the other to run alone.
    """
    return [
        list(keep_groups(list(instrs), lambda i: i.microbatch < microbatches)) for instrs in ranks
    ]


def build(
    name: str,
    ranks: Iterable[Iterable[Instr]],
    placement: Sequence[int],
    microbatches: int,
    *,
    training: bool = True,
    edges: Sequence[tuple[int, int]] | None = None,
    entries: Sequence[int] | None = None,
    replica_of: Sequence[int] | None = None,
) -> Program:
    """A :class:`Program` from per-rank instruction lists."""
    return Program(
        ranks=tuple(tuple(r) for r in ranks),
        placement=tuple(placement),
        microbatches=microbatches,
        edges=None if edges is None else tuple(edges),
        training=training,
        name=name,
        entries=None if entries is None else tuple(entries),
        replica_of=None if replica_of is None else tuple(replica_of),
    )
