"""What the per-step shape agreement of a Pipeline over processes costs.

    python benchmarks/agreement.py [--sizes gpt] [--ranks 2] [--schedules 1f1b] [--reps 20]

Over processes every rank enters one all-gather of two int64 fingerprints at every step (the
step's microbatch signatures and the stage outputs inferred from them), so that a rank whose
batch differs fails at once on every rank instead of hanging (issue 42;
``funcpipe.pipeline.agreement.step_agreement``). This times that call on every rank inside real
steps (``agreement us``: per step, the slowest rank's), and the step itself after a barrier,
paired with steps whose agreement is replaced by nothing (``without/with``: the median of the
paired step-time ratios, below 1 when the agreement costs time; the step's shapes are equal on
every rank here, so skipping it changes nothing else).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C

COLUMNS: list[C.Column] = [
    ("size", "size", ""),
    ("ranks", "ranks", "d"),
    ("schedule", "schedule", ""),
    ("agree_us", "agreement us", ".0f"),
    ("step_ms", "step ms", ".1f"),
    ("share", "agreement / step", ".2%"),
    ("ratio", "without/with", ".3f"),
    ("ci", "95% interval", ""),
    ("runnable", "runnable (mean)", ".1f"),
]


def job(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import funcpipe as fp
    from funcpipe.pipeline import agreement

    size = C.SIZES[cfg["size"]]
    ranks = dist.get_world_size()
    program = C.program_for(cfg["schedule"], ranks=ranks, microbatches=size.microbatches)
    stages, params = C.funcpipe_stages(C.build(size), size, program.n_stages)
    x, y = C.data(size)
    real = agreement.step_agreement
    spent: list[float] = []

    def timed(*a: Any, **kw: Any) -> None:
        t0 = time.perf_counter()
        real(*a, **kw)
        spent.append(time.perf_counter() - t0)

    def skipped(*a: Any, **kw: Any) -> None:
        return None

    def step(check: Any) -> float:
        agreement.step_agreement = check
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(params, x, y)
        return time.perf_counter() - t0

    with fp.Pipeline(stages, program, loss_fn=C.loss_fn(size), transport="dist") as pipe:
        try:
            for _ in range(3):
                step(real)
            spent.clear()
            with_, without = [], []
            for _ in range(cfg["reps"]):
                with_.append(step(timed))
                without.append(step(skipped))
        finally:
            agreement.step_agreement = real
    return {"agree": spent, "with": with_, "without": without}


def run(args: argparse.Namespace, pools: C.Pools) -> list[dict[str, Any]]:
    from benchmarks import agreement as me

    rows = []
    for ranks in args.ranks:
        pool = pools.get(ranks)
        for name in args.sizes:
            for sched in args.schedules:
                cfg = {"size": name, "schedule": sched, "reps": args.reps}

                def cell(pool: Any = pool, cfg: dict[str, Any] = cfg) -> Any:
                    return pool.run(me.job, cfg, timeout=args.job_timeout)

                res, info = C.measured_cell(
                    cell,
                    ranks=ranks,
                    quiet=args.quiet,
                    retries=args.retries,
                )
                agree = C.median(C.step_times([r["agree"] for r in res]))
                with_ = C.step_times([r["with"] for r in res])
                without = C.step_times([r["without"] for r in res])
                ratios = C.paired_ratios(without, with_)
                lo, hi = C.median_ci(ratios)
                row = {
                    "size": name,
                    "ranks": ranks,
                    "schedule": sched,
                    "agree_us": agree * 1e6,
                    "step_ms": C.median(with_) * 1e3,
                    "share": agree / C.median(with_),
                    "ratio": C.median(ratios),
                    "ci": f"{lo:.3f}-{hi:.3f}",
                    "times": res,
                    **info,
                }
                rows.append(row)
                print(C.table([row], COLUMNS).splitlines()[-1], flush=True)
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="agreement.py",
        description="What the per-step shape agreement over processes costs.",
    )
    ap.add_argument("--sizes", nargs="+", default=["gpt"], choices=list(C.SIZES))
    ap.add_argument("--ranks", nargs="+", type=C.int_at_least(2), default=[2])
    ap.add_argument("--schedules", nargs="+", default=["1f1b"], choices=list(C.SCHEDULES))
    ap.add_argument("--reps", type=C.int_at_least(2), default=20, help="paired steps")
    C.pool_options(ap, job_timeout=900.0, seed=False)
    return ap


def main(
    argv: list[str] | None = None, *, pool: C.PoolFactory | None = None
) -> list[dict[str, Any]]:
    """Run the benchmark; ``pool(n)`` may supply started pools of ``n`` gloo processes."""
    rows: list[dict[str, Any]] = C.run_main("agreement.py", argv, pool, parser, COLUMNS, run)
    return rows


if __name__ == "__main__":
    main()
