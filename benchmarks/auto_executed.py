"""Executed on this machine: ``auto`` against the built-in schedules, same model, same processes.

    python benchmarks/auto_executed.py [--size gpt] [--ranks 2] [--rounds 20] [--json FILE]

1. Costs, for the model cut into ``p`` and ``2p`` stages. ``--costs in-step`` (default): a few
   traced steps of a split and a whole-backward schedule (ZB-H1 and 1F1B for ``p`` stages,
   ZB-V and interleaved 1F1B for ``2p``) and ``funcpipe.schedule.costs_from_timelines``: each
   stage's median F, I, W and B inside a real step.
   ``--costs isolated``: every rank times each stage alone on one microbatch (rank 0's medians).
   Ranks 0 and 1 measure the point-to-point latency of one activation either way.
2. From those costs, ``auto`` searches a one-chunk program (``auto``) and a two-chunk V program
   (``auto-v``) under the memory limit; the built-ins (GPipe, 1F1B, interleaved 1F1B, ZB-H1,
   ZB-H2, ZB-V, DualPipeV) that keep at most that much are the field.
   ``auto-tuned``: ``auto_candidates`` gives auto's best ``--tune-count`` programs of each
   kind (built-ins among them keep their names), plus every built-in that fits and is not
   among them (``--tune-builtins``, default on); ``funcpipe.measure.tune.fastest`` times them on the
   same processes (``--tune-rounds`` rounds, round-robin; with ``--tune-halving``, the
   default, the leading half again and again until two are left) and keeps the fastest; that
   program then runs in the timed rounds below like any other (fresh measurements).
3. One job runs every program on the same gloo processes: a float64 step of each is compared
   with plain autograd on the whole model, then float32: ``--warmup`` steps of each, then
   ``--rounds`` rounds in which every program runs one step (after a barrier; in a fresh
   seeded order each round, ``--order shuffle``, or rotated by one, ``--order rotate``). A
   step's time is its slowest rank's. ``same program as``: the built-ins whose program is
   exactly this one (``auto`` often returns a built-in's program under its own name; the two
   then run as separate pipelines, and the ratio between them is this machine's noise).

Memory is counted in full-stage activations (1F1B's unit: ``p`` per rank): a chunk of a
two-chunk program counts one half. ``--memory p`` (the default) is 1F1B's peak; ``2p`` doubles it.
Reported per program: median step time, the simulated makespan (measured costs and latency),
and the median over rounds of its time over the best built-in's time in the same round
(``/best built-in``; the best built-in is the one with the lowest median over the first half of
the rounds, and the ratio is the median over the second half: choosing the fastest of several
noisy programs and comparing with it on the same rounds would bias every comparison towards it),
with its 95% bootstrap interval (``95% interval``: where the median of another run of as many
rounds would fall; an interval containing 1 is a tie at this machine's noise).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C

BUILTINS = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv", "dualpipev"]
AUTOS = {"auto": (1, "loop"), "auto-v": (2, "v")}
TUNED = "auto-tuned"  # the fastest of auto's candidates, picked by funcpipe.measure.tune.fastest

COLUMNS: list[C.Column] = [
    ("size", "size", ""),
    ("ranks", "ranks", "d"),
    ("memory", "memory", ""),
    ("schedule", "schedule", ""),
    ("peak", "peak (stages)", ".1f"),
    ("simulated_ms", "simulated ms", ".2f"),
    ("isolated_ms", "sim. ms (isolated costs)", ".2f"),
    ("executed_ms", "executed ms", ".2f"),
    ("vs_best", "/best built-in", ".3f"),
    ("vs_best_ci_text", "95% interval", ""),
    ("same_as", "same program as", ""),
    ("picked", "tuned pick", ""),
    ("iqr", "IQR/med", ".2f"),
    ("grad_ref", "fp vs 1-proc", ".1e"),
    ("runnable", "runnable (mean)", ".1f"),
    ("attempts", "runs", "d"),
]


def programs_for(
    ranks: int,
    size: C.Size,
    costs: dict[str, Any],
    isolated: dict[str, dict[str, list[float]]],
    comm: float,
    memory: str,
) -> dict[str, dict[str, Any]]:
    """Every program that fits the limit: text, simulated makespan (with ``costs``, the ones
    ``auto`` gets, and with the isolated ones), peak (full-stage units)."""
    from funcpipe.schedule.auto import auto

    limit = ranks if memory == "p" else 2 * ranks
    out: dict[str, dict[str, Any]] = {}

    def entry(program: Any, v: int) -> dict[str, Any]:
        return _describe(program, v, costs, isolated, comm)

    for name in BUILTINS:
        program = C.program_for(name, ranks=ranks, microbatches=size.microbatches)
        got = entry(program, program.n_stages // ranks)
        if got["peak"] <= limit:
            out[name] = got
    for name, (v, placement) in AUTOS.items():
        program = auto(
            ranks=ranks,
            microbatches=size.microbatches,
            chunks=v,
            placement=placement,
            costs=costs[str(ranks * v)],
            max_activations=v * limit,
        )
        out[name] = entry(program, v)
    return out


def _describe(
    program: Any,
    v: int,
    costs: dict[str, Any],
    isolated: dict[str, dict[str, list[float]]],
    comm: float,
) -> dict[str, Any]:
    """A program's text, simulated makespans (the costs auto gets; the isolated ones) and peak
    in full-stage units."""
    from funcpipe.schedule import add_communication, simulate
    from funcpipe.schedule.ir import format_program

    lowered = add_communication(program)
    sim = simulate(lowered, costs[str(program.n_stages)])
    alone = C.StageCosts(**isolated[str(program.n_stages)])
    return {
        "text": format_program(program),
        "sim": sim.makespan,
        "isolated": simulate(lowered, alone.costs(comm)).makespan,
        "peak": max(sim.peak_activations) / v,
    }


def candidates_for(
    ranks: int,
    size: C.Size,
    costs: dict[str, Any],
    isolated: dict[str, dict[str, list[float]]],
    comm: float,
    memory: str,
    count: int,
) -> list[dict[str, Any]]:
    """auto_candidates' best ``count`` one-chunk and ``count`` V programs (built-ins among them
    keep their names), as :func:`programs_for` describes a program, plus ``name``."""
    from funcpipe.schedule.auto import auto_candidates

    limit = ranks if memory == "p" else 2 * ranks
    out = []
    for tag, (v, placement) in AUTOS.items():
        for program in auto_candidates(
            ranks=ranks,
            microbatches=size.microbatches,
            chunks=v,
            placement=placement,
            costs=costs[str(ranks * v)],
            max_activations=v * limit,
            count=count,
        ):
            described = _describe(program, v, costs, isolated, comm)
            out.append({"name": f"{tag}:{program.name}", **described})
    return out


def tune_job(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """On every rank: ``funcpipe.measure.tune.fastest`` over the candidates (float32, the timed model)."""
    import funcpipe as fp
    from funcpipe.schedule.ir import parse_program

    size = C.Size(**cfg["size"])
    programs = [parse_program(t) for t in cfg["candidates"]]
    pipes, args = [], []
    for program in programs:
        model = C.build(size, seed=cfg["seed"])
        stages, params = C.funcpipe_stages(model, size, program.n_stages)
        pipes.append(fp.Pipeline(stages, program, loss_fn=C.loss_fn(size), transport="dist"))
        args.append((params, *C.data(size, seed=cfg["seed"] + 1)))
    index = {id(p): k for k, p in enumerate(programs)}
    t0 = time.perf_counter()
    got = fp.tune.fastest(
        programs,
        lambda p: pipes[index[id(p)]].step(*args[index[id(p)]]),
        rounds=cfg["rounds"],
        warmup=cfg["warmup"],
        halving=cfg.get("halving", False),
    )
    return {"index": got.index, "medians": list(got.medians), "seconds": time.perf_counter() - t0}


def trace_job(rank: int, cfg: dict[str, Any]) -> list[Any]:
    """Executed timelines of a few steps of ``cfg["schedule"]`` (for in-step costs)."""
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
    for _ in range(cfg["warmup"]):
        pipe.step(params, x, y)
    timelines = []
    for _ in range(cfg["steps"]):
        dist.barrier()
        timelines.append(pipe.step(params, x, y, trace=True).timeline)
    return timelines if rank == 0 else []


def _round_order(names: list[str], r: int, seed: int, how: str) -> list[str]:
    """The order the programs run in round ``r``, the same on every rank. ``rotate``: the
    list rotated by ``r`` (each program keeps the same predecessor in every round);
    ``shuffle``: a fresh permutation per round (seeded), so no program always follows the
    same one (what the previous step leaves in the caches differs between programs)."""
    if how == "rotate":
        return [names[(r + k) % len(names)] for k in range(len(names))]
    order = list(names)
    random.Random(seed * 100_003 + r).shuffle(order)
    return order


def run_job(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """On every rank: check each program's gradients, then time them round by round."""
    import torch.distributed as dist

    import funcpipe as fp
    from funcpipe.schedule.ir import parse_program

    size = C.Size(**cfg["size"])
    names = list(cfg["programs"])
    programs = {n: parse_program(cfg["programs"][n]) for n in names}
    grad_ref: dict[str, float] = {}
    model = C.build(size, seed=cfg["seed"], dtype=torch.float64)
    x, y = C.data(size, seed=cfg["seed"] + 1, dtype=torch.float64)
    ref = C.reference_grads(model, size, x, y)  # one process, the whole model
    for name in names:  # float64: the same gradients as one process
        program = programs[name]
        stages, params = C.funcpipe_stages(model, size, program.n_stages)
        pipe = fp.Pipeline(stages, program, loss_fn=C.loss_fn(size), transport="dist")
        got = pipe.step(params, x, y).grads
        mine = [
            t
            for s, g in enumerate(got)
            if program.placement[s] == dist.get_rank()
            for t in C.flat_grads(g)
        ]
        sizes = [len(C.flat_grads(p)) for p in params]
        starts = [sum(sizes[:s]) for s in range(len(sizes))]
        want = [
            t
            for s in range(program.n_stages)
            if program.placement[s] == dist.get_rank()
            for t in ref[starts[s] : starts[s] + sizes[s]]
        ]
        grad_ref[name] = C.max_rel_diff(mine, want)
    pipes, args = {}, {}
    for name in names:
        program = programs[name]
        model = C.build(size, seed=cfg["seed"])
        stages, params = C.funcpipe_stages(model, size, program.n_stages)
        pipes[name] = fp.Pipeline(stages, program, loss_fn=C.loss_fn(size), transport="dist")
        args[name] = (params, *C.data(size, seed=cfg["seed"] + 1))
    for _ in range(cfg["warmup"]):
        for name in names:
            pipes[name].step(*args[name])
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(cfg["rounds"]):
        for name in _round_order(names, r, cfg["seed"], cfg.get("order", "shuffle")):
            dist.barrier()
            t0 = time.perf_counter()
            pipes[name].step(*args[name])
            times[name].append(time.perf_counter() - t0)
    return {"times": times, "grad_ref": grad_ref}


