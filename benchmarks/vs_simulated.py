"""Executed step time against the simulator's makespan, from costs measured on this machine.

    python benchmarks/vs_simulated.py [--size gpt] [--ranks 2] [--steps 20] [--json FILE]

1. Ranks 0 and 1 measure the point-to-point latency of one activation (one microbatch's
   float32 activation between two stages) over what a Pipeline uses (torch.distributed
   send/recv): half the median round trip.
2. funcpipe runs the schedule (``transport="dist"``): ``--warmup`` steps, then ``--steps`` timed
   steps, each after a barrier; a step's time is its slowest rank's. After every step (outside
   its timing) every rank times each stage's F, B, I and W once on one microbatch (funcpipe's
   autodiff, one thread, all ranks at once, as in a step): the costs are the medians of those,
   rank 0's, measured on the same machine as the steps (a shared VM's speed drifts within
   minutes; the ratio with costs timed once before all schedules is still reported,
   ``costs timed before``). Each step
   then starts with the caches as that timing left them (an effect not measured apart).
3. ``funcpipe.schedule.simulate(lowered program, Costs(f, b, w, full, comm))`` predicts the
   makespan (``b`` = I, ``w`` = W, ``full`` = a whole B).
4. ``--traced`` more steps run with ``step(trace=True)``: the executed timeline gives each rank's
   compute time (F, B, I, W instructions, start to end).

``--repeat N`` runs each schedule N times (steps, costs and traced steps alike) and reports
the run whose step ratios scatter least (smallest IQR/median), with every run's ratio listed:
this VM's speed drifts within minutes, and a run that straddles a drift says more about the
VM than about the runtime. The choice looks at the scatter, never at the ratio itself.

Reported: executed / simulated makespan (1.0 = the runtime adds nothing to the schedule's
compute and messages), the simulated bubble fraction, and executed / simulated compute time of
the busiest rank (above 1: the instructions themselves run slower inside a step than alone;
the rest of the gap is waiting and per-instruction overhead). Last, the simulator is run again
with each stage's median F, B (or I and W) *as executed inside the traced steps*: executed /
that makespan is what the runtime adds beyond its own instructions' compute (messages,
waiting, the interpreter between instructions, the step's set-up and loss all-reduce).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C

DEFAULT_SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "dualpipev"]

COLUMNS: list[C.Column] = [
    ("size", "size", ""),
    ("ranks", "ranks", "d"),
    ("schedule", "schedule", ""),
    ("executed_ms", "executed ms", ".2f"),
    ("simulated_ms", "simulated ms", ".2f"),
    ("ratio", "executed/simulated", ".3f"),
    ("iqr", "IQR/med", ".2f"),
    ("bubble", "sim. bubble", ".1%"),
    ("busy_ratio", "executed/simulated compute", ".3f"),
    ("ratio_before", "executed/simulated (costs timed before)", ".3f"),
    ("simulated_step_ms", "simulated ms (in-step costs)", ".2f"),
    ("ratio_step", "executed/simulated (in-step costs)", ".3f"),
    ("ratio_runs_text", "executed/simulated, every run", ""),
    ("runnable", "runnable (mean)", ".1f"),
    ("attempts", "runs", "d"),
]


def costs_job(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    size = C.Size(**cfg["size"])
    out = {
        str(n): C.measure_stage_costs(size, n, reps=cfg["cost_reps"], seed=cfg["seed"]).as_dict()
        for n in cfg["n_stages"]
    }
    comm = C.p2p_latency(rank, C.activation_shape(size), reps=cfg["comm_reps"])
    return {"costs": out, "comm": comm}


def step_job(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import funcpipe as fp

    size = C.Size(**cfg["size"])
    program = C.program_for(
        cfg["schedule"], ranks=dist.get_world_size(), microbatches=size.microbatches
    )
    model = C.build(size, seed=cfg["seed"])
    stages, params = C.funcpipe_stages(model, size, program.n_stages)
    pipe = fp.Pipeline(stages, program, loss_fn=C.loss_fn(size), transport="dist")
    x, y = C.data(size, seed=cfg["seed"] + 1)
    timer = C.StageTimer(size, program.n_stages, seed=cfg["seed"])
    times = []
    for k in range(cfg["warmup"] + cfg["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(params, x, y)
        if k >= cfg["warmup"]:
            times.append(time.perf_counter() - t0)
        timer.once()  # the stage costs, between the steps: the same machine as the steps
    out: dict[str, Any] = {"times": times, "busy": None, "durations": {}}
    out["costs"] = timer.result(skip=min(2, cfg["warmup"] + cfg["steps"] - 1)).as_dict()
    busy = []
    durations: dict[str, list[float]] = {}  # "F 3" -> every duration of F on stage 3
    for _ in range(cfg["traced"]):  # executed timelines: compute time per rank (F/B/I/W)
        dist.barrier()
        tl = pipe.step(params, x, y, trace=True).timeline
        busy.append(list(tl.busy))
        for events in tl.events:
            for e in events:
                if e.instr.op.name in ("F", "B", "I", "W"):
                    durations.setdefault(f"{e.instr.op.name} {e.instr.stage}", []).append(
                        e.end - e.start
                    )
    if busy:
        out["busy"] = [C.median(b[r] for b in busy) for r in range(len(busy[0]))]
        out["durations"] = {k: C.median(v) for k, v in durations.items()}
    return out


def in_step_costs(program: Any, durations: dict[str, float], comm: float) -> Any:
    """Costs from the executed timelines: each stage's median F, I, W and B inside a step."""
    from funcpipe.schedule import Costs

    n = program.n_stages
    f = [durations.get(f"F {s}", 0.0) for s in range(n)]
    if C.split_program(program):  # (which may mix whole B's in: as executed)
        b = [durations.get(f"I {s}", 0.0) for s in range(n)]
        w = [durations.get(f"W {s}", 0.0) for s in range(n)]
        full = [durations.get(f"B {s}", b[s] + w[s]) for s in range(n)]
        return Costs(f=f, b=b, w=w, full=full, comm=comm)
    b = [durations.get(f"B {s}", 0.0) for s in range(n)]
    return Costs(f=f, b=b, w=[0.0] * n, comm=comm)


