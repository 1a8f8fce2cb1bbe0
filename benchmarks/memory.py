"""Peak activation memory per rank against the schedule's figure.

    python benchmarks/memory.py [--size gpt] [--ranks 2 4] [--schedules gpipe 1f1b zb-h1 zbv] [--json FILE]

Measured: on every rank of a gloo pool, one funcpipe step runs inside
``torch.autograd.graph.saved_tensors_hooks`` that count the bytes autograd saves for backward
(parameters excluded; each saved tensor counted once, from when it is saved until the last graph
node holding it is freed), plus what an I keeps outside the graph for its W (the gradients
recorded where the W's branches start, from the I until the W). The rank's peak of those live
bytes is its activation memory.

The schedule's figures, from each stage's bytes measured on one microbatch with
``funcpipe.measure.profile.measure_memory`` (what its F keeps, and what its I leaves for its W):

- ``peak_memory(program, activation, for_w)[rank]``: the rank's instructions walked in order,
  F adding the stage's activation, I swapping it for what W needs, B / W removing it;
- ``count x largest``: ``peak_activations(program)[rank]`` (the most microbatch activations
  alive at once, each from F to its B or W) x the activation of the rank's largest stage, the
  figure before ``peak_memory`` existed: an upper bound when stages differ in size or an I
  frees part of the activation.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
    ("mb_kib", "largest stage 1 mb KiB", ".1f"),
    ("measured_kib", "measured peak KiB", ".1f"),
    ("count_figure_kib", "count x largest KiB", ".1f"),
    ("ratio_count", "measured / count x largest", ".3f"),
    ("figure_kib", "peak_memory KiB", ".1f"),
    ("ratio", "measured / peak_memory", ".3f"),
    ("leak_kib", "live after step KiB", ".1f"),
]


@contextlib.contextmanager
def _count_waiting(counter: C.SavedBytes) -> Iterator[None]:
    """Also count what an I keeps outside autograd's graph for its W: the gradients it records
    where the W's branches start (``saved.roots``, ``saved.direct``), from the I until the W;
    the hooks do not see them."""
    from funcpipe.runtime import autodiff

    held: dict[int, list[Any]] = {}
    real_input, real_weight = autodiff.backward_input, autodiff.backward_weight

    def input_(saved: Any, *args: Any, **kwargs: Any) -> Any:
        got = real_input(saved, *args, **kwargs)
        recorded = [g for group in saved.roots for r in group for _, g in r.edges]
        recorded += [g for _, g in saved.direct]
        held[id(saved)] = [counter.hold(g) for g in recorded if g is not None]
        return got

    def weight(saved: Any, *args: Any, **kwargs: Any) -> Any:
        got = real_weight(saved, *args, **kwargs)
        for key, t in held.pop(id(saved), []):
            counter.release(key, t)
        return got

    autodiff.backward_input = input_  # type: ignore[assignment]
    autodiff.backward_weight = weight  # type: ignore[assignment]
    try:
        yield
    finally:
        autodiff.backward_input = real_input  # type: ignore[assignment]
        autodiff.backward_weight = real_weight  # type: ignore[assignment]


def job(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import funcpipe as fp
    from funcpipe.measure.profile import measure_memory
    from funcpipe.schedule import peak_activations, peak_memory

    size = C.Size(**cfg["size"])
    program = C.program_for(
        cfg["schedule"], ranks=dist.get_world_size(), microbatches=size.microbatches
    )
    model = C.build(size, seed=cfg["seed"])
    stages, params = C.funcpipe_stages(model, size, program.n_stages)
    loss = C.loss_fn(size)
    pipe = fp.Pipeline(stages, program, loss_fn=loss, transport="dist")
    x, y = C.data(size, seed=cfg["seed"] + 1)
    mb = size.batch // size.microbatches
    sizes = measure_memory(stages, params, x[:mb], loss_fn=loss, target=y[:mb])
    pipe.step(params, x, y)  # shapes inferred, buffers warm
    dist.barrier()
    with C.SavedBytes(C.flat_grads(params)) as counter, _count_waiting(counter):
        res = pipe.step(params, x, y)
    mine = program.stages_on(rank)
    unit = max(sizes.activation[s] for s in mine)
    count_sim = peak_activations(pipe.program)[rank]
    return {
        "rank": rank,
        "stages": list(mine),
        "count": res.peak_activations[rank],
        "count_sim": count_sim,
        "mb_bytes": unit,
        "stage_bytes": list(sizes.activation),
        "stage_for_w": list(sizes.for_w),
        "measured": counter.peak,
        "count_figure": count_sim * unit,
        "figure": peak_memory(pipe.program, sizes.activation, sizes.for_w)[rank],
        "whole_until_w": peak_memory(pipe.program, sizes.activation)[rank],
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
            cfg = {"size": vars(size), "schedule": sched, "seed": args.seed}
            for r in pool.run(memory.job, cfg, timeout=args.job_timeout):
                row = {
                    "size": size.name,
                    "model": size.model,
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
                    "count_figure_kib": r["count_figure"] / 1024,
                    "ratio_count": r["measured"] / r["count_figure"] if r["count_figure"] else None,
                    "figure_kib": r["figure"] / 1024,
                    "ratio": r["measured"] / r["figure"] if r["figure"] else None,
                    "whole_until_w_kib": r["whole_until_w"] / 1024,
                    "leak_kib": r["leak"] / 1024,
                    "stage_bytes": r["stage_bytes"],
                    "stage_for_w": r["stage_for_w"],
                }
                rows.append(row)
                print(C.table([row], COLUMNS).splitlines()[-1], flush=True)
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="memory.py",
        description="Peak saved-activation bytes per rank vs the schedule's peak-activations figure.",
    )
    ap.add_argument("--size", default="gpt", choices=sorted(C.SIZES))
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument("--schedules", nargs="+", default=DEFAULT_SCHEDULES, choices=list(C.SCHEDULES))
    ap.add_argument("--layers", type=int, default=None)
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
