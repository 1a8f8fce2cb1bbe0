"""Simulated bubble of ``auto`` against the built-in schedules at equal activation memory.

    python benchmarks/auto_grid.py [--json auto_grid.json]

Grid: ranks 4 and 8, microbatches 8/16/32, per-stage cost ratios F:B:W = 1:1:1, 1:2:1, 1:1:2
(B = input gradient, W = weight gradient; comm = 0), memory limits p (1F1B's peak) and 2p.

Memory is counted in full-stage activations, 1F1B's unit: a schedule with ``v`` chunks per rank
holds ``v`` half-size (for v = 2) stages per rank, so its ``peak_activations`` count is divided
by ``v`` (a limit ``L`` becomes ``max_activations = v * L`` for ``auto``), and its per-stage costs
are the ratios divided by ``v``. A built-in whose worst rank exceeds the limit is "n/a".
Bubble = the simulator's ``bubble_fraction`` (idle share of ranks x makespan). Prints a
Markdown table and writes every number to JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from funcpipe.schedule.auto import auto
from funcpipe.schedule.generators import generate
from funcpipe.schedule.simulate import Costs, simulate

BUILTIN = [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1), ("zbv", 2)]
AUTO = [("auto", 1, "loop"), ("auto-v", 2, "v")]
RATIOS = [(1, 1, 1), (1, 2, 1), (1, 1, 2)]


def costs(ratio: tuple[int, int, int], chunks: int) -> Costs:
    f, b, w = ratio
    return Costs(f=f / chunks, b=b / chunks, w=w / chunks)


def cell(ranks: int, micro: int, ratio: tuple[int, int, int], limit: int) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for name, v in BUILTIN:
        program = generate(name, ranks=ranks, microbatches=micro)
        timeline = simulate(program, costs(ratio, v))
        peak = max(timeline.peak_activations) / v
        row[name] = {
            "bubble": timeline.bubble_fraction if peak <= limit else None,
            "peak": peak,
        }
    for name, v, placement in AUTO:
        t0 = time.perf_counter()
        program = auto(
            ranks=ranks,
            microbatches=micro,
            chunks=v,
            placement=placement,
            costs=costs(ratio, v),
            max_activations=v * limit,
        )
        seconds = time.perf_counter() - t0
        timeline = simulate(program, costs(ratio, v))
        row[name] = {
            "bubble": timeline.bubble_fraction,
            "peak": max(timeline.peak_activations) / v,
            "seconds": seconds,
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="auto_grid.json", help="where to write the numbers")
    args = parser.parse_args()
    columns = [name for name, _ in BUILTIN] + [name for name, _, _ in AUTO]
    header = ["p", "m", "F:B:W", "memory", *columns]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" for _ in header) + "|")
    results = []
    for ranks in (4, 8):
        for micro in (8, 16, 32):
            for ratio in RATIOS:
                for limit in (ranks, 2 * ranks):
                    row = cell(ranks, micro, ratio, limit)
                    results.append(
                        {"ranks": ranks, "microbatches": micro, "ratio": ratio, "limit": limit}
                        | row
                    )
                    shown = [
                        "n/a" if row[c]["bubble"] is None else f"{100 * row[c]['bubble']:.1f}%"
                        for c in columns
                    ]
                    memory = "p" if limit == ranks else "2p"
                    fbw = ":".join(map(str, ratio))
                    print(f"| {ranks} | {micro} | {fbw} | {memory} | " + " | ".join(shown) + " |")
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    slowest = max(r[c]["seconds"] for r in results for c in ("auto", "auto-v"))
    print(f"\nwrote {args.json}; slowest auto call {slowest:.2f} s")


if __name__ == "__main__":
    main()
