"""Peak activation memory per rank against the schedule's figure.

    python benchmarks/memory.py [--size small] [--ranks 2 4] [--schedules gpipe 1f1b zb-h1 zbv] [--json FILE]

Measured: on every rank of a gloo pool, one funcpipe step runs inside
``torch.autograd.graph.saved_tensors_hooks`` that count the bytes autograd saves for backward
(parameters excluded; each saved tensor counted once, from when it is saved until the last graph
node holding it is freed), plus what a backward keeps for Linear weight gradients outside the
graph (each Linear's input and incoming gradient, from the B or I until they are summed). The rank's peak of
those live bytes is its activation memory.

The schedule's figure: ``peak_activations(program)[rank]`` (the most microbatch activations the
schedule keeps alive at once on that rank, from F to its B or W) x one microbatch's activation
bytes of the rank's largest stage (measured with the same hooks on one forward). The exact
column walks the rank's instructions with each stage's own bytes (stages differ: the last one
also saves the loss's inputs).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C

DEFAULT_SCHEDULES = ["gpipe", "1f1b", "zb-h1", "zbv"]

COLUMNS: list[C.Column] = [
    ("size", "size", ""),
    ("ranks", "ranks", "d"),
    ("schedule", "schedule", ""),
    ("rank", "rank", "d"),
    ("count", "peak count (step)", "d"),
    ("count_sim", "peak count (schedule)", "d"),
    ("mb_kib", "1 microbatch KiB", ".1f"),
    ("measured_kib", "measured peak KiB", ".1f"),
    ("figure_kib", "schedule figure KiB", ".1f"),
    ("ratio", "measured/figure", ".3f"),
    ("exact_kib", "exact walk KiB", ".1f"),
    ("ratio_exact", "measured/exact", ".3f"),
    ("leak_kib", "live after step KiB", ".1f"),
]


def _stage_bytes(size: C.Size, stages: list[Any], params: list[Any]) -> list[int]:
    """Saved-for-backward bytes of one forward of each stage on one microbatch."""
    from funcpipe.tree import tree_map

    mb = size.batch // size.microbatches
    g = torch.Generator().manual_seed(3)
    out = []
    for s, (stage, prm) in enumerate(zip(stages, params, strict=True)):
        ps = tree_map(lambda t: t.detach().requires_grad_(), prm)
        h = torch.randn(mb, size.width, generator=g).requires_grad_(s > 0)
        with C.SavedBytes(C.flat_grads(ps)) as counter:
            o = stage(ps, h)
            if s == len(stages) - 1:
                o = C.mse(o, torch.randn(mb, size.width, generator=g))
            peak = counter.peak
            del o
        out.append(peak)
    return out


@contextlib.contextmanager
def _count_waiting(counter: C.SavedBytes) -> Iterator[None]:
    """Also count what a B keeps for its batched weight gradients (each Linear's input and
    incoming gradient, ``funcpipe.runtime.linear``) from the B until they are summed: they live
    outside autograd's graph, where the hooks do not see them."""
    from funcpipe.runtime import autodiff, linear

    held: dict[int, list[Any]] = {}
    real_deferred, real_batch = linear.backward_deferred, linear.weight_batch
    real_weight = autodiff.backward_weight

    def deferred(*args: Any, **kwargs: Any) -> Any:
        got = real_deferred(*args, **kwargs)
        if got is not None:
            held[id(got[1])] = [counter.hold(t) for _, x, g in got[1].items for t in (x, g)]
        return got

    def batch(waiting: Any, params: Any) -> None:
        waiting = list(waiting)
        real_batch(waiting, params)
        for d in waiting:
            for key, t in held.pop(id(d), []):
                counter.release(key, t)

    def weight(saved: Any, *args: Any, **kwargs: Any) -> Any:
        kept = saved.products  # an I that kept only (x, g) per product: W consumes them
        got = real_weight(saved, *args, **kwargs)
        for key, t in held.pop(id(kept), []) if kept is not None else []:
            counter.release(key, t)
        return got

    linear.backward_deferred, linear.weight_batch = deferred, batch  # type: ignore[assignment]
    autodiff.backward_weight = weight  # type: ignore[assignment]
    try:
        yield
    finally:
        linear.backward_deferred, linear.weight_batch = real_deferred, real_batch
        autodiff.backward_weight = real_weight  # type: ignore[assignment]


