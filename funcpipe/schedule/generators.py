"""Schedule generators: pure functions from sizes to compute-only programs.

Every generator takes keyword-only options, checks them up front (raising
:class:`~funcpipe.errors.InvalidArgument` that names the argument, its value, the rule and the
fix) and returns a *compute-only* :class:`~funcpipe.schedule.ir.Program` (F/B/I/W only; the
lowering passes in :mod:`funcpipe.schedule.passes` add SEND/RECV) whose ``name`` is its registry
name. Each docstring states the bubble and peak activations the simulator measures with its
default costs (F = B = W = 1); the tests pin those numbers.

===============  ========================  ================================================
registry name    function                  what it is
===============  ========================  ================================================
``gpipe``        :func:`gpipe`             fill-drain
``1f1b``         :func:`one_f_one_b`       warm-up, one forward one backward, drain
``interleaved``  :func:`interleaved_1f1b`  Megatron's interleaved 1F1B, ``chunks`` per rank
``looped-bfs``   :func:`looped_bfs`        breadth-first over ``chunks`` per rank
``zb-h1``        :func:`zb_h1`             zero bubble, 1F1B's memory
``zb-h2``        :func:`zb_h2`             zero bubble, ``2p - 1`` activations
``zbv``          :func:`zbv`               zero bubble, two chunks per rank in a V
``dualpipev``    :func:`dualpipe_v`        DeepSeek's DualPipe folded into a V
``chimera``      :func:`chimera`           two pipelines in opposite directions
``forward``      :func:`forward_only`      evaluation (forward only)
===============  ========================  ================================================

:func:`generate` dispatches by name; :data:`CONSTRAINTS` states each generator's rules.
"""

from __future__ import annotations

from collections.abc import Callable

from funcpipe.errors import InvalidArgument
from funcpipe.schedule.gen_chimera import chimera
from funcpipe.schedule.gen_classic import (
    forward_only,
    gpipe,
    interleave_groups,
    interleaved_1f1b,
    looped_bfs,
    one_f_one_b,
    to_eval,
)
from funcpipe.schedule.gen_common import check_bool, placement_loop, placement_v
from funcpipe.schedule.gen_zero_bubble import dualpipe_v, zb_h1, zb_h2, zbv
from funcpipe.schedule.ir import Program
from funcpipe.schedule.overlap import overlap as overlap_pass

__all__ = [
    "CHUNKS",
    "CONSTRAINTS",
    "GENERATORS",
    "chimera",
    "dualpipe_v",
    "forward_only",
    "generate",
    "gpipe",
    "interleave_groups",
    "interleaved_1f1b",
    "looped_bfs",
    "one_f_one_b",
    "placement_loop",
    "placement_v",
    "to_eval",
    "zb_h1",
    "zb_h2",
    "zbv",
]

Generator = Callable[..., Program]

GENERATORS: dict[str, Generator] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "looped-bfs": looped_bfs,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "zbv": zbv,
    "dualpipev": dualpipe_v,
    "chimera": chimera,
    "forward": forward_only,
}
"""Registry name -> generator. Every generator takes ``ranks=`` and ``microbatches=``; those
named in :data:`CHUNKS` with ``None`` also take ``chunks=``."""

CHUNKS: dict[str, int | None] = {
    "gpipe": 1,
    "1f1b": 1,
    "interleaved": None,
    "looped-bfs": None,
    "zb-h1": 1,
    "zb-h2": 1,
    "zbv": 2,
    "dualpipev": 2,
    "chimera": 2,
    "forward": None,
}
"""Stages per rank each generator fixes (``None``: it takes ``chunks=``)."""

_DEFAULT_CHUNKS: dict[str, int | None] = {"interleaved": 2, "looped-bfs": 2, "forward": None}

