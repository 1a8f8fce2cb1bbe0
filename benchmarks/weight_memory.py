"""Weight-gradient options against the default, paired: ``Pipeline(batch_weights_extra=N)``
(memory for speed), with ``--unstaged`` ``Pipeline(stage_weights=False)`` (what summing each
Linear weight gradient once per step, its rows waiting in its own memory, buys), or with
``--idle on|off`` ``Pipeline(idle_weights=True|False)`` (what computing those sums while a rank
waits, instead of at the end of the step, buys), or with ``--no-chains``
``Pipeline(chains=False)`` (what running Linear + activation stages as one node with their
derivatives written out, :mod:`funcpipe.runtime.chain`, buys).

    python benchmarks/weight_memory.py [--sizes small large] [--ranks 2] [--extra 1 2] [--pairs 30]
    python benchmarks/weight_memory.py --unstaged [--schedules 1f1b zbv ...]
    python benchmarks/weight_memory.py --idle off [--ranks 2]   # (4 ranks on 2 cores: --idle on)
    python benchmarks/weight_memory.py --no-chains [--schedules gpipe 1f1b ...]

By default a rank never keeps more activations than the program's peak, so 1F1B sums each
steady-state backward's Linear weight gradients on its own (an 8-row product that reads and
writes the whole weight-sized gradient). ``batch_weights_extra=N`` lets up to N more
activations' worth wait, and the waiting products are summed over up to N + 1 microbatches in
one product. Per (size, ranks, schedule, N): two pipelines on the same gloo pool, one with the
default and one with N (or ``stage_weights=False``), stepped alternately A B A B after a barrier each (a step's time = its
slowest rank's); ``extra/default`` is the median of the paired ratios. Also reported: each
side's peak activation count per rank (``step(...).peak_activations``) and that both give the
same gradients (float64, before the timed float32 steps).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C

DEFAULT_SCHEDULES = ["1f1b", "interleaved", "dualpipev"]

COLUMNS: list[C.Column] = [
    ("size", "size", ""),
    ("ranks", "ranks", "d"),
    ("schedule", "schedule", ""),
    ("variant", "variant", ""),
    ("default_ms", "default ms", ".2f"),
    ("extra_ms", "variant ms", ".2f"),
    ("ratio", "variant/default", ".3f"),
    ("ci", "95% CI", ""),
    ("peaks_default", "peak acts (default)", ""),
    ("peaks_extra", "peak acts (variant)", ""),
    ("grad_diff", "grads variant vs default", ".1e"),
    ("runnable", "runnable (mean)", ".1f"),
    ("attempts", "runs", "d"),
]


def job(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import funcpipe as fp

    size = C.Size(**cfg["size"])
    program = C.program_for(
        cfg["schedule"], ranks=dist.get_world_size(), microbatches=size.microbatches
    )

    def pipes(dtype: torch.dtype) -> tuple[dict[int, Any], list[Any], Any, Any]:
        model = C.mlp(size.width, layers=size.layers, dtype=dtype, seed=cfg["seed"])
        stages, params = C.funcpipe_stages(model, program.n_stages, kind="module")
        x, y = C.data(size, dtype=dtype, seed=cfg["seed"] + 1)
        made = {
            side: fp.Pipeline(stages, program, loss_fn=C.mse, transport="dist", **kwargs)
            for side, kwargs in (("default", {}), ("extra", cfg["variant"]))
        }
        return made, params, x, y

    made, params, x, y = pipes(torch.float64)
    results = {e: p.step(params, x, y) for e, p in made.items()}
    # this rank's gradients (None for the stages it does not hold, in both)
    ga, gb = (C.flat_grads(results[e].grads) for e in ("default", "extra"))
    if [g is None for g in ga] != [g is None for g in gb]:
        diff = float("inf")
    else:
        held = [k for k, g in enumerate(ga) if g is not None]
        diff = C.max_rel_diff([gb[k] for k in held], [ga[k] for k in held])
    made, params, x, y = pipes(torch.float32)
    times: dict[str, list[float]] = {"default": [], "extra": []}
    peaks: dict[str, int] = {}
    for k in range(cfg["warmup"] + cfg["pairs"]):
        for e, pipe in made.items():
            dist.barrier()
            t0 = time.perf_counter()
            res = pipe.step(params, x, y)
            dt = time.perf_counter() - t0
            if k >= cfg["warmup"]:
                times[e].append(dt)
            peaks[e] = res.peak_activations[rank]
    return {
        "rank": rank,
        "default": times["default"],
        "extra": times["extra"],
        "peak_default": peaks["default"],
        "peak_extra": peaks["extra"],
        "grad_diff": diff,
    }


def run(args: argparse.Namespace, pools: C.Pools) -> list[dict[str, Any]]:
    from benchmarks import weight_memory

    rows = []
    for size_name in args.sizes:
        size = C.SIZES[size_name]
        for ranks in args.ranks:
            for sched in args.schedules:
                variants: list[dict[str, Any]] = (
                    [{"stage_weights": False}]
                    if args.unstaged
                    else [{"chains": False}]
                    if args.no_chains
                    else [{"idle_weights": args.idle == "on"}]
                    if args.idle
                    else [{"batch_weights_extra": n} for n in args.extra]
                )
                for variant in variants:
                    extra = variant.get("batch_weights_extra", 0)
                    cfg = {
                        "size": vars(size),
                        "schedule": sched,
                        "variant": variant,
                        "seed": args.seed,
                        "pairs": args.pairs,
                        "warmup": args.warmup,
                    }
                    pool = pools.get(ranks)
                    per_rank, info = C.measured_cell(
                        lambda pool=pool, cfg=cfg: pool.run(
                            weight_memory.job, cfg, timeout=args.job_timeout
                        ),
                        ranks=ranks,
                        quiet=args.quiet,
                        retries=args.retries,
                    )
                    a = C.step_times([r["default"] for r in per_rank])
                    b = C.step_times([r["extra"] for r in per_rank])
                    ratios = C.paired_ratios(b, a)
                    lo, hi = C.median_ci(ratios)
                    row = {
                        "size": size.name,
                        "ranks": ranks,
                        "schedule": sched,
                        "extra": extra,
                        "variant": ", ".join(f"{k}={v}" for k, v in variant.items()),
                        "default_ms": C.median(a) * 1e3,
                        "extra_ms": C.median(b) * 1e3,
                        "ratio": C.median(ratios),
                        "ci": f"{lo:.3f}-{hi:.3f}",
                        "peaks_default": ",".join(str(r["peak_default"]) for r in per_rank),
                        "peaks_extra": ",".join(str(r["peak_extra"]) for r in per_rank),
                        "grad_diff": max(r["grad_diff"] for r in per_rank),
                        "default_times": a,
                        "extra_times": b,
                        **info,
                    }
                    rows.append(row)
                    print(C.table([row], COLUMNS).splitlines()[-1], flush=True)
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="weight_memory.py",
        description="Pipeline(batch_weights_extra=N), Pipeline(stage_weights=False), "
        "Pipeline(idle_weights=True|False) or Pipeline(chains=False) against the default, "
        "paired steps.",
    )
    ap.add_argument("--sizes", nargs="+", default=["small", "large"], choices=sorted(C.SIZES))
    ap.add_argument("--ranks", nargs="+", type=int, default=[2])
    ap.add_argument("--schedules", nargs="+", default=DEFAULT_SCHEDULES, choices=list(C.SCHEDULES))
    ap.add_argument(
        "--extra",
        nargs="+",
        type=C.int_at_least(1, "N = 0 is the default this benchmark compares against"),
        default=[1, 2],
        help="values of N >= 1",
    )
    ap.add_argument(
        "--unstaged",
        action="store_true",
        help="compare Pipeline(stage_weights=False) with the default instead (--extra unused)",
    )
    ap.add_argument(
        "--idle",
        choices=["on", "off"],
        help="compare Pipeline(idle_weights=True or False) with the default instead (whose "
        "idle_weights=None turns it on where each process's threads have cores of their own)",
    )
    ap.add_argument(
        "--no-chains",
        action="store_true",
        help="compare Pipeline(chains=False) with the default instead (--extra unused)",
    )
    ap.add_argument("--pairs", type=int, default=30, help="timed A B pairs per cell")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    C.pool_options(ap)
    return ap


def main(argv: list[str] | None = None, *, pool: C.PoolFactory | None = None) -> Any:
    return C.run_main("weight_memory.py", argv, pool, parser, COLUMNS, run)


if __name__ == "__main__":
    main()
