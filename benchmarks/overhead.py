"""Interpreter overhead: microseconds per instruction on trivial stages.

    python benchmarks/overhead.py [--ranks 2 4] [--microbatches 8] [--reps 50] [--json FILE]

Every stage is ``h * p["a"]`` on a (1, 4) float32 microbatch, so a step is almost nothing but
the runtime: splitting the batch, interpreting instructions, moving tensors, building grads.

- ``local``: all ranks in this process (``transport="local"``); us/instr = step / all
  instructions of the lowered program (they run one after the other in one thread).
- ``gloo``: one process per rank (``transport="dist"``), every step after a barrier; us/instr =
  step / the most instructions one rank runs. The peer (torch.distributed.pipelining, same
  schedule, same trivial stage as an nn.Module) is timed on the same processes, interleaved.

``autodiff F+B us``: funcpipe's autodiff forward + backward of one trivial stage alone (the
floor for one F plus one B).
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

DEFAULT_SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"]
WIDTH = 4

COLUMNS: list[C.Column] = [
    ("transport", "transport", ""),
    ("ranks", "ranks", "d"),
    ("schedule", "schedule", ""),
    ("instrs", "instrs (total)", "d"),
    ("instrs_rank", "instrs (max rank)", "d"),
    ("step_us", "step us", ".0f"),
    ("us_per_instr", "us/instr", ".1f"),
    ("peer_us", "peer step us", ".0f"),
    ("ratio", "funcpipe/peer", ".2f"),
    ("runnable", "runnable (mean)", ".1f"),
    ("attempts", "runs", "d"),
]


def _scale(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return h * p["a"]


class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.ones(WIDTH))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.a


def _setup(
    schedule: str, ranks: int, m: int, transport: str
) -> tuple[Any, list[Any], torch.Tensor, torch.Tensor]:
    import funcpipe as fp

    program = C.program_for(schedule, ranks=ranks, microbatches=m)
    stages = [fp.Stage(_scale, name="scale") for _ in range(program.n_stages)]
    params = [{"a": torch.ones(WIDTH)} for _ in range(program.n_stages)]
    pipe = fp.Pipeline(stages, program, loss_fn=lambda o, y: (o * y).mean(), transport=transport)
    x, y = torch.randn(m, WIDTH), torch.randn(m, WIDTH)
    return pipe, params, x, y


def _counts(pipe: Any) -> tuple[int, int]:
    lengths = [len(r) for r in pipe.program.ranks]
    return sum(lengths), max(lengths)


def autodiff_floor(reps: int) -> float:
    from funcpipe.runtime import autodiff

    a = [torch.ones(WIDTH, requires_grad=True)]
    x = torch.randn(1, WIDTH)
    g = [torch.ones(1, WIDTH)]

    def fn(ps: Any, ins: Any) -> list[torch.Tensor]:
        return [ins[0] * ps[0]]

    def once() -> None:
        _, saved = autodiff.forward(fn, a, [x])
        autodiff.backward(saved, a, g)

    return C.median(C.time_calls(once, reps=reps, warmup=5))


def local(schedule: str, ranks: int, m: int, reps: int) -> dict[str, Any]:
    pipe, params, x, y = _setup(schedule, ranks, m, "local")
    times = C.time_calls(lambda: pipe.step(params, x, y), reps=reps, warmup=3)
    total, per_rank = _counts(pipe)
    step = C.median(times)
    return {
        "instrs": total,
        "instrs_rank": per_rank,
        "step_us": step * 1e6,
        "us_per_instr": step * 1e6 / total,
    }


def gloo_job(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    ranks, m = dist.get_world_size(), cfg["microbatches"]
    pipe, params, x, y = _setup(cfg["schedule"], ranks, m, "dist")
    peer = None
    spec = C.SCHEDULES[cfg["schedule"]]
    if spec.peer is not None:
        from torch.distributed.pipelining import PipelineStage, schedules

        mine = sorted(pipe.program.stages_on(rank))
        n = pipe.program.n_stages
        mods = {s: _Scale() for s in mine}
        stages = [PipelineStage(mods[s], s, n, torch.device("cpu")) for s in mine]
        cls = getattr(schedules, spec.peer)
        loss = lambda o, t: (o * t).mean()  # noqa: E731
        sched = cls(stages[0] if spec.chunks == 1 else stages, n_microbatches=m, loss_fn=loss)

        def peer() -> None:
            for mod in mods.values():
                mod.zero_grad(set_to_none=True)
            args = (x,) if 0 in mine else ()
            sched.step(*args, target=y if n - 1 in mine else None, return_outputs=False)

    def timed(f: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0

    def ours() -> None:
        pipe.step(params, x, y)

    a, b = [], []
    for k in range(cfg["warmup"] + cfg["reps"]):
        ta = timed(ours)
        tb = timed(peer) if peer is not None else 0.0
        if k >= cfg["warmup"]:
            a.append(ta)
            b.append(tb)
    total, per_rank = _counts(pipe)
    return {
        "funcpipe": a,
        "peer": b if peer is not None else [],
        "instrs": total,
        "instrs_rank": per_rank,
    }


def run(args: argparse.Namespace, pools: C.Pools) -> tuple[list[dict[str, Any]], float]:
    from benchmarks import overhead

    floor = autodiff_floor(args.reps * 4)
    rows: list[dict[str, Any]] = []
    for ranks in args.ranks:
        for sched in args.schedules:
            res, info = C.measured_cell(
                lambda sched=sched, ranks=ranks: local(sched, ranks, args.microbatches, args.reps),
                ranks=1,
                quiet=args.quiet,
                retries=args.retries,
            )
            row = {"transport": "local", "ranks": ranks, "schedule": sched, **res, **info}
            rows.append(row)
            print(C.table([row], COLUMNS).splitlines()[-1], flush=True)
    for ranks in args.gloo_ranks:
        pool = pools.get(ranks)
        for sched in args.schedules:
            cfg = {
                "schedule": sched,
                "microbatches": args.microbatches,
                "reps": args.reps,
                "warmup": 5,
            }
            res, info = C.measured_cell(
                lambda pool=pool, cfg=cfg: pool.run(
                    overhead.gloo_job, cfg, timeout=args.job_timeout
                ),
                ranks=ranks,
                quiet=args.quiet,
                retries=args.retries,
            )
            fp_t = C.step_times([r["funcpipe"] for r in res])
            row = {
                "transport": "gloo",
                "ranks": ranks,
                "schedule": sched,
                "instrs": res[0]["instrs"],
                "instrs_rank": res[0]["instrs_rank"],
                "step_us": C.median(fp_t) * 1e6,
                "us_per_instr": C.median(fp_t) * 1e6 / res[0]["instrs_rank"],
            }
            if res[0]["peer"]:
                peer_t = C.step_times([r["peer"] for r in res])
                row["peer_us"] = C.median(peer_t) * 1e6
                row["ratio"] = C.median(C.paired_ratios(fp_t, peer_t))
            row.update(info)
            rows.append(row)
            print(C.table([row], COLUMNS).splitlines()[-1], flush=True)
    return rows, floor


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="overhead.py",
        description="Interpreter overhead: microseconds per instruction on trivial stages.",
    )
    ap.add_argument(
        "--ranks", nargs="+", type=int, default=[2, 4], help="program ranks, in one process"
    )
    ap.add_argument(
        "--gloo-ranks", nargs="*", type=int, default=[2], help="processes for the gloo runs"
    )
    ap.add_argument("--schedules", nargs="+", default=DEFAULT_SCHEDULES, choices=list(C.SCHEDULES))
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--reps", type=int, default=50)
    C.pool_options(ap, job_timeout=600.0, seed=False)
    return ap


def main(
    argv: list[str] | None = None, *, pool: C.PoolFactory | None = None
) -> list[dict[str, Any]]:
    """Run the benchmark; ``pool(n)`` may supply started pools of ``n`` gloo processes."""

    def run_with_floor(args: Any, pools: C.Pools) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        rows, floor = run(args, pools)
        return rows, {"autodiff_fb_us": floor * 1e6}

    rows, _ = C.run_main("overhead.py", argv, pool, parser, COLUMNS, run_with_floor)
    return rows  # type: ignore[no-any-return]


if __name__ == "__main__":
    main()
