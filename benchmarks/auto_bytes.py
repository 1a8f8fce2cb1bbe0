"""``auto`` under a limit in bytes against the same limit counted in activations (simulated).

    python benchmarks/auto_bytes.py [--ranks 2 4 8] [--json auto_bytes.json]

A model whose last stage keeps ``head`` times the bytes of every other stage (a loss head over
a vocabulary, say), cut into ``2p`` stages placed in a V (rank ``r`` holds stages ``r`` and
``2p - 1 - r``: the head shares rank 0 with the first stage) or in a loop with 2 chunks (stages
``r`` and ``r + p``: the head on rank ``p - 1``). Every rank may keep ``budget`` bytes, in units
of a light stage's activation; a W needs ``keep`` of its F's bytes after the I (1: all of
them; 0.25: a quarter, as when the I frees attention scores and the like). Compared, for
F = B = W = 1 and no latency:

- ``bytes``: ``auto(max_memory=budget, memory=StageMemory(stage bytes, keep x stage bytes))``;
- ``count``: ``auto(max_activations=...)`` with each rank's count its budget over its heaviest
  stage (what fits for sure when a limit in bytes is turned into a count by hand, W keeping
  all);
- ``best built-in``: the fastest of ZB-V and DualPipeV (V) or interleaved 1F1B and looped BFS
  (loop) whose ``peak_memory`` fits the bytes.

Every program is checked against the bytes with ``peak_memory``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C
from funcpipe.schedule import generate, peak_memory, simulate
from funcpipe.schedule.auto import auto
from funcpipe.schedule.costs import StageMemory

COLUMNS: list[C.Column] = [
    ("ranks", "ranks", "d"),
    ("microbatches", "m", "d"),
    ("placement", "placement", ""),
    ("head", "head x", "d"),
    ("keep", "W keeps", ".2f"),
    ("budget", "budget", "d"),
    ("bytes", "bytes", ".0f"),
    ("count", "count", ".0f"),
    ("counts", "counts per rank", ""),
    ("builtin", "best built-in", ""),
    ("bytes_vs_count", "bytes / count", ".3f"),
    ("seconds", "auto s (bytes)", ".2f"),
]

BUILTINS = {"v": ("zbv", "dualpipev"), "loop": ("interleaved", "looped-bfs")}


def cell(
    p: int, m: int, placement: str, head: int, budget: int, keep: float = 1.0
) -> dict[str, Any] | None:
    n = 2 * p
    sizes = [1] * (n - 1) + [head]
    kept = [keep * x for x in sizes]
    kw: dict[str, Any] = {"ranks": p, "microbatches": m, "placement": placement}
    if placement == "loop":
        kw["chunks"] = 2
    owner = generate(
        "zbv" if placement == "v" else "interleaved",
        ranks=p,
        microbatches=m,
        **({} if placement == "v" else {"chunks": 2}),
    ).placement
    heaviest = [max(sizes[s] for s in range(n) if owner[s] == r) for r in range(p)]
    least = [sum(sizes[s] for s in range(n) if owner[s] == r) for r in range(p)]
    if budget < max(least):
        return None
    t0 = time.perf_counter()
    by_bytes = auto(**kw, max_memory=budget, memory=StageMemory(tuple(sizes), tuple(kept)))
    seconds = time.perf_counter() - t0
    counts = [max(2, budget // h) for h in heaviest]
    by_count = auto(**kw, max_activations=counts)
    assert all(x <= budget for x in peak_memory(by_bytes, sizes, kept))
    assert all(x <= budget for x in peak_memory(by_count, sizes))
    best = None
    for name in BUILTINS[placement]:
        extra = {} if placement == "v" else {"chunks": 2}
        program = generate(name, ranks=p, microbatches=m, **extra)
        if all(x <= budget for x in peak_memory(program, sizes, kept)):
            span = simulate(program).makespan
            if best is None or span < best[0]:
                best = (span, name)
    a, b = simulate(by_bytes).makespan, simulate(by_count).makespan
    return {
        "ranks": p,
        "microbatches": m,
        "placement": placement,
        "head": head,
        "keep": keep,
        "budget": budget,
        "bytes": a,
        "count": b,
        "counts": " ".join(str(c) for c in counts),
        "builtin": "-" if best is None else f"{best[1]} {best[0]:.0f}",
        "bytes_vs_count": a / b,
        "seconds": seconds,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(prog="auto_bytes.py", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--heads", nargs="+", type=int, default=[2, 4])
    ap.add_argument(
        "--keep", nargs="+", type=float, default=[1.0, 0.25], help="what a W needs of its F"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for p in args.ranks:
        for m in (2 * p, 4 * p):
            for placement in ("v", "loop"):
                for head in args.heads:
                    for budget in sorted({head + 1, 2 * head, p + head}):
                        for keep in args.keep:
                            row = cell(p, m, placement, head, budget, keep)
                            if row is not None:
                                rows.append(row)
    print(C.table(rows, COLUMNS))
    C.write_json(args.json, {"command": ["auto_bytes.py", *(argv or sys.argv[1:])], "rows": rows})
    return rows


if __name__ == "__main__":
    main()
