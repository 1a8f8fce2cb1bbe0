"""Overlapped pairs on the MoE GPT: the same DualPipeV program with and without pairs.

    python benchmarks/overlap_moe.py [--pairs 15] [--json overlap_moe.json] [--png timeline.png]

The GPT with experts (:mod:`funcpipe.models.gpt`, every block a mixture of 8 experts, top 2)
at pipeline 2 x expert 2: 4 gloo processes, two data-parallel copies whose experts are split
between them, so every MoE block moves its tokens through an uneven all-to-all (and back) over
the expert axis. A is ``generate("dualpipev", ..., overlap=False)``, B the same schedule with
its steady phase paired (``overlap=True``): each pair's forward on the process's thread, its
backward on a second one, taking turns at their collectives (each issued asynchronously, the
other half running until it is needed), so one half's all-to-all is in flight while the other
computes.

Each run checks that A and B give the same loss and gradients (float64), then times float32
steps A B A B after ``--warmup`` of each (a step is the slowest process's, after a barrier), and
traces one B step: per process, how long a collective of one half of a pair was in flight while
the other half ran (``in_flight_ms``), against the pairs' total span (``paired_ms``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C

COLUMNS: list[C.Column] = [
    ("schedule", "schedule", ""),
    ("a_ms", "A ms (no pairs)", ".1f"),
    ("b_ms", "B ms (pairs)", ".1f"),
    ("ratio", "B/A", ".3f"),
    ("ci_lo", "95% lo", ".3f"),
    ("ci_hi", "95% hi", ".3f"),
    ("in_flight_ms", "in flight under the other half, ms", ".1f"),
    ("paired_ms", "pairs' span, ms", ".1f"),
    ("grad_diff", "grads B vs A", ".1e"),
    ("attempts", "runs", "d"),
]

MODEL = {"vocab": 256, "context": 64, "d_model": 128, "heads": 4, "layers": 4, "experts": 8,
         "top_k": 2}  # fmt: skip
BATCH, MICROBATCHES = 16, 8  # sequences per copy


def _pipes(dtype: torch.dtype) -> tuple[Any, Any, Any, Any, Any]:
    """(A, B, this copy's params, x, y) on this process."""
    import funcpipe as fp
    from funcpipe.models import gpt
    from funcpipe.parallel import build_mesh
    from funcpipe.parallel.sharding import shard_tree
    from funcpipe.schedule import generate

    mesh = build_mesh({"pipeline": 2, "expert": 2})
    cfg = gpt.GPTConfig(**MODEL)
    one = gpt.single_axis()
    n = 4  # dualpipev on 2 ranks: 4 stages
    full = gpt.split(gpt.init(cfg, seed=0, dtype=dtype), cfg, n)
    mine = tuple(
        shard_tree(p, lay, mesh.place) for p, lay in zip(full, gpt.shardings(cfg, n), strict=True)
    )

    def pipe(overlap: bool) -> Any:
        program = generate("dualpipev", ranks=2, microbatches=MICROBATCHES, overlap=overlap)
        return fp.Pipeline(
            gpt.stages(cfg, n, axis=one, expert=mesh["expert"]), program,
            loss_fn=gpt.loss_fn(axis=one), ties=gpt.tie_spec(n), mesh=mesh,
            experts=gpt.expert_paths(cfg, n),
        )  # fmt: skip

    g = torch.Generator().manual_seed(1 + mesh.place.coords["data"])
    x = torch.randint(0, MODEL["vocab"], (BATCH, MODEL["context"]), generator=g)
    y = torch.randint(0, MODEL["vocab"], (BATCH, MODEL["context"]), generator=g)
    return pipe(False), pipe(True), mine, x, y


def in_flight(timeline: Any, rank: int) -> tuple[float, float]:
    """(seconds a collective ran inside the other half's span, the pairs' total span) on
    program rank ``rank``: for each pair, the forward-phase collectives within the backward
    half's span plus the backward-phase ones within the forward half's."""
    from funcpipe.schedule.ir import Op, pairs

    events, calls = timeline.events[rank], timeline.spans[rank]
    hidden = total = 0.0
    for a, b in pairs(timeline.program.ranks[rank]):
        halves = {events[a].instr.op is Op.F: events[a], events[b].instr.op is Op.F: events[b]}
        fwd, bwd = halves[True], halves[False]
        total += max(fwd.end, bwd.end) - min(fwd.start, bwd.start)
        for c in calls:
            other = bwd if c.name.endswith("(forward)") else fwd
            mine = fwd if other is bwd else bwd
            if c.start < mine.start or c.end > mine.end:
                continue  # (not this pair's)
            hidden += max(0.0, min(c.end, other.end) - max(c.start, other.start))
    return hidden, total


def cell(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    a, b, params, x, y = _pipes(torch.float64)
    ra, rb = a.step(params, x, y), b.step(params, x, y)
    ga = [t for g in ra.grads if g is not None for t in C.flat_grads(g)]
    gb = [t for g in rb.grads if g is not None for t in C.flat_grads(g)]
    diff = max(float((ra.loss - rb.loss).abs()), C.max_rel_diff(gb, ga))
    a.close(), b.close()
    a, b, params, x, y = _pipes(torch.float32)

    def timed(pipe: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(params, x, y)
        return time.perf_counter() - t0

    for _ in range(cfg["warmup"]):
        timed(a), timed(b)
    ta, tb = [], []
    for _ in range(cfg["pairs"]):
        ta.append(timed(a))
        tb.append(timed(b))
    traced = b.step(params, x, y, trace=True).timeline
    me = rank // 2  # (the program rank: world rank = pipe rank x 2 copies + copy)
    hidden, total = in_flight(traced, me) if traced is not None else (0.0, 0.0)
    if cfg.get("png") and rank == 0 and traced is not None:  # (copy 0's two ranks)
        from funcpipe.schedule import draw_timeline

        draw_timeline(traced, cfg["png"], title="MoE GPT, DualPipeV with pairs", unit="s")
    a.close(), b.close()
    return {"rank": rank, "a": ta, "b": tb, "grad_diff": diff, "in_flight": hidden, "paired": total}


def run(args: argparse.Namespace, pools: C.Pools) -> list[dict[str, Any]]:
    from benchmarks import overlap_moe  # by module name, so the workers can unpickle the job

    cfg = {"pairs": args.pairs, "warmup": args.warmup, "png": args.png}
    pool = pools.get(4)
    results, info = C.measured_cell(
        lambda: pool.run(overlap_moe.cell, cfg, timeout=args.job_timeout),
        ranks=4,
        quiet=args.quiet,
        retries=args.retries,
    )
    ta = C.step_times([r["a"] for r in results])
    tb = C.step_times([r["b"] for r in results])
    ratios = C.paired_ratios(tb, ta)
    lo, hi = C.median_ci(ratios)
    row = {
        "schedule": "dualpipev",
        "model": MODEL,
        "batch_per_copy": BATCH,
        "microbatches": MICROBATCHES,
        "a_ms": C.median(ta) * 1e3,
        "b_ms": C.median(tb) * 1e3,
        "ratio": C.median(ratios),
        "ci_lo": lo,
        "ci_hi": hi,
        "in_flight_ms": max(r["in_flight"] for r in results) * 1e3,
        "paired_ms": max(r["paired"] for r in results) * 1e3,
        "in_flight_per_process_ms": [r["in_flight"] * 1e3 for r in results],
        "grad_diff": max(r["grad_diff"] for r in results),
        "a_times": ta,
        "b_times": tb,
        **info,
    }
    print(C.table([row], COLUMNS).splitlines()[-1], flush=True)
    return [row]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="overlap_moe.py",
        description="The MoE GPT at pipeline 2 x expert 2: DualPipeV with and without pairs.",
    )
    ap.add_argument("--pairs", type=C.int_at_least(1), default=15, help="timed A B pairs")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each first")
    ap.add_argument("--png", default=None, help="draw the traced B step's timeline (process 0)")
    C.pool_options(ap)
    return ap


def main(
    argv: list[str] | None = None, *, pool: C.PoolFactory | None = None
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = C.run_main("overlap_moe.py", argv, pool, parser, COLUMNS, run)
    return rows


if __name__ == "__main__":
    main()