def job(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import funcpipe as fp
    from funcpipe.schedule import Op, peak_activations

    size = C.Size(**cfg["size"])
    program = C.program_for(
        cfg["schedule"], ranks=dist.get_world_size(), microbatches=size.microbatches
    )
    model = C.mlp(size.width, layers=size.layers, seed=cfg["seed"])
    stages, params = C.funcpipe_stages(model, program.n_stages, kind=cfg["stage_kind"])
    pipe = fp.Pipeline(stages, program, loss_fn=C.mse, transport="dist")
    x, y = C.data(size, seed=cfg["seed"] + 1)
    per_stage = _stage_bytes(size, stages, params)
    pipe.step(params, x, y)  # shapes inferred, buffers warm
    dist.barrier()
    with C.SavedBytes(C.flat_grads(params)) as counter, _count_waiting(counter):
        res = pipe.step(params, x, y)
    mine = program.stages_on(rank)
    live = peak = 0
    recomputed = {(i.stage, i.microbatch) for i in pipe.program.ranks[rank] if i.op is Op.R}
    for i in pipe.program.ranks[rank]:
        if (i.op is Op.F and (i.stage, i.microbatch) not in recomputed) or i.op is Op.R:
            live += per_stage[i.stage]
        elif i.op in (Op.B, Op.W):
            live -= per_stage[i.stage]
        peak = max(peak, live)
    unit = max(per_stage[s] for s in mine)
    count_sim = peak_activations(pipe.program)[rank]
    return {
        "rank": rank,
        "stages": list(mine),
        "count": res.peak_activations[rank],
        "count_sim": count_sim,
        "mb_bytes": unit,
        "stage_bytes": per_stage,
        "measured": counter.peak,
        "figure": count_sim * unit,
        "exact": peak,
        "leak": counter.live,
    }


def run(args: argparse.Namespace, pools: C.Pools) -> list[dict[str, Any]]:
    from benchmarks import memory

    rows = []
    for ranks in args.ranks:
        pool = pools.get(ranks)
        for sched in args.schedules:
            size = C.SIZES[args.size]
            size = C.resize(size, layers=args.layers)
            cfg = {
                "size": vars(size),
                "schedule": sched,
                "seed": args.seed,
                "stage_kind": args.stage_kind,
            }
            for r in pool.run(memory.job, cfg, timeout=args.job_timeout):
                row = {
                    "size": size.name,
                    "width": size.width,
                    "batch": size.batch,
                    "ranks": ranks,
                    "schedule": sched,
                    "rank": r["rank"],
                    "stages": r["stages"],
                    "count": r["count"],
                    "count_sim": r["count_sim"],
                    "mb_kib": r["mb_bytes"] / 1024,
                    "measured_kib": r["measured"] / 1024,
                    "figure_kib": r["figure"] / 1024,
                    "ratio": r["measured"] / r["figure"] if r["figure"] else None,
                    "exact_kib": r["exact"] / 1024,
                    "ratio_exact": r["measured"] / r["exact"] if r["exact"] else None,
                    "leak_kib": r["leak"] / 1024,
                    "stage_bytes": r["stage_bytes"],
                }
                rows.append(row)
                print(C.table([row], COLUMNS).splitlines()[-1], flush=True)
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="memory.py",
        description="Peak saved-activation bytes per rank vs the schedule's peak-activations figure.",
    )
    ap.add_argument("--size", default="small", choices=sorted(C.SIZES))
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--schedules", nargs="+", default=DEFAULT_SCHEDULES, choices=list(C.SCHEDULES))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--stage-kind", default="module", choices=["module", "function"])
    C.pool_options(ap, job_timeout=600.0, contention=False)
    return ap


def main(
    argv: list[str] | None = None, *, pool: C.PoolFactory | None = None
) -> list[dict[str, Any]]:
    """Run the benchmark; ``pool(n)`` may supply started pools of ``n`` gloo processes."""
    rows: list[dict[str, Any]] = C.run_main("memory.py", argv, pool, parser, COLUMNS, run)
    return rows


if __name__ == "__main__":
    main()
