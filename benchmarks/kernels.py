"""The arithmetic inside a step: each kernel's time in the step against the same kernel hot.

    python benchmarks/kernels.py [--sizes small] [--ranks 2] [--schedules 1f1b zbv] [--steps 20]

A step's CPU time splits into the kernels that do the model's arithmetic and everything around
them (autograd's bookkeeping, the runtime, messages). And a kernel inside a step can take longer
than the same kernel run again and again on the same tensors ("hot"): between two uses of a
weight, the step touches the other layers' weights, gradients and activations, so its operands
come from further away in the memory hierarchy.

Per (size, ranks, schedule), on one gloo pool: funcpipe (``Pipeline(transport="dist")``) and
torch.distributed.pipelining run the same model and schedule. For each library every rank
times a block of ``--steps`` steps (CPU time, ``time.process_time``), then runs another block
under a dispatch mode that reads the thread's CPU time (``time.thread_time``) around every aten
op (autograd's backward included) and sums it: for the kernels of the arithmetic (``KERNELS``:
the Linear products and GELU with its derivative) by kernel and input shapes, for every other
op by name. After both libraries' blocks every rank replays each (kernel, shapes) hot: fresh
operands of the recorded shapes (a Linear's weight transposed as ``nn.Linear`` passes it, the
runtime's weight product ``addmm_`` with a transposed gradient), ``--hot-reps`` calls in a
row, the median CPU time of one.
Reported per library, per step and summed over the ranks: CPU, the kernels' CPU time in the
step, the same calls hot, and the rest (CPU minus the kernels in the step), split into the
other aten ops (bias sums, transposes, views, the loss, collectives...) and what runs outside
any op (Python, autograd's engine, system calls); on funcpipe's row
``kernels / peer CPU``: its kernels' time in the step against the peer's whole CPU per step, the
CPU ratio funcpipe / peer a step would reach with nothing but those kernels. CPU time, not wall
time: a rank that loses its core in the middle of a kernel (4 ranks on 2 cores, gloo's threads)
is not charged for the wait. The dispatch mode's Python runs between the ops of the clocked
block, never inside the timed calls; the block's CPU is measured without it (so "outside ops",
the block's CPU minus the clocked ops, leans low: the clocked block's ops meet caches its
Python has disturbed).

``--sweep``: in this process, one thread, the microbatch's Linear product (``x @ w.T`` with
``x`` of the model's microbatch rows, ``w`` one width x width weight) over N weights in turn,
for working sets of N weights from 1 MiB up: microseconds per product. Where the step's
working set no longer fits the caches, each product waits for its weight.

Before the timed steps both libraries make one float64 step from the same weights and their
gradients are compared (``grads fp vs peer``: max |difference| / max |gradient|).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C

DEFAULT_SCHEDULES = ["1f1b", "zbv"]
LIBS = ("funcpipe", "peer")
# the kernels of the benchmark MLP's arithmetic: Linear forward (addmm), input and weight
# gradients (mm; funcpipe sums weight gradients in place with addmm_), GELU and its derivative
KERNELS = ("aten::addmm", "aten::mm", "aten::addmm_", "aten::gelu", "aten::gelu_backward")

COLUMNS: list[C.Column] = [
    ("size", "size", ""),
    ("ranks", "ranks", "d"),
    ("schedule", "schedule", ""),
    ("lib", "library", ""),
    ("step_ms", "step ms", ".2f"),
    ("cpu_ms", "CPU ms (all ranks)", ".1f"),
    ("kernels_ms", "kernels in step ms", ".1f"),
    ("hot_ms", "same kernels hot ms", ".1f"),
    ("in_step_vs_hot", "in step / hot", ".2f"),
    ("rest_ms", "rest ms", ".1f"),
    ("others_ms", "other ops ms", ".1f"),
    ("outside_ms", "outside ops ms", ".1f"),
    ("kernels_vs_peer_cpu", "kernels / peer CPU", ".2f"),
    ("grad_diff", "grads fp vs peer", ".1e"),
    ("runnable", "runnable (mean)", ".1f"),
    ("attempts", "runs", "d"),
]

SWEEP_COLUMNS: list[C.Column] = [
    ("mib", "working set MiB", "d"),
    ("weights", "weights", "d"),
    ("us_per_product", "us per product", ".1f"),
    ("vs_smallest", "vs 1 weight", ".2f"),
]


def _operands(name: str, shapes: Sequence[Sequence[int]], dtype: Any) -> list[Any] | None:
    """Fresh operands of the recorded shapes for a hot replay (``None``: not replayable)."""

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype)

    dims = [list(s) for s in shapes]
    if name == "aten::addmm" and len(dims) >= 3 and len(dims[2]) == 2:
        n, k = dims[2][1], dims[2][0]
        return [r(*dims[0]), r(*dims[1]), r(n, k).t()]  # bias, input, Linear weight transposed
    if name == "aten::addmm_" and len(dims) >= 3 and len(dims[1]) == 2:
        a, b = dims[1]
        return [r(*dims[0]), r(b, a).t(), r(*dims[2])]  # gradient sum += g.t() @ x
    if name == "aten::mm" and len(dims) >= 2:
        return [r(*dims[0]), r(*dims[1])]
    tensors = [d for d in dims if d]  # (a non-tensor argument records [])
    if name == "aten::gelu" and len(tensors) == 1:
        return [r(*tensors[0])]
    if name == "aten::gelu_backward" and len(tensors) == 2:
        return [r(*tensors[0]), r(*tensors[1])]
    return None


_CALLS: dict[str, Callable[..., Any]] = {
    "aten::addmm": torch.addmm,
    "aten::addmm_": lambda out, a, b: out.addmm_(a, b),
    "aten::mm": torch.mm,
    "aten::gelu": torch.nn.functional.gelu,
    "aten::gelu_backward": torch.ops.aten.gelu_backward,
}


def hot_us(
    name: str, shapes: Sequence[Sequence[int]], dtype: Any, reps: int, onednn: bool = True
) -> float | None:
    """Median CPU microseconds of the kernel called ``reps`` times in a row on the same
    operands (``None``: not replayable); ``onednn``: with oneDNN on, as the step called it
    (funcpipe's chain stages turn it off for small GELUs)."""
    ops = _operands(name, shapes, dtype)
    if ops is None or reps < 1:
        return None
    f = _CALLS[name]
    times = []
    clock = time.thread_time
    with torch.backends.mkldnn.flags(enabled=onednn):
        for _ in range(3):
            f(*ops)
        for _ in range(reps):
            t0 = clock()
            f(*ops)
            times.append(clock() - t0)
    return statistics.median(times) * 1e6


def kernel_clock() -> Any:
    """A dispatch mode that sums the CPU time (``time.thread_time``) and counts the calls of
    every aten op: each kernel of ``KERNELS`` by the shapes of its positional arguments
    (``[]``: not a tensor) and whether oneDNN was on in ``.got`` ((kernel, shapes, oneDNN) ->
    {shapes, onednn, calls, us}), every other op by name in ``.others`` (name -> {calls, us}). It sees the ops of autograd's backward too
    (on CPU the engine runs them on the calling thread)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class KernelClock(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.got: dict[tuple[str, str, bool], dict[str, Any]] = {}
            self.others: dict[str, dict[str, Any]] = {}

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            t0 = time.thread_time()
            out = func(*args, **(kwargs or {}))
            dt = time.thread_time() - t0
            name = func._schema.name
            if name in KERNELS:
                shapes = [list(t.shape) if isinstance(t, torch.Tensor) else [] for t in args]
                onednn = torch._C._get_mkldnn_enabled()
                got = self.got.setdefault(
                    (name, str(shapes), onednn),
                    {"shapes": shapes, "onednn": onednn, "calls": 0, "us": 0.0},
                )
            else:
                got = self.others.setdefault(name, {"calls": 0, "us": 0.0})
            got["calls"] += 1
            got["us"] += dt * 1e6
            return out

    return KernelClock()


def clocked(step: Callable[[], Any], steps: int) -> Any:
    """The :func:`kernel_clock` of ``steps`` steps."""
    clock = kernel_clock()
    with clock:
        for _ in range(steps):
            step()
    return clock


def job(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from benchmarks import vs_peer

    steps, diff = vs_peer.both_steps(rank, cfg)
    out: dict[str, Any] = {"rank": rank, "grad_diff": diff}
    for lib in LIBS:
        for _ in range(cfg["warmup"]):
            steps[lib]()
        dist.barrier()
        cpu0, t0 = time.process_time(), time.perf_counter()
        for _ in range(cfg["steps"]):
            steps[lib]()
        dist.barrier()  # the block ends when the slowest rank is done
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        dist.barrier()
        clock = clocked(steps[lib], cfg["steps"])
        dist.barrier()
        out[lib] = {"wall": wall, "cpu": cpu, "kernels": clock.got, "others": clock.others}
    # hot replays after both blocks, all ranks at once (as the steps ran); rows keyed by
    # name, not by tuple, for the JSON
    for lib in LIBS:
        out[lib]["kernels"] = [
            {
                "kernel": name,
                **k,
                "hot_us": hot_us(
                    name, k["shapes"], torch.float32, cfg["hot_reps"], onednn=k["onednn"]
                ),
            }
            for (name, _, _), k in out[lib]["kernels"].items()
        ]
    return out


def _tally(into: dict[Any, dict[str, Any]], key: Any, got: dict[str, Any]) -> dict[str, Any]:
    """Add ``got``'s calls and us into ``into[key]`` (created at zero); returns that entry."""
    entry = into.setdefault(key, {"calls": 0, "us": 0.0})
    entry["calls"] += got["calls"]
    entry["us"] += got["us"]
    return entry


def summarize(per_rank: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """One row per library: per step, summed over the ranks."""
    rows = []
    for lib in LIBS:
        wall = per_rank[0][lib]["wall"] / steps
        cpu = sum(r[lib]["cpu"] for r in per_rank) / steps
        kernels: dict[tuple[str, str], dict[str, Any]] = {}
        others: dict[str, dict[str, Any]] = {}
        for r in per_rank:
            for k in r[lib]["kernels"]:
                got = _tally(kernels, (k["kernel"], str(k["shapes"])), k)
                got.setdefault("kernel", k["kernel"])
                got.setdefault("shapes", k["shapes"])
                # the same calls hot, in us (None: some rank could not replay them)
                prev = got.get("hot", 0.0)
                got["hot"] = (
                    None if prev is None or k["hot_us"] is None else prev + k["hot_us"] * k["calls"]
                )
            for name, o in r[lib]["others"].items():
                _tally(others, name, o)
        replayed = [k for k in kernels.values() if k["hot"] is not None]
        others_ms = sum(o["us"] for o in others.values()) / steps / 1e3
        in_step = sum(k["us"] for k in kernels.values()) / steps / 1e3
        in_step_replayed = sum(k["us"] for k in replayed) / steps / 1e3
        hot = sum(k["hot"] for k in replayed) / steps / 1e3
        detail = [
            {
                "kernel": k["kernel"],
                "shapes": k["shapes"],
                "calls_per_step": k["calls"] / steps,
                "in_step_us": k["us"] / k["calls"],
                "hot_us": None if k["hot"] is None else k["hot"] / k["calls"],
            }
            for k in sorted(kernels.values(), key=lambda k: -k["us"])
            if k["calls"]
        ]
        rows.append(
            {
                "lib": lib,
                "step_ms": wall * 1e3,
                "cpu_ms": cpu * 1e3,
                "kernels_ms": in_step,
                "hot_ms": hot,
                # over the kernels replayed hot (all of KERNELS' shapes in the benchmark MLP)
                "in_step_vs_hot": in_step_replayed / hot if hot > 0 else None,
                "not_replayed_ms": in_step - in_step_replayed,
                "rest_ms": cpu * 1e3 - in_step,
                "others_ms": others_ms,
                "outside_ms": cpu * 1e3 - in_step - others_ms,
                "other_ops": {
                    name: {
                        "calls_per_step": o["calls"] / steps,
                        "ms_per_step": o["us"] / steps / 1e3,
                    }
                    for name, o in sorted(others.items(), key=lambda kv: -kv[1]["us"])
                },
                "grad_diff": max(r["grad_diff"] for r in per_rank),
                "kernels": detail,
            }
        )
    return rows


def sweep(width: int, rows: int, mib: Sequence[int], reps: int) -> list[dict[str, Any]]:
    """Microseconds per ``x @ w.T`` (``x``: rows x width) cycling over enough width x width
    weights to fill each working set in ``mib``."""
    x = torch.randn(rows, width)
    per_weight = width * width * 4
    out = []
    for size in mib:
        n = max(1, (size << 20) // per_weight)
        ws = [torch.randn(width, width) for _ in range(n)]
        calls = max(reps, n)
        for w in ws:  # touch every weight once
            torch.mm(x, w.t())
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for c in range(calls):
                torch.mm(x, ws[c % n].t())
            samples.append((time.perf_counter() - t0) / calls * 1e6)
        out.append({"mib": size, "weights": n, "us_per_product": statistics.median(samples)})
    base = out[0]["us_per_product"] if out else 1.0
    for r in out:
        r["vs_smallest"] = r["us_per_product"] / base
    return out


def run(args: argparse.Namespace, pools: C.Pools) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from benchmarks import kernels

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
                    "warmup": args.warmup,
                    "hot_reps": args.hot_reps,
                }
                pool = pools.get(ranks)
                per_rank, info = C.measured_cell(
                    lambda pool=pool, cfg=cfg: pool.run(kernels.job, cfg, timeout=args.job_timeout),
                    ranks=ranks,
                    quiet=args.quiet,
                    retries=args.retries,
                )
                lib_rows = summarize(per_rank, args.steps)
                fp_row, peer_row = lib_rows  # (LIBS order)
                fp_row["kernels_vs_peer_cpu"] = fp_row["kernels_ms"] / peer_row["cpu_ms"]
                for lib_row in lib_rows:
                    row = {"size": size.name, "ranks": ranks, "schedule": sched, **lib_row, **info}
                    rows.append(row)
                    print(C.table([row], COLUMNS).splitlines()[-1], flush=True)
    extras: dict[str, Any] = {}
    if args.sweep:
        size = C.SIZES[args.sizes[0]]
        got = sweep(size.width, size.batch // size.microbatches, args.sweep, args.sweep_reps)
        extras["sweep"] = got
        print()
        print(f"one product of {size.batch // size.microbatches} x {size.width} rows by a weight:")
        print(C.table(got, SWEEP_COLUMNS))
    return rows, extras


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kernels.py",
        description="The arithmetic's kernels inside a step against the same kernels hot, "
        "funcpipe and torch.distributed.pipelining.",
    )
    ap.add_argument("--sizes", nargs="+", default=["small"], choices=sorted(C.SIZES))
    ap.add_argument("--ranks", nargs="+", type=int, default=[2])
    ap.add_argument("--schedules", nargs="+", default=DEFAULT_SCHEDULES, choices=C.PEER_SCHEDULES)
    ap.add_argument("--steps", type=int, default=20, help="steps per block (timed, then clocked)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    ap.add_argument("--hot-reps", type=int, default=200, help="calls per hot kernel replay")
    ap.add_argument(
        "--sweep",
        nargs="*",
        type=int,
        default=[],
        metavar="MIB",
        help="working sets (MiB) for the product-time sweep, e.g. 1 2 4 8 16 32 64",
    )
    ap.add_argument("--sweep-reps", type=int, default=256, help="products per sweep sample")
    C.pool_options(ap)
    return ap


def main(argv: list[str] | None = None, *, pool: C.PoolFactory | None = None) -> Any:
    return C.run_main("kernels.py", argv, pool, parser, COLUMNS, run)


if __name__ == "__main__":
    main()
