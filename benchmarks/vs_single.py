"""The pipelined step against the same model trained in one process, next to the ideal speed-up.

    python benchmarks/vs_single.py [--model gpt|mlp] [--ranks 2 4] [--pairs 20] [--json FILE]

For every (size, ranks, schedule), steps run in triples A B C after a warm-up: A = funcpipe's
pipelined step on a pool of gloo processes (one thread each), B = plain autograd on the whole
batch in this (the launching) process, one thread, C = plain autograd over the same microbatches
(gradients accumulated). The ranks idle while this process computes and the other way round,
and each side keeps its own memory (the one-process model's allocations do not disturb the
ranks'). Speed-up = one-process time / pipelined time, the median of the paired ratios.

The ideal speed-up is the simulator's: ``funcpipe.schedule.simulate`` with per-stage F, B (I and
W for split schedules) measured in rank 0's process on one microbatch with funcpipe's autodiff
(``benchmarks._common.StageTimer``), ``comm = 0``; ideal = (every stage's work on one rank, one after another) / simulated makespan.
With more ranks than cores the ranks share cores, which the simulator does not model: the
achievable speed-up is then at most the number of cores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C

DEFAULT_SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"]

COLUMNS: list[C.Column] = [
    ("size", "size", ""),
    ("ranks", "ranks", "d"),
    ("schedule", "schedule", ""),
    ("single_ms", "1 proc ms (batch)", ".2f"),
    ("single_mb_ms", "1 proc ms (microbatched)", ".2f"),
    ("pipe_ms", "pipelined ms", ".2f"),
    ("speedup", "speed-up", ".2f"),
    ("speedup_mb", "speed-up vs microbatched", ".2f"),
    ("ideal", "ideal (measured F/B/W)", ".2f"),
    ("ideal_uniform", "ideal (uniform)", ".2f"),
    ("runnable", "runnable (mean)", ".1f"),
    ("attempts", "runs", "d"),
]


def ideal_job(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """Rank 0: per-stage costs and the simulator's ideal speed-ups (the others idle)."""
    import torch.distributed as dist

    from funcpipe.schedule import Costs, add_communication, simulate

    out: dict[str, Any] = {}
    if rank == 0:
        size = C.Size(**cfg["size"])
        ranks = dist.get_world_size()
        program = C.program_for(cfg["schedule"], ranks=ranks, microbatches=size.microbatches)
        costs = C.measure_stage_costs(
            size, program.n_stages, reps=cfg["cost_reps"], seed=cfg["seed"]
        )
        makespan = C.ideal_makespan(program, costs)
        out["costs"] = costs.as_dict()
        out["sim_makespan"] = makespan
        out["ideal"] = C.one_process_time(program, costs) / makespan
        uniform = simulate(add_communication(program), Costs())
        out["ideal_uniform"] = sum(uniform.busy) / uniform.makespan
    return out


_PIPES: dict[str, Any] = {}  # in the workers: the pipeline of the current cell, kept between jobs


def pipe_steps(rank: int, cfg: dict[str, Any], n: int) -> list[float]:
    """``n`` timed pipelined steps (each after a barrier) of the cell's pipeline."""
    import json

    import torch.distributed as dist

    import funcpipe as fp

    key = json.dumps(cfg, sort_keys=True)
    if key not in _PIPES:
        _PIPES.clear()
        size = C.Size(**cfg["size"])
        program = C.program_for(
            cfg["schedule"], ranks=dist.get_world_size(), microbatches=size.microbatches
        )
        model = C.build(size, seed=cfg["seed"])
        stages, params = C.funcpipe_stages(model, size, program.n_stages)
        pipe = fp.Pipeline(stages, program, loss_fn=C.loss_fn(size), transport="dist")
        _PIPES[key] = (pipe, params, *C.data(size, seed=cfg["seed"] + 1))
    pipe, params, x, y = _PIPES[key]
    times = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(params, x, y)
        times.append(time.perf_counter() - t0)
    return times


