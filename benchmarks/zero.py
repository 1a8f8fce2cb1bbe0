"""What sharding the optimizer state over data-parallel copies (``Pipeline(zero=1)``, ZeRO-1)
saves in bytes per rank, and what it costs in step time, on CPU gloo processes.

    python benchmarks/zero.py [--size gpt] [--data 2 4] [--pairs 8] [--level 1] [--json FILE]

``--level 2`` compares ``zero=2`` (ZeRO-2: a reduce-scatter per stage and microbatch) with
``zero=0`` instead. The sharded run's figures fill the ``zero1`` / ``1`` fields (``opt1_kib``,
``bytes["zero1"]``, ``zero1_ms``...) at either level; every row and timing says which in
``level``, and the printed headers say "sharded".

The benchmark GPT (fp32, untied head) cut into 2 pipeline stages (1F1B), ``data`` copies of the
program: ``2 x data`` processes. Each copy takes ``1 / data`` of the global batch (``batch``
sequences). AdamW (``funcpipe.optim.adamw``, float32 parameters: no master copy).

Bytes, per rank, summed over the tensors it holds (``nbytes``), unsharded (``zero=0``) and
sharded (``zero=1``, or ``2``), after ``--steps`` optimizer steps:

- ``optimizer``: AdamW's ``mu`` and ``nu`` (and ``master`` where there is one);
- ``gradients``: what ``pipe.step`` returns (the averaged gradient, or this copy's shard of it);
- ``params held``: what the rank keeps between steps (full parameters, or its shards);
- ``full params``: the bytes of the full parameters a step computes with, from their shapes,
  not measured (sharded: what its GATHERs rebuild; ``benchmarks/zero_peak.py`` measures them
  inside a step).

Step time: the two runs' pipelines live side by side in the same processes and their training
steps (``pipe.step`` + the AdamW update) alternate, ``--pairs`` times (the order swapped every
pair), each after a barrier; a step's time is its slowest rank's. Reported: the median of the
paired ratios sharded / unsharded and its spread (IQR / median): the reduce-scatter + all-gather
of the sharded run against the all-reduce of the unsharded one (and the update of a shard
against the update of everything).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C

MEMORY_COLUMNS: list[C.Column] = [
    ("size", "size", ""),
    ("data", "data", "d"),
    ("rank", "rank", "d"),
    ("stages", "stage", ""),
    ("params", "params (full)", "d"),
    ("opt0_kib", "optimizer KiB zero=0", ".1f"),
    ("opt1_kib", "optimizer KiB sharded", ".1f"),
    ("opt_ratio", "optimizer sharded/zero0", ".4f"),
    ("grad0_kib", "gradients KiB zero=0", ".1f"),
    ("grad1_kib", "gradients KiB sharded", ".1f"),
    ("held0_kib", "params held KiB zero=0", ".1f"),
    ("held1_kib", "params held KiB sharded", ".1f"),
    ("step1_kib", "full params KiB (shapes)", ".1f"),
    ("within_5pct", "optimizer x 1/d within 5%", ""),
]

TIME_COLUMNS: list[C.Column] = [
    ("size", "size", ""),
    ("data", "data", "d"),
    ("processes", "processes", "d"),
    ("zero0_ms", "zero=0 step ms", ".1f"),
    ("zero1_ms", "sharded step ms", ".1f"),
    ("ratio", "sharded / zero0 (median of pairs)", ".3f"),
    ("spread", "spread (IQR / median)", ".3f"),
    ("pairs", "pairs", "d"),
    ("runnable", "runnable (mean)", ".1f"),
]


def nbytes(tree: Any) -> int:
    """Bytes of every tensor leaf of ``tree`` (``None`` leaves count 0)."""
    import torch

    leaves = torch.utils._pytree.tree_leaves(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _state_bytes(state: Any) -> int:
    return nbytes(state.mu) + nbytes(state.nu) + nbytes(getattr(state, "master", None))


class _Run:
    """One training run in this process: its pipeline, values (params or shards), states."""

    def __init__(
        self, size: C.Size, zero: int, microbatches: int, seed: int, schedule: str = "1f1b"
    ) -> None:
        import funcpipe as fp
        from funcpipe.schedule import generate
        from funcpipe.train.optimizers import adamw

        program = generate(schedule, ranks=2, microbatches=microbatches)
        model = C.build(size, seed=seed)
        stages, params = C.funcpipe_stages(model, size, program.n_stages)
        self.pipe = fp.Pipeline(stages, program, loss_fn=C.loss_fn(size), zero=zero)
        self.zero = zero
        self.mine = sorted(self.pipe.program.stages_on(self.pipe.rank))
        self.full = {o: params[o] for o in self.mine}
        self.values: Any = self.pipe.shard(tuple(params)) if zero else tuple(params)
        self.opt = adamw(1e-4)
        self.states = {o: self.opt.init(self.values[o]) for o in self.mine}
        self.grads: Any = None

    def train_step(self, x: Any, y: Any) -> tuple[float, float]:
        """One step and update; (step seconds, update seconds)."""
        t0 = time.perf_counter()
        _, grads = self.pipe.step(self.values, x, y)
        t1 = time.perf_counter()
        values = list(self.values)
        for o in self.mine:
            values[o], self.states[o] = self.opt.update(grads[o], self.states[o], values[o])
        self.values = tuple(values)
        self.grads = grads
        return t1 - t0, time.perf_counter() - t1

    def bytes(self) -> dict[str, int]:
        return {
            "params": sum(t.numel() for o in self.mine for t in C.flat_grads(self.full[o])),
            "optimizer": sum(_state_bytes(self.states[o]) for o in self.mine),
            "gradients": sum(nbytes(self.grads[o]) for o in self.mine),
            "held": sum(nbytes(self.values[o]) for o in self.mine),
            "in_step": sum(nbytes(self.full[o]) for o in self.mine),
        }


def job(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    size = C.Size(**cfg["size"])
    world = dist.get_world_size()
    data = world // 2
    level = cfg.get("level", 1)
    runs = [_Run(size, z, cfg["microbatches"], cfg["seed"]) for z in (0, level)]
    copy = runs[1].pipe._world.copy  # type: ignore[union-attr]
    x, y = C.data(size, seed=cfg["seed"] + 1)
    share = size.batch // data
    x, y = x[copy * share : (copy + 1) * share], y[copy * share : (copy + 1) * share]
    for _ in range(cfg["steps"]):  # bytes after these; warm-up for the timing
        for r in runs:
            r.train_step(x, y)
    # "zero1": the sharded run's, at cfg["level"] (1 or 2)
    got = {("zero1" if r.zero else "zero0"): r.bytes() for r in runs}
    times: dict[str, list[list[float]]] = {"zero0": [], "zero1": []}
    for k in range(cfg["pairs"]):
        for r in runs if k % 2 == 0 else runs[::-1]:
            dist.barrier()
            times["zero1" if r.zero else "zero0"].append(list(r.train_step(x, y)))
    for r in runs:
        r.pipe.close()
    stage = runs[0].mine
    return {"rank": rank, "data": data, "copy": copy, "stages": stage, "bytes": got, "times": times}


def _paired(per_rank: list[list[list[float]]]) -> list[float]:
    """Each pair's step + update time: the slowest rank's."""
    return C.step_times([[s + u for s, u in ts] for ts in per_rank])


def run(args: argparse.Namespace, pools: C.Pools) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from benchmarks import zero

    size = C.resize(C.SIZES[args.size], layers=args.layers)
    rows: list[dict[str, Any]] = []
    timing: list[dict[str, Any]] = []
    for data in args.data:
        if size.batch % (data * args.microbatches):
            raise SystemExit(
                f"--data {data} --microbatches {args.microbatches}: the global batch of "
                f"{size.batch} sequences must split into data x microbatches"
            )
        cfg = {
            "size": vars(size),
            "microbatches": args.microbatches,
            "steps": args.steps,
            "pairs": args.pairs,
            "seed": args.seed,
            "level": args.level,
        }
        pool = pools.get(2 * data)
        got, info = C.measured_cell(
            lambda pool=pool, cfg=cfg: pool.run(zero.job, cfg, timeout=args.job_timeout),
            ranks=2 * data,
            quiet=args.quiet,
            retries=args.retries,
        )
        for r in sorted(got, key=lambda r: r["rank"]):
            b0, b1 = r["bytes"]["zero0"], r["bytes"]["zero1"]
            ratio = b1["optimizer"] / b0["optimizer"]
            row = {
                "size": size.name,
                "data": data,
                "level": args.level,
                "rank": r["rank"],
                "copy": r["copy"],
                "stages": r["stages"],
                "params": b0["params"],
                "opt0_kib": b0["optimizer"] / 1024,
                "opt1_kib": b1["optimizer"] / 1024,
                "opt_ratio": ratio,
                "within_5pct": abs(ratio * data - 1) <= 0.05,
                "grad0_kib": b0["gradients"] / 1024,
                "grad1_kib": b1["gradients"] / 1024,
                "held0_kib": b0["held"] / 1024,
                "held1_kib": b1["held"] / 1024,
                "step0_kib": b0["in_step"] / 1024,
                "step1_kib": b1["in_step"] / 1024,
                "bytes": r["bytes"],
            }
            rows.append(row)
            print(C.table([row], MEMORY_COLUMNS).splitlines()[-1], flush=True)
        ranks = [r["times"] for r in sorted(got, key=lambda r: r["rank"])]
        t0, t1 = (_paired([t[k] for t in ranks]) for k in ("zero0", "zero1"))
        ratios = C.paired_ratios(t1, t0)
        timing.append(
            {
                "size": size.name,
                "data": data,
                "level": args.level,
                "processes": 2 * data,
                "zero0_ms": C.median(t0) * 1e3,
                "zero1_ms": C.median(t1) * 1e3,
                "ratio": C.median(ratios),
                "ratio_ci": C.median_ci(ratios),
                "spread": C.spread(ratios),
                "pairs": len(ratios),
                "zero0_times": t0,
                "zero1_times": t1,
                "per_rank_times": ranks,
                **info,
            }
        )
    print()
    print(C.table(timing, TIME_COLUMNS))
    return rows, {"timing": timing}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="zero.py",
        description="Bytes per rank and paired step time of Pipeline(zero=1 or 2) against zero=0.",
    )
    ap.add_argument("--size", default="gpt", choices=[n for n, s in C.SIZES.items()])
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument(
        "--data", nargs="+", type=C.int_at_least(2, "sharding needs copies"), default=[2, 4]
    )
    ap.add_argument("--microbatches", type=C.int_at_least(1), default=4, help="per copy")
    ap.add_argument("--steps", type=C.int_at_least(1), default=2, help="before the bytes")
    ap.add_argument("--pairs", type=C.int_at_least(1), default=8)
    ap.add_argument(
        "--level",
        type=int,
        choices=(1, 2),
        default=1,
        help="the sharded run: zero=1 or zero=2 (its figures fill the zero1 columns; default 1)",
    )
    C.pool_options(ap, job_timeout=900.0)
    return ap


def main(
    argv: list[str] | None = None, *, pool: C.PoolFactory | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run the benchmark; ``pool(n)`` may supply started pools of ``n`` gloo processes."""
    result: tuple[list[dict[str, Any]], dict[str, Any]] = C.run_main(
        "zero.py", argv, pool, parser, MEMORY_COLUMNS, run
    )
    return result


if __name__ == "__main__":
    main()
