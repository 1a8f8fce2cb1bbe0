"""funcpipe against funcpipe: does a mechanism earn its place? Paired steps of two variants.

    python benchmarks/ab.py --variant weights-after-sends [--ranks 2 4] [--pairs 20] [--json F]
    python benchmarks/ab.py --variant per-leaf-reduce --ranks 1 2 --data 2

Same model (default the GPT of ``benchmarks/gpt.py``), processes and schedule for both; A is the
Pipeline as a user gets it, B the variant:

- ``weights-after-sends``: the lowered program rewritten by
  :func:`funcpipe.schedule.weights_after_sends` (each B directly followed by the sends of its
  gradients becomes I, those sends, W: the previous rank gets its gradient before this rank
  computes its weight gradients);
- ``per-leaf-reduce``: the data-parallel gradients reduced with one all-reduce per leaf instead
  of one per bucket (:mod:`funcpipe.runtime.buckets`); run it with ``--data 2`` or more.

``--data k`` runs ``k`` data-parallel copies of a ``--ranks``-rank program (``ranks x k``
processes; every copy steps on the same batch, which is all the timing needs).

Each cell checks, in float64, that both variants give the same gradients, then times float32
steps A B A B after ``--warmup`` steps of each (a step is its slowest rank's, started after a
barrier). Reported: the medians, the median of the paired ratios B/A with a bootstrap 95%
interval, and the interquartile spread of the ratios. A ratio below 1 means B is faster.
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

VARIANTS = ("weights-after-sends", "per-leaf-reduce")

COLUMNS: list[C.Column] = [
    ("size", "size", ""),
    ("ranks", "ranks", "d"),
    ("data", "data", "d"),
    ("schedule", "schedule", ""),
    ("variant", "B", ""),
    ("a_ms", "A ms", ".1f"),
    ("b_ms", "B ms", ".1f"),
    ("ratio", "B/A", ".3f"),
    ("ci_lo", "95% lo", ".3f"),
    ("ci_hi", "95% hi", ".3f"),
    ("ratio_iqr", "IQR/med", ".2f"),
    ("grad_diff", "grads B vs A", ".1e"),
    ("runnable", "runnable (mean)", ".1f"),
    ("attempts", "runs", "d"),
]


def _pipelines(cfg: dict[str, Any], dtype: torch.dtype) -> tuple[Any, Any, list[Any], Any, Any]:
    """(A, B, params, x, y) for this cell's model in ``dtype`` (every rank calls this)."""
    import torch.distributed as dist

    import funcpipe as fp
    from funcpipe.schedule import weights_after_sends

    size = C.Size(**cfg["size"])
    program = C.program_for(
        cfg["schedule"],
        ranks=dist.get_world_size() // cfg.get("data", 1),
        microbatches=size.microbatches,
    )
    model = C.build(size, dtype=dtype, seed=cfg["seed"])
    stages, params = C.funcpipe_stages(model, size, program.n_stages)
    loss = C.loss_fn(size)
    a = fp.Pipeline(stages, program, loss_fn=loss, transport="dist")
    b: Any
    if cfg["variant"] == "weights-after-sends":
        b = fp.Pipeline(stages, weights_after_sends(a.program), loss_fn=loss, transport="dist")
    else:  # per-leaf-reduce
        b = _PerLeaf(fp.Pipeline(stages, program, loss_fn=loss, transport="dist"))
    x, y = C.data(size, dtype=dtype, seed=cfg["seed"] + 1)
    return a, b, params, x, y


