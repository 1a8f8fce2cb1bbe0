"""What batching the weight gradients of several microbatches would save (the next lever).

    python benchmarks/weight_batching.py [--shapes 512x8 1024x32] [--microbatches 8]

A Linear layer's weight gradient over a step is the sum over microbatches of ``dy_k^T x_k``.
Pipelines (funcpipe's and the peer's) compute it per microbatch: ``m`` skinny products, each
written into a fresh ``width x width`` tensor and added into the gradient. The same sum is one
product of the concatenated rows. This times both on one thread, per layer, for the benchmark
models' microbatch shapes (small: width 512, 8 rows; large: width 1024, 32 rows), and checks
that they agree. Not something funcpipe does yet: it changes what a W instruction is.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch


def measure(width: int, rows: int, microbatches: int, reps: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(rows, width, generator=g) for _ in range(microbatches)]
    dys = [torch.randn(rows, width, generator=g) for _ in range(microbatches)]

    def per_microbatch() -> torch.Tensor:
        total = dys[0].t() @ xs[0]
        for x, dy in zip(xs[1:], dys[1:], strict=True):
            total.add_(dy.t() @ x)
        return total

    def batched() -> torch.Tensor:
        return torch.cat(dys).t() @ torch.cat(xs)

    times: dict[str, list[float]] = {"per_microbatch": [], "batched": []}
    for _ in range(3):
        per_microbatch(), batched()
    for _ in range(reps):  # alternating, so a drift in the machine's speed hits both
        for name, fn in (("per_microbatch", per_microbatch), ("batched", batched)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    a, b = per_microbatch(), batched()
    same = bool(torch.allclose(a, b, rtol=1e-4, atol=1e-4 * float(a.abs().max())))
    per, one = (statistics.median(times[k]) * 1e3 for k in ("per_microbatch", "batched"))
    return {
        "width": width,
        "rows": rows,
        "microbatches": microbatches,
        "per_microbatch_ms": per,
        "batched_ms": one,
        "ratio": per / one,
        "same": same,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["512x8", "1024x32"], help="WIDTHxROWS")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    print(
        f"{'width':>6} {'rows':>5} {'m':>3} {'m products ms':>14} {'one product ms':>15} {'ratio':>6}"
    )
    for shape in args.shapes:
        width, n = (int(v) for v in shape.lower().split("x"))
        r = measure(width, n, args.microbatches, args.reps)
        rows.append(r)
        print(
            f"{width:>6} {n:>5} {args.microbatches:>3} {r['per_microbatch_ms']:>14.3f} "
            f"{r['batched_ms']:>15.3f} {r['ratio']:>6.2f}  {'same' if r['same'] else 'DIFFERENT'}"
        )
    return rows


if __name__ == "__main__":
    main()