CONSTRAINTS: dict[str, str] = {
    "gpipe": "ranks >= 1, microbatches >= 1; one stage per rank",
    "1f1b": "ranks >= 1, microbatches >= 1; one stage per rank",
    "interleaved": (
        "ranks >= 1, microbatches >= 1, chunks >= 2 (default 2); loop placement "
        "(stage s on rank s % ranks); microbatches in microbatches // ranks groups of ranks "
        "to 2*ranks-1 (one group when microbatches < ranks); the closed-form bubble holds "
        "for microbatches >= ranks"
    ),
    "looped-bfs": "ranks >= 1, microbatches >= 1, chunks >= 1 (default 2); loop placement",
    "zb-h1": "ranks >= 1, microbatches >= 1; one stage per rank; backward split into I and W",
    "zb-h2": "ranks >= 1, microbatches >= 1; one stage per rank; zero bubble for "
    "microbatches >= 2*ranks - 1",
    "zbv": "ranks >= 1, microbatches >= 1; 2 chunks per rank, V placement; zero bubble for "
    "microbatches >= 2*ranks - 1",
    "dualpipev": "ranks >= 1, microbatches >= 1; 2 chunks per rank, V placement; full "
    "overlap for microbatches >= 2*ranks",
    "chimera": "ranks >= 1, microbatches >= 1; 2 stages per rank (a down and an up "
    "pipeline); even microbatches go down, odd ones up; paper's bubble for even ranks and "
    "even microbatches >= ranks",
    "forward": "ranks >= 1, microbatches >= 1; chunks >= 1 with placement 'loop' "
    "(default 1), exactly 2 with 'v'; evaluation only",
}
"""Registry name -> the rules its options must follow (for docs and the CLI)."""


def _lookup(name: object) -> str:
    key = name.strip().lower().replace("_", "-") if isinstance(name, str) else ""
    if key not in GENERATORS:
        raise InvalidArgument(
            f"generate: name={name!r} is not a schedule; the names are {', '.join(GENERATORS)}"
        )
    return key


def generate(
    name: str,
    *,
    ranks: int,
    microbatches: int,
    chunks: int | None = None,
    overlap: bool = False,
) -> Program:
    """The program of the generator registered as ``name`` (see :data:`GENERATORS`).

    ``chunks`` goes to the generators that take it (``interleaved`` and ``looped-bfs`` default
    to 2, ``forward`` to 1). For a generator that fixes the stages per rank (:data:`CHUNKS`),
    ``chunks`` may be left out or equal that number. Names are case-insensitive and ``_`` may
    stand for ``-``. ``overlap=True`` makes overlapped pairs (``&``): ``dualpipev`` and ``zbv``
    pair their steady phase's F with a backward as their schedules are written; every other
    schedule gets the :func:`~funcpipe.schedule.overlap.overlap` pass.
    """
    check_bool("generate", "overlap", overlap)
    key = _lookup(name)
    fixed = CHUNKS[key]
    if fixed is not None:
        if chunks is not None and chunks != fixed:
            raise InvalidArgument(
                f"generate: chunks={chunks!r} for {key!r}, which always runs {fixed} stage(s) per "
                f"rank; leave chunks out (or pass chunks={fixed})"
            )
        if overlap and key in ("dualpipev", "zbv"):  # (the schedule's own pairs)
            return GENERATORS[key](ranks=ranks, microbatches=microbatches, overlap=True)
    program = _generate(key, ranks=ranks, microbatches=microbatches, chunks=chunks)
    return overlap_pass(program) if overlap else program


def _generate(key: str, *, ranks: int, microbatches: int, chunks: int | None) -> Program:
    if CHUNKS[key] is not None:
        return GENERATORS[key](ranks=ranks, microbatches=microbatches)
    if chunks is None:
        chunks = _DEFAULT_CHUNKS[key]
    if chunks is None:
        return GENERATORS[key](ranks=ranks, microbatches=microbatches)
    return GENERATORS[key](ranks=ranks, microbatches=microbatches, chunks=chunks)
