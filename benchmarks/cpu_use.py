"""Where the cores' time goes during a step: CPU time per rank, and how long the cores sat idle.

    python benchmarks/cpu_use.py [--sizes small] [--ranks 2 4] [--steps 40] [--rounds 2]

A pipelined step cannot be shorter than its CPU work spread over the machine's cores, and with
more ranks than cores (4 gloo processes on 2 cores) that bound, not the schedule, can decide the
step. Per (size, ranks, schedule), on one gloo pool: funcpipe (``Pipeline(transport="dist")``)
and torch.distributed.pipelining run the same model and schedule, each for ``--steps`` steps in a
block, blocks alternating ``--rounds`` times (funcpipe first). Around each block every rank reads
its own CPU time (``time.process_time``: all its threads, user + system) and rank 0 reads the
machine's idle time (``/proc/stat``, Linux; all processes). Reported per library: the step time
(block time / steps), the CPU time per step summed over the ranks, ``cpu / cores`` (the step
time the CPU work alone allows), the cores' busy fraction ``cpu / (cores x step)``, and the
machine's idle fraction during the block (which also counts other processes' work).

``raw CPU``: after the blocks every rank times its stages' F and B as bare kernels
(``_raw``: the Linear products, GELU and its derivative, the loss; no autograd, no runtime),
all ranks at once, one microbatch at a time; the sum over ranks of microbatches x (F + B) is
the CPU work of the arithmetic itself. ``raw / peer CPU`` is then the least CPU share of the
peer's any runtime can reach that computes the same products one microbatch at a time
(GPipe excepted: funcpipe sums all of a rank's weight gradients in one product there).

Before the timed steps both libraries make one float64 step from the same weights and their
gradients are compared (``grads fp vs peer``: max |difference| / max |gradient|).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C

DEFAULT_SCHEDULES = ["gpipe", "1f1b", "interleaved", "zbv", "dualpipev"]
LIBS = ("funcpipe", "peer")

COLUMNS: list[C.Column] = [
    ("size", "size", ""),
    ("ranks", "ranks", "d"),
    ("schedule", "schedule", ""),
    ("funcpipe_ms", "funcpipe step ms", ".2f"),
    ("funcpipe_cpu_ms", "funcpipe CPU ms (all ranks)", ".1f"),
    ("funcpipe_bound_ms", "funcpipe CPU / cores ms", ".2f"),
    ("funcpipe_busy", "funcpipe cores busy", ".0%"),
    ("peer_ms", "peer step ms", ".2f"),
    ("peer_cpu_ms", "peer CPU ms (all ranks)", ".1f"),
    ("peer_bound_ms", "peer CPU / cores ms", ".2f"),
    ("peer_busy", "peer cores busy", ".0%"),
    ("cpu_ratio", "CPU funcpipe/peer", ".3f"),
    ("raw_cpu_ms", "raw CPU ms", ".1f"),
    ("raw_cpu_ratio", "raw / peer CPU", ".3f"),
    ("idle", "machine idle fp / peer", ""),
    ("grad_diff", "grads fp vs peer", ".1e"),
    ("runnable", "runnable (mean)", ".1f"),
    ("attempts", "runs", "d"),
]


def machine_idle() -> tuple[int, int] | None:
    """(total, idle + iowait) jiffies of all cores since boot; ``None`` without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields), fields[3] + fields[4]