def run(args: argparse.Namespace, pools: C.Pools) -> list[dict[str, Any]]:
    from benchmarks import vs_simulated
    from funcpipe.schedule import add_communication, simulate

    rows = []
    for ranks in args.ranks:
        size = C.SIZES[args.size]
        size = C.resize(size, layers=args.layers)
        base = {"size": vars(size), "seed": args.seed}
        pool = pools.get(ranks)
        chunks = sorted({C.SCHEDULES[s].chunks for s in args.schedules})
        measured = pool.run(
            vs_simulated.costs_job,
            {
                **base,
                "n_stages": [ranks * c for c in chunks],
                "cost_reps": args.cost_reps,
                "comm_reps": args.comm_reps,
            },
            timeout=args.job_timeout,
        )
        comm = measured[0]["comm"]
        print(
            f"# {ranks} ranks: p2p latency {comm * 1e6:.0f} us; stage costs (ms, rank 0): "
            + "; ".join(
                f"{n} stages: "
                + ", ".join(f"{k}={[round(v * 1e3, 2) for v in vs]}" for k, vs in c.items())
                for n, c in measured[0]["costs"].items()
            ),
            flush=True,
        )
        for sched in args.schedules:
            program = C.program_for(sched, ranks=ranks, microbatches=size.microbatches)
            before = C.StageCosts(**measured[0]["costs"][str(program.n_stages)])
            lowered = add_communication(program)
            sim_before = simulate(lowered, before.costs(comm))
            cfg = {
                **base,
                "schedule": sched,
                "warmup": args.warmup,
                "steps": args.steps,
                "traced": args.traced,
            }
            runs = []  # (IQR/median of the ratios, ratio, result, info, executed, costs, sim)
            for _ in range(args.repeat):
                res, info = C.measured_cell(
                    lambda pool=pool, cfg=cfg: pool.run(
                        vs_simulated.step_job, cfg, timeout=args.job_timeout
                    ),
                    ranks=ranks,
                    quiet=args.quiet,
                    retries=args.retries,
                )
                executed = C.step_times([r["times"] for r in res])
                costs = C.StageCosts(**res[0]["costs"])  # rank 0's, timed between the steps
                sim = simulate(lowered, costs.costs(comm))
                ratios = [t / sim.makespan for t in executed]
                runs.append((C.spread(ratios), C.median(ratios), res, info, executed, costs, sim))
            # the least noisy run (by IQR/median, not by its ratio); every run's ratio is kept
            _, _, res, info, executed, costs, sim = min(
                runs,
                key=lambda r: r[0] if r[0] == r[0] else math.inf,  # (NaN: < 4 steps)
            )
            busy = res[0]["busy"]
            sim_step = None
            if res[0]["durations"]:
                lowered = add_communication(program)
                sim_step = simulate(lowered, in_step_costs(program, res[0]["durations"], comm))
            ratios = [t / sim.makespan for t in executed]
            row = {
                "size": size.name,
                "model": size.model,
                "width": size.width,
                "batch": size.batch,
                "ranks": ranks,
                "schedule": sched,
                "steps": args.steps,
                "executed_ms": C.median(executed) * 1e3,
                "simulated_ms": sim.makespan * 1e3,
                "ratio": C.median(ratios),
                "iqr": C.spread(ratios),
                "bubble": sim.bubble_fraction,
                "busy_ratio": max(busy) / max(sim.busy) if busy else None,
                "simulated_step_ms": sim_step.makespan * 1e3 if sim_step else None,
                "ratio_step": C.median(t / sim_step.makespan for t in executed)
                if sim_step
                else None,
                "simulated_before_ms": sim_before.makespan * 1e3,
                "ratio_before": C.median(t / sim_before.makespan for t in executed),
                "stage_costs_before_s": before.as_dict(),
                "executed_busy_ms": [b * 1e3 for b in busy] if busy else None,
                "simulated_busy_ms": [b * 1e3 for b in sim.busy],
                "comm_s": comm,
                "stage_costs_s": costs.as_dict(),
                "executed_times": executed,
            }
            row.update(info)
            row["repeats"] = len(runs)
            row["ratio_runs"] = [r[1] for r in runs]
            row["iqr_runs"] = [r[0] for r in runs]
            row["ratio_runs_text"] = " ".join(f"{r[1]:.3f}" for r in runs)
            rows.append(row)
            print(C.table([row], COLUMNS).splitlines()[-1], flush=True)
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="vs_simulated.py",
        description="Executed makespan vs the simulator's, with F/B/I/W and p2p latency measured here.",
    )
    ap.add_argument("--size", default="gpt", choices=sorted(C.SIZES))
    ap.add_argument("--ranks", nargs="+", type=int, default=[2])
    ap.add_argument("--schedules", nargs="+", default=DEFAULT_SCHEDULES, choices=list(C.SCHEDULES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--traced", type=int, default=5, help="traced steps for the executed compute time"
    )
    ap.add_argument(
        "--repeat",
        type=C.int_at_least(1),
        default=1,
        help="run each schedule this many times and report the least noisy run (smallest "
        "IQR/median of its step ratios); every run's ratio is listed",
    )
    ap.add_argument("--cost-reps", type=int, default=20)
    ap.add_argument("--comm-reps", type=int, default=50)
    ap.add_argument("--layers", type=int, default=None)
    C.pool_options(ap)
    return ap


def main(
    argv: list[str] | None = None, *, pool: C.PoolFactory | None = None
) -> list[dict[str, Any]]:
    """Run the benchmark; ``pool(n)`` may supply started pools of ``n`` gloo processes."""
    rows: list[dict[str, Any]] = C.run_main("vs_simulated.py", argv, pool, parser, COLUMNS, run)
    return rows


if __name__ == "__main__":
    main()
