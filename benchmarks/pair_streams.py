"""An overlapped pair's turns against an asynchronous collective's stream rules, on one device.

    python benchmarks/pair_streams.py [--device cuda] [--calls 3] [--comm-ms 2] [--json out.json]

One GPU cannot host two NCCL ranks, so no all-to-all can run on one. What can be measured there
is whether the turns (:mod:`funcpipe.runtime.turns`) let one half's communication run under
the other half's kernels. The stand-in collective does what ``ProcessGroupNCCL::collective``
does for ``async_op=True``: it records an event on the caller's current stream, makes its own
stream (one for the "process group", as NCCL has one per communicator) wait for it, runs its
"communication" there (``torch.cuda._sleep`` for ``--comm-ms``), records an end event, and its
``wait()`` makes the caller's current stream wait for that event (``WorkNCCL::synchronizeStream``:
the host does not wait). Called without ``async_op`` it does the same and waits at once. On a
CPU its communication is a thread that sleeps, and ``wait()`` joins it.

Each half computes (``--matmuls`` square products of ``--size`` in a segment) before each of its
``--calls`` collectives and after the last. A: the halves one after the other, each collective
waited at once (outside a pair, :func:`~funcpipe.runtime.turns.complete` blocks); B: the two
through :func:`~funcpipe.runtime.turns.together`, the backward half on a second thread, as a pair
runs. Reported: each one's wall time (the best of ``--repeat``, the device synchronised), the
compute alone and the communication alone (the bounds: B can reach neither below
max(compute, communication) nor the sum), and B/A.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/x.py` puts benchmarks/ first, not the root
    sys.path.insert(0, str(ROOT))

from benchmarks._common import machine, write_json  # noqa: E402
from funcpipe.runtime.turns import complete, together  # noqa: E402


class _CudaWork:
    def __init__(self, end: Any) -> None:
        self.end = end

    def wait(self) -> bool:
        torch.cuda.current_stream().wait_event(self.end)  # (the stream waits, not the host)
        return True


class _ThreadWork:
    def __init__(self, seconds: float) -> None:
        self.thread = threading.Thread(target=time.sleep, args=(seconds,), daemon=True)
        self.thread.start()

    def wait(self) -> bool:
        self.thread.join()
        return True


def stand_in(device: torch.device, comm_ms: float) -> Callable[..., Any]:
    """A collective that moves nothing and takes ``comm_ms`` on its own stream (module
    docstring); ``call(async_op=False)``."""
    if device.type != "cuda":

        def on_cpu(async_op: bool = False) -> Any:
            work = _ThreadWork(comm_ms / 1e3)
            if async_op:
                return work
            work.wait()
            return None

        return on_cpu
    side = torch.cuda.Stream(device)
    cycles = _cycles_per_ms(device) * comm_ms

    def on_gpu(async_op: bool = False) -> Any:
        start = torch.cuda.Event()
        start.record()  # (the caller's current stream)
        side.wait_event(start)
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(cycles))
        end = torch.cuda.Event()
        end.record(side)
        work = _CudaWork(end)
        if async_op:
            return work
        work.wait()
        return None

    return on_gpu


def _cycles_per_ms(device: torch.device) -> float:
    torch.cuda._sleep(1_000_000)  # (warm)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(10_000_000)
    b.record()
    torch.cuda.synchronize(device)
    return 10_000_000 / a.elapsed_time(b)


def half(
    x: torch.Tensor, calls: int, matmuls: int, collective: Callable[..., Any] | None
) -> Callable[[], torch.Tensor]:
    """A half: ``matmuls`` products, a collective, ..., ``calls`` times, then ``matmuls`` more
    (``collective`` None: the compute alone)."""

    def run() -> torch.Tensor:
        y = x
        for k in range(calls + 1):
            for _ in range(matmuls):
                y = torch.tanh(y @ x)
            if k < calls and collective is not None:
                complete(collective)
        return y

    return run


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeat: int) -> float:
    """The best wall time of ``repeat`` runs of ``fn``, in ms, the device synchronised."""
    best = float("inf")
    for _ in range(repeat):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, (time.perf_counter() - t) * 1e3)
    return best


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    xs = [
        (torch.randn(args.size, args.size, generator=g) / args.size**0.5).to(device, dtype)
        for _ in range(2)
    ]
    comm = stand_in(device, args.comm_ms)
    fwd, bwd = (half(x, args.calls, args.matmuls, comm) for x in xs)
    plain = [half(x, args.calls, args.matmuls, None) for x in xs]
    for f in (fwd, bwd, *plain):  # (warm)
        f()
    rows = {
        "compute_ms": timed(lambda: [f() for f in plain], device, args.repeat),
        "communication_ms": 2 * args.calls * args.comm_ms,
        "a_ms": timed(lambda: (fwd(), bwd()), device, args.repeat),
        "b_ms": timed(lambda: together(fwd, bwd, device), device, args.repeat),
    }
    rows["ratio"] = rows["b_ms"] / rows["a_ms"]
    return {
        "device": str(device),
        "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "size": args.size,
        "matmuls": args.matmuls,
        "calls": args.calls,
        "comm_ms": args.comm_ms,
        **rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", type=int, default=None, help="4096 on a GPU, 256 on a CPU")
    p.add_argument("--matmuls", type=int, default=None, help="8 on a GPU, 4 on a CPU")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--comm-ms", type=float, default=2.0)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for name in ("size", "matmuls", "calls", "repeat"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name}={getattr(args, name)}: must be >= 1")
    if not args.comm_ms > 0:  # (NaN too)
        p.error(f"--comm-ms={args.comm_ms}: must be a time > 0 in milliseconds")
    gpu = torch.device(args.device).type == "cuda"
    args.size = args.size or (4096 if gpu else 256)
    args.matmuls = args.matmuls or (8 if gpu else 4)
    if not gpu:
        torch.set_num_threads(1)
    row = measure(args)
    print(
        f"{row['name']}: A (in sequence) {row['a_ms']:.2f} ms, B (turns) {row['b_ms']:.2f} ms, "
        f"B/A {row['ratio']:.3f}; compute alone {row['compute_ms']:.2f} ms, communication "
        f"alone {row['communication_ms']:.2f} ms"
    )
    write_json(args.json, {"machine": machine(), "command": sys.argv, "rows": [row]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