def run(args: argparse.Namespace, pools: C.Pools) -> list[dict[str, Any]]:
    from benchmarks import vs_simulated
    from funcpipe.schedule import costs_from_timelines

    rows: list[dict[str, Any]] = []
    size = C.resize(C.SIZES[args.size], layers=args.layers, microbatches=args.microbatches)
    for ranks in args.ranks:
        pool = pools.get(ranks)
        measured = pool.run(
            vs_simulated.costs_job,
            {
                "size": vars(size),
                "seed": args.seed,
                "n_stages": [ranks, 2 * ranks],
                "cost_reps": args.cost_reps,
                "comm_reps": args.comm_reps,
            },
            timeout=args.job_timeout,
        )
        isolated, comm = measured[0]["costs"], measured[0]["comm"]
        costs: dict[str, Any] = {}
        for v, traced in ((1, ("zb-h1", "1f1b")), (2, ("zbv", "interleaved"))):
            n = str(ranks * v)
            if args.costs == "isolated":
                costs[n] = C.StageCosts(**isolated[n]).costs(comm)
                continue
            timelines = []
            for sched in traced:  # I and W from a split program, B from a whole one
                cfg0 = {"size": vars(size), "seed": args.seed, "schedule": sched}
                cfg0 |= {"warmup": args.warmup, "steps": args.trace_steps}
                timelines += pool.run(trace_job, cfg0, timeout=args.job_timeout)[0]
            costs[n] = costs_from_timelines(timelines, comm=comm)
        for memory in args.memory:
            progs = programs_for(ranks, size, costs, isolated, comm, memory)
            tuned: dict[str, Any] = {}
            if args.tune_count:
                cands = candidates_for(ranks, size, costs, isolated, comm, memory, args.tune_count)
                if args.tune_builtins:  # the built-ins that fit, where auto did not find them
                    texts = {c["text"] for c in cands}
                    cands += [
                        {"name": f"built-in:{n}", **p}
                        for n, p in progs.items()
                        if n not in AUTOS and p["text"] not in texts
                    ]
                tcfg = {"size": vars(size), "seed": args.seed, "rounds": args.tune_rounds}
                tcfg["halving"] = args.tune_halving
                tcfg |= {"warmup": 1, "candidates": [c["text"] for c in cands]}
                got = pool.run(tune_job, tcfg, timeout=args.job_timeout)[0]
                pick = cands[got["index"]]
                progs[TUNED] = pick
                tuned = {
                    "picked": pick["name"],
                    "tune_seconds": got["seconds"],
                    "tune_medians_ms": {
                        c["name"]: t * 1e3 for c, t in zip(cands, got["medians"], strict=True)
                    },
                }
            cfg = {
                "size": vars(size),
                "seed": args.seed,
                "programs": {n: p["text"] for n, p in progs.items()},
                "warmup": args.warmup,
                "rounds": args.rounds,
                "order": args.order,
            }
            res, info = C.measured_cell(
                lambda pool=pool, cfg=cfg: pool.run(run_job, cfg, timeout=args.job_timeout),
                ranks=ranks,
                quiet=args.quiet,
                retries=args.retries,
            )
            steps = {n: C.step_times([r["times"][n] for r in res]) for n in progs}
            builtins = [n for n in progs if n not in AUTOS and n != TUNED]
            # the best built-in is chosen on the first half of the rounds and the ratios are
            # taken on the second: picking the minimum of several noisy medians and comparing
            # with it on the same rounds would favour the built-ins (the winner's curse)
            half = len(next(iter(steps.values()))) // 2 if args.rounds >= 4 else 0
            best = (
                min(builtins, key=lambda n: C.median(steps[n][:half] or steps[n]))
                if builtins
                else None
            )
            bodies = {n: _body(p["text"]) for n, p in progs.items()}
            for name, prog in progs.items():
                same = [b for b in builtins if b != name and bodies[b] == bodies[name]]
                ratios = C.paired_ratios(steps[name][half:], steps[best][half:]) if best else []
                ci = C.median_ci(ratios) if len(ratios) >= 4 else None  # 2,000 resamples: once
                rows.append(
                    {
                        "size": size.name,
                        "ranks": ranks,
                        "microbatches": size.microbatches,
                        "memory": memory,
                        "schedule": name,
                        "best_builtin": best,
                        "same_as": ", ".join(same),
                        "peak": prog["peak"],
                        "simulated_ms": prog["sim"] * 1e3,
                        "isolated_ms": prog["isolated"] * 1e3,
                        "costs": args.costs,
                        "executed_ms": C.median(steps[name]) * 1e3,
                        "vs_best": C.median(ratios) if ratios else None,
                        "vs_best_ci": list(ci) if ci else None,
                        "vs_best_ci_text": "{:.3f}-{:.3f}".format(*ci) if ci else "-",
                        "iqr": C.spread(steps[name]),
                        "grad_ref": max(r["grad_ref"][name] for r in res),
                        "executed_times": steps[name],
                        "program": prog["text"],
                        "comm_s": comm,
                        "stage_costs_s": {
                            n: {"f": c.f, "b": c.b, "w": c.w, "full": c.full}
                            for n, c in costs.items()
                        },
                        "isolated_costs_s": isolated,
                        **(tuned if name == TUNED else {}),
                        **info,
                    }
                )
                print(C.table([rows[-1]], COLUMNS).splitlines()[-1], flush=True)
    return rows


