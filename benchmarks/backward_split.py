"""Time of I + W against one full B for each stage of a benchmark model (funcpipe's split).

    python benchmarks/backward_split.py [--size gpt] [--stages 2 4] [--reps 20] [--json FILE]

In this process, one thread, float32: the model cut into ``--stages`` stages, every stage's
B, I and W timed on one microbatch with funcpipe's autodiff as the interpreter calls them
(``benchmarks._common.StageTimer``: parameter gradients summed in place, the last stage with
its loss, stage 0's input needing no gradient); medians of ``--reps`` repetitions after two
warm-ups. ``(I+W)/B``: what splitting the backward costs (above 1: the split pays for walking
the graph twice; the zero-bubble schedules need it to fill their bubbles). Before timing, a
float64 check: I then W give B's input and parameter gradients.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C

COLUMNS: list[C.Column] = [
    ("size", "size", ""),
    ("stages", "stages", "d"),
    ("stage", "stage", "d"),
    ("B_ms", "B ms", ".2f"),
    ("I_ms", "I ms", ".2f"),
    ("W_ms", "W ms", ".2f"),
    ("ratio", "(I+W)/B", ".3f"),
    ("grad_diff", "I+W vs B (float64)", ".1e"),
]


def measure(size: C.Size, n_stages: int, reps: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """One row per stage: B, I and W (ms), (I + W) / B and the float64 gradient check."""
    diffs = C.StageTimer(size, n_stages, seed=seed, dtype=torch.float64).split_diff()
    timer = C.StageTimer(size, n_stages, seed=seed)
    for _ in range(reps + 2):
        timer.once()
    c = timer.result(skip=2)
    return [
        {
            "size": size.name,
            "model": size.model,
            "width": size.width,
            "batch": size.batch,
            "microbatches": size.microbatches,
            "stages": n_stages,
            "stage": s,
            "B_ms": c.b[s] * 1e3,
            "I_ms": c.i[s] * 1e3,
            "W_ms": c.w[s] * 1e3,
            "ratio": (c.i[s] + c.w[s]) / c.b[s],
            "grad_diff": diffs[s],
        }
        for s in range(n_stages)
    ]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="backward_split.py",
        description="I + W against one full B per stage, in one process.",
    )
    ap.add_argument("--size", default="gpt", choices=sorted(C.SIZES))
    ap.add_argument("--stages", nargs="+", type=C.int_at_least(1), default=[2, 4])
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--reps", type=C.int_at_least(1), default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the rows here")
    return ap


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    size = C.resize(C.SIZES[args.size], layers=args.layers)
    rows = [r for n in args.stages for r in measure(size, n, args.reps, seed=args.seed)]
    print(C.table(rows, COLUMNS))
    C.write_json(
        args.json, {"command": ["backward_split.py", *(argv or sys.argv[1:])], "rows": rows}
    )
    return rows


if __name__ == "__main__":
    main()
