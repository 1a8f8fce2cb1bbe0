"""How far ``auto``'s heuristic is from the optimum: the exact refinement on a grid.

    python benchmarks/auto_exact.py [--seconds 20] [--json auto_exact.json]

Grid: ranks 2, 3 and 4; microbatches 4 and 6; loop (one chunk) and V (two chunks) placement;
costs either even (F = B = W = 1) or uneven (per stage, F, B from {1, 2, 3}, W from {1, 2},
drawn with a fixed seed: stages that differ, as real partitions do); memory limit the least a
rank can have (``chunks``) plus one, and ``ranks`` (1F1B's peak) per chunk. For each problem:
``auto``'s makespan (the heuristic), ``auto(exact=seconds)``'s (the mixed-integer program
solved by SciPy's HiGHS, kept only if strictly shorter), the gain, and how long the exact call
took. A call that ends well inside its budget has proved its answer optimal (HiGHS stops at a
relative gap of 1e-4: less than one unit for these integer costs, with whole-unit makespans);
one that uses the whole budget returns the best it found. Simulated, comm = 0.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from funcpipe.schedule import exact
from funcpipe.schedule.auto import auto
from funcpipe.schedule.simulate import Costs, simulate


def problems(
    ranks: list[int], micro: list[int], seed: int
) -> list[tuple[int, int, str, str, Costs, int]]:
    rng = random.Random(seed)
    out = []
    for p in ranks:
        for m in micro:
            for placement, v in (("loop", 1), ("v", 2)):
                n = p * v
                uneven = Costs(
                    f=[rng.choice([1, 2, 3]) for _ in range(n)],
                    b=[rng.choice([1, 2, 3]) for _ in range(n)],
                    w=[rng.choice([1, 2]) for _ in range(n)],
                )
                for name, c in (("even", Costs(1, 1, 1)), ("uneven", uneven)):
                    for limit in sorted({v + 1, v * p}):
                        out.append((p, m, placement, name, c, limit))
    return out


def _plain(x: Any) -> Any:
    return list(x) if isinstance(x, list | tuple) else x


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(prog="auto_exact.py", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 3, 4])
    ap.add_argument("--microbatches", nargs="+", type=int, default=[4, 6])
    ap.add_argument("--seconds", type=float, default=20.0, help="the exact solver's budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    exact.require("auto_exact.py")
    rows = []
    print("| ranks | m | placement | costs | limit | heuristic | exact | gain | exact s | proved |")
    print("|---:|---:|:--|:--|---:|---:|---:|---:|---:|:--|")
    for p, m, placement, name, costs, limit in problems(args.ranks, args.microbatches, args.seed):
        kw: dict[str, Any] = {"ranks": p, "microbatches": m, "placement": placement}
        kw.update(costs=costs, max_activations=limit)
        t0 = time.perf_counter()
        heuristic = simulate(auto(**kw), costs).makespan
        t1 = time.perf_counter()
        refined = simulate(auto(**kw, exact=args.seconds), costs).makespan
        t2 = time.perf_counter()
        proved = (t2 - t1) < 0.9 * args.seconds
        row = {
            "ranks": p,
            "microbatches": m,
            "placement": placement,
            "costs": name,
            **{k: _plain(getattr(costs, k)) for k in ("f", "b", "w")},
            "limit": limit,
            "heuristic": heuristic,
            "exact": refined,
            "gain": 1 - refined / heuristic,
            "heuristic_s": t1 - t0,
            "exact_s": t2 - t1,
            "proved": proved,
        }
        rows.append(row)
        print(
            f"| {p} | {m} | {placement} | {name} | {limit} | {heuristic:g} | {refined:g} | "
            f"{row['gain']:.1%} | {t2 - t1:.1f} | {'yes' if proved else 'no'} |",
            flush=True,
        )
    if args.json:
        payload = {"solver": exact.solver_info(), "seconds": args.seconds, "rows": rows}
        Path(args.json).write_text(json.dumps(payload, indent=1))
    return rows


if __name__ == "__main__":
    main()