def job(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from benchmarks import vs_peer

    size = C.Size(**cfg["size"])
    program = C.program_for(
        cfg["schedule"], ranks=dist.get_world_size(), microbatches=size.microbatches
    )
    steps, diff = vs_peer.both_steps(rank, cfg)
    for _ in range(cfg["warmup"]):
        for lib in LIBS:
            steps[lib]()
    blocks: dict[str, list[dict[str, float | None]]] = {lib: [] for lib in LIBS}
    for _ in range(cfg["rounds"]):
        for lib in LIBS:
            dist.barrier()
            idle0, cpu0, t0 = machine_idle(), time.process_time(), time.perf_counter()
            for _ in range(cfg["steps"]):
                steps[lib]()
            dist.barrier()  # the block ends when the slowest rank is done
            wall, cpu, idle1 = time.perf_counter() - t0, time.process_time() - cpu0, machine_idle()
            idle = None
            if idle0 is not None and idle1 is not None and idle1[0] > idle0[0]:
                idle = (idle1[1] - idle0[1]) / (idle1[0] - idle0[0])
            blocks[lib].append({"wall": wall, "cpu": cpu, "idle": idle})
    raw_work = None
    if cfg["raw_reps"] > 0:
        from benchmarks import _raw

        dist.barrier()
        raw = _raw.measure(size, program.n_stages, reps=cfg["raw_reps"], seed=cfg["seed"])
        raw_work = size.microbatches * sum(raw.f[s] + raw.b[s] for s in program.stages_on(rank))
    return {"rank": rank, "blocks": blocks, "grad_diff": diff, "raw_work": raw_work}


def summarize(per_rank: list[dict[str, Any]], steps: int, cores: int) -> dict[str, Any]:
    """Per library: medians over the blocks of the step time (rank 0's block time / steps; the
    blocks end at a barrier), the CPU time per step summed over the ranks, and rank 0's
    reading of the machine's idle fraction."""
    row: dict[str, Any] = {}
    for lib in LIBS:
        n_blocks = len(per_rank[0]["blocks"][lib])
        wall = [per_rank[0]["blocks"][lib][b]["wall"] / steps for b in range(n_blocks)]
        cpu = [sum(r["blocks"][lib][b]["cpu"] for r in per_rank) / steps for b in range(n_blocks)]
        idle = [per_rank[0]["blocks"][lib][b]["idle"] for b in range(n_blocks)]
        step, work = C.median(wall), C.median(cpu)
        row[f"{lib}_ms"] = step * 1e3
        row[f"{lib}_cpu_ms"] = work * 1e3
        row[f"{lib}_bound_ms"] = work / cores * 1e3
        row[f"{lib}_busy"] = work / (cores * step)
        row[f"{lib}_idle"] = C.median(idle) if None not in idle else None
        row[f"{lib}_blocks"] = {"step_s": wall, "cpu_s": cpu, "idle": idle}
    row["cpu_ratio"] = row["funcpipe_cpu_ms"] / row["peer_cpu_ms"]
    fi, pi = row["funcpipe_idle"], row["peer_idle"]
    row["idle"] = "-" if fi is None or pi is None else f"{fi:.0%} / {pi:.0%}"
    row["grad_diff"] = max(r["grad_diff"] for r in per_rank)
    if all(r["raw_work"] is not None for r in per_rank):
        row["raw_cpu_ms"] = sum(r["raw_work"] for r in per_rank) * 1e3
        row["raw_cpu_ratio"] = row["raw_cpu_ms"] / row["peer_cpu_ms"]
    return row


def run(args: argparse.Namespace, pools: C.Pools) -> list[dict[str, Any]]:
    from benchmarks import cpu_use

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    rows = []
    for size_name in args.sizes:
        size = C.SIZES[size_name]
        for ranks in args.ranks:
            for sched in args.schedules:
                cfg = {
                    "size": vars(size),
                    "schedule": sched,
                    "seed": args.seed,
                    "steps": args.steps,
                    "rounds": args.rounds,
                    "warmup": args.warmup,
                    "raw_reps": args.raw_reps,
                }
                pool = pools.get(ranks)
                per_rank, info = C.measured_cell(
                    lambda pool=pool, cfg=cfg: pool.run(cpu_use.job, cfg, timeout=args.job_timeout),
                    ranks=ranks,
                    quiet=args.quiet,
                    retries=args.retries,
                )
                row = {
                    "size": size.name,
                    "ranks": ranks,
                    "schedule": sched,
                    "cores": cores,
                    **summarize(per_rank, args.steps, cores or 1),
                    **info,
                }
                rows.append(row)
                print(C.table([row], COLUMNS).splitlines()[-1], flush=True)
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="cpu_use.py",
        description="CPU time per step and idle cores: funcpipe and torch.distributed.pipelining.",
    )
    ap.add_argument("--sizes", nargs="+", default=["small"], choices=sorted(C.SIZES))
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--schedules", nargs="+", default=DEFAULT_SCHEDULES, choices=list(C.SCHEDULES))
    ap.add_argument("--steps", type=int, default=40, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=2, help="blocks of each library, alternating")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    ap.add_argument(
        "--raw-reps", type=int, default=20, help="repetitions per raw stage cost (0: skip)"
    )
    C.pool_options(ap)
    return ap


def main(argv: list[str] | None = None, *, pool: C.PoolFactory | None = None) -> Any:
    return C.run_main("cpu_use.py", argv, pool, parser, COLUMNS, run)


if __name__ == "__main__":
    main()