class _PerLeaf:
    """A Pipeline whose steps reduce every gradient leaf alone (bucket cap 0)."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe

    def step(self, *args: Any, **kwargs: Any) -> Any:
        from funcpipe.runtime import buckets

        saved, buckets.BUCKET_BYTES = buckets.BUCKET_BYTES, 0
        try:
            return self.pipe.step(*args, **kwargs)
        finally:
            buckets.BUCKET_BYTES = saved


def cell(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One (size, ranks, schedule) cell on this rank: gradients, then paired times."""
    import torch.distributed as dist

    a, b, params, x, y = _pipelines(cfg, torch.float64)
    ga, gb = a.step(params, x, y).grads, b.step(params, x, y).grads
    fa = [t for g in ga if g is not None for t in C.flat_grads(g)]
    fb = [t for g in gb if g is not None for t in C.flat_grads(g)]
    out: dict[str, Any] = {"rank": rank, "grad_diff": C.max_rel_diff(fb, fa)}
    del a, b, params, ga, gb, fa, fb

    a, b, params, x, y = _pipelines(cfg, torch.float32)

    def timed(pipe: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(params, x, y)
        return time.perf_counter() - t0

    for _ in range(cfg["warmup"]):
        timed(a)
        timed(b)
    ta, tb = [], []
    for _ in range(cfg["pairs"]):
        ta.append(timed(a))
        tb.append(timed(b))
    out["a"], out["b"] = ta, tb
    return out


def run(args: argparse.Namespace, pools: C.Pools) -> list[dict[str, Any]]:
    from benchmarks import ab  # by module name, so the workers can unpickle the job

    rows: list[dict[str, Any]] = []
    for ranks in args.ranks:
        for size_name in C.sizes_for(args.model, args.sizes):
            size = C.SIZES[size_name]
            for sched in args.schedules:
                cfg = {
                    "size": vars(size),
                    "schedule": sched,
                    "seed": args.seed,
                    "pairs": args.pairs,
                    "warmup": args.warmup,
                    "variant": args.variant,
                    "data": args.data,
                }
                pool = pools.get(ranks * args.data)
                results, info = C.measured_cell(
                    lambda pool=pool, cfg=cfg: pool.run(ab.cell, cfg, timeout=args.job_timeout),
                    ranks=ranks * args.data,
                    quiet=args.quiet,
                    retries=args.retries,
                )
                ta = C.step_times([r["a"] for r in results])
                tb = C.step_times([r["b"] for r in results])
                ratios = C.paired_ratios(tb, ta)
                lo, hi = C.median_ci(ratios)
                row = {
                    "size": size.name,
                    "ranks": ranks,
                    "data": args.data,
                    "schedule": sched,
                    "variant": args.variant,
                    "a_ms": C.median(ta) * 1e3,
                    "b_ms": C.median(tb) * 1e3,
                    "ratio": C.median(ratios),
                    "ci_lo": lo,
                    "ci_hi": hi,
                    "ratio_iqr": C.spread(ratios),
                    "grad_diff": max(r["grad_diff"] for r in results),
                    "a_times": ta,
                    "b_times": tb,
                    **info,
                }
                rows.append(row)
                print(C.table([row], COLUMNS).splitlines()[-1], flush=True)
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="ab.py", description="funcpipe A/B: paired steps of a variant against the default."
    )
    ap.add_argument("--variant", choices=VARIANTS, required=True, help="what B changes")
    ap.add_argument("--model", choices=sorted(C.MODELS), default=None, help="gpt (default) or mlp")
    ap.add_argument(
        "--sizes", nargs="+", default=None, choices=sorted(C.SIZES), help="sizes to run instead"
    )
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument(
        "--data", type=C.int_at_least(1), default=1, help="data-parallel copies (processes: x)"
    )
    ap.add_argument(
        "--schedules", nargs="+", default=list(C.PEER_SCHEDULES), choices=list(C.SCHEDULES)
    )
    ap.add_argument("--pairs", type=C.int_at_least(1), default=20, help="timed A B pairs per cell")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each first")
    C.pool_options(ap)
    return ap


def main(
    argv: list[str] | None = None, *, pool: C.PoolFactory | None = None
) -> list[dict[str, Any]]:
    """Run the benchmark; ``pool(n)`` may supply started pools of ``n`` gloo processes."""
    rows: list[dict[str, Any]] = C.run_main("ab.py", argv, pool, parser, COLUMNS, run)
    return rows


if __name__ == "__main__":
    main()