def cell(pool: Any, cfg: dict[str, Any], *, timeout: float) -> dict[str, Any]:
    """Pipelined steps on the pool alternate with one-process steps in this process (the ranks
    are idle meanwhile, and this process is idle while they run)."""
    from benchmarks import vs_single

    out = pool.run(vs_single.ideal_job, cfg, timeout=timeout)[0]
    size = C.Size(**cfg["size"])
    model = C.build(size, seed=cfg["seed"])
    loss = C.loss_fn(size)
    x, y = C.data(size, seed=cfg["seed"] + 1)
    xs, ys = x.chunk(size.microbatches), y.chunk(size.microbatches)

    def one_batch() -> None:
        model.zero_grad(set_to_none=True)
        loss(model(x), y).backward()

    def one_microbatched() -> None:
        model.zero_grad(set_to_none=True)
        for a, b in zip(xs, ys, strict=True):
            (loss(model(a), b) / size.microbatches).backward()

    def timed(f: Any) -> float:
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0

    a: list[float] = []
    b: list[float] = []
    c: list[float] = []
    for k in range(cfg["warmup"] + cfg["pairs"]):
        per_rank = pool.run(vs_single.pipe_steps, cfg, 1, timeout=timeout)
        tb, tc = timed(one_batch), timed(one_microbatched)
        if k >= cfg["warmup"]:
            a.append(max(t[0] for t in per_rank))
            b.append(tb)
            c.append(tc)
    out.update(pipe=a, single=b, single_mb=c)
    return out


def run(args: argparse.Namespace, pools: C.Pools) -> list[dict[str, Any]]:
    from benchmarks import vs_single

    rows = []
    for ranks in args.ranks:
        pool = pools.get(ranks)
        for size_name in C.sizes_for(args.model, args.sizes):
            size = C.resize(C.SIZES[size_name], layers=args.layers)
            for sched in args.schedules:
                cfg = {
                    "size": vars(size),
                    "schedule": sched,
                    "seed": args.seed,
                    "pairs": args.pairs,
                    "warmup": args.warmup,
                    "cost_reps": args.cost_reps,
                }
                res, info = C.measured_cell(
                    lambda pool=pool, cfg=cfg: vs_single.cell(pool, cfg, timeout=args.job_timeout),
                    ranks=ranks,
                    quiet=args.quiet,
                    retries=args.retries,
                )
                r0 = res
                pipe_t = res["pipe"]
                single_t, single_mb_t = r0["single"], r0["single_mb"]
                row = {
                    "size": size.name,
                    "model": size.model,
                    "width": size.width,
                    "batch": size.batch,
                    "ranks": ranks,
                    "schedule": sched,
                    "pairs": args.pairs,
                    "single_ms": C.median(single_t) * 1e3,
                    "single_mb_ms": C.median(single_mb_t) * 1e3,
                    "pipe_ms": C.median(pipe_t) * 1e3,
                    "speedup": C.median(C.paired_ratios(single_t, pipe_t)),
                    "speedup_mb": C.median(C.paired_ratios(single_mb_t, pipe_t)),
                    "ideal": r0["ideal"],
                    "ideal_uniform": r0["ideal_uniform"],
                    "sim_makespan_ms": r0["sim_makespan"] * 1e3,
                    "stage_costs_s": r0["costs"],
                    "pipe_times": pipe_t,
                    "single_times": single_t,
                    "single_mb_times": single_mb_t,
                }
                row.update(info)
                rows.append(row)
                print(C.table([row], COLUMNS).splitlines()[-1], flush=True)
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="vs_single.py",
        description="Pipelined step time vs one process (plain autograd), with the simulator's ideal speed-up.",
    )
    ap.add_argument("--model", choices=sorted(C.MODELS), default=None, help="gpt (default) or mlp")
    ap.add_argument("--sizes", nargs="+", default=None, choices=sorted(C.SIZES))
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--schedules", nargs="+", default=DEFAULT_SCHEDULES, choices=list(C.SCHEDULES))
    ap.add_argument("--pairs", type=int, default=20, help="timed (pipelined, one-process) triples")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--cost-reps", type=int, default=20, help="repetitions per stage cost")
    ap.add_argument("--layers", type=int, default=None)
    C.pool_options(ap)
    return ap


def main(
    argv: list[str] | None = None, *, pool: C.PoolFactory | None = None
) -> list[dict[str, Any]]:
    """Run the benchmark; ``pool(n)`` may supply started pools of ``n`` gloo processes."""
    rows: list[dict[str, Any]] = C.run_main("vs_single.py", argv, pool, parser, COLUMNS, run)
    return rows


if __name__ == "__main__":
    main()