def _body(text: str) -> str:
    """A program's text without its name: two programs with the same body are the same
    program (``auto`` names its own ``auto`` even when it equals a built-in's)."""
    return "\n".join(ln for ln in text.splitlines() if not ln.startswith("name "))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="auto_executed.py",
        description="Executed step time of auto's programs against the built-in schedules.",
    )
    ap.add_argument("--size", default="gpt", choices=sorted(C.SIZES))
    ap.add_argument("--ranks", nargs="+", type=int, default=[2])
    ap.add_argument("--memory", nargs="+", default=["p"], choices=["p", "2p"])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument(
        "--order",
        choices=["shuffle", "rotate"],
        default="shuffle",
        help="the programs' order within a round: a seeded permutation per round (default) "
        "or the list rotated by one each round (round 5 and before)",
    )
    ap.add_argument(
        "--costs",
        default="in-step",
        choices=["in-step", "isolated"],
        help="what auto gets: stage costs traced inside steps (default) or timed alone",
    )
    ap.add_argument("--trace-steps", type=int, default=5, help="traced steps for in-step costs")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--microbatches", type=int, default=None)
    ap.add_argument(
        "--tune-count",
        type=int,
        default=4,
        help="auto_candidates per placement timed by funcpipe.tune.fastest (0: no auto-tuned)",
    )
    ap.add_argument(
        "--tune-rounds",
        type=int,
        default=8,
        help="rounds per candidate (with halving: per stage of the halving)",
    )
    ap.add_argument(
        "--tune-halving",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fastest(..., halving=True): measure the leading half again until two are left",
    )
    ap.add_argument(
        "--tune-builtins",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time every built-in that fits the memory limit among the candidates",
    )
    ap.add_argument("--cost-reps", type=int, default=20)
    ap.add_argument("--comm-reps", type=int, default=50)
    C.pool_options(ap, job_timeout=1800.0)
    return ap


def main(
    argv: list[str] | None = None, *, pool: C.PoolFactory | None = None
) -> list[dict[str, Any]]:
    """Run the benchmark; ``pool(n)`` may supply started pools of ``n`` gloo processes."""
    rows: list[dict[str, Any]] = C.run_main("auto_executed.py", argv, pool, parser, COLUMNS, run)
    return rows


if __name__ == "__main__":
    main()
