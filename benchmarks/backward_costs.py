"""Two costs of a stage's backward that the profile points at, in one process, one thread.

    python benchmarks/backward_costs.py [--size small] [--reps 15] [--json FILE]
    MALLOC_TRIM_THRESHOLD_=4000000000 MALLOC_MMAP_THRESHOLD_=4000000000 python benchmarks/backward_costs.py

1. Accumulating weight gradients over 8 microbatches (a stage of 4 x Linear + GELU, each
   microbatch's F then its B, as in 1F1B): funcpipe's way, ``torch.autograd.grad`` for fresh
   gradients then ``add_`` into the first microbatch's, against ``torch.autograd.backward(...,
   inputs=[input, *params])`` accumulating into the per-step leaves' ``.grad`` inside the
   engine. Paired, ``--reps`` rounds.
2. F alone vs F and B alternating (funcpipe's autodiff): with glibc's default allocator, the
   fresh weight gradients freed after each backward are returned to the system and faulted back
   in by the next one; run the script with and without the environment above to see it.
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


def measure(size: C.Size, reps: int) -> dict[str, Any]:
    from funcpipe.runtime import autodiff
    from funcpipe.tree import tree_flatten

    model = C.mlp(size.width, layers=size.layers)
    stages, params = C.funcpipe_stages(model, 2)
    leaves, tree = tree_flatten(params[0])
    fn = C._flat_stage(stages[0], tree, sink=False, target=None)
    mb = size.batch // size.microbatches
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(mb, size.width, generator=g) for _ in range(size.microbatches)]
    gy: list[torch.Tensor | None] = [torch.randn(mb, size.width, generator=g)]

    def grad_then_add() -> float:
        ps = [t.detach().requires_grad_() for t in leaves]
        acc: list[torch.Tensor | None] = [None] * len(ps)
        spent = 0.0
        for x in xs:
            _, saved = autodiff.forward(fn, ps, [x])
            t0 = time.perf_counter()
            _, gp = autodiff.backward(saved, ps, gy)
            for i, gi in enumerate(gp):
                prev = acc[i]
                if prev is None:
                    acc[i] = gi
                elif gi is not None:
                    prev.add_(gi)
            spent += time.perf_counter() - t0
        return spent

    def into_dot_grad() -> float:
        ps = [t.detach().requires_grad_() for t in leaves]
        spent = 0.0
        for x in xs:
            h = x.detach().requires_grad_()
            out = fn(ps, [h])
            t0 = time.perf_counter()
            torch.autograd.backward(out, gy, inputs=[h, *ps])
            spent += time.perf_counter() - t0
        return spent

    def f_alone() -> float:
        t0 = time.perf_counter()
        autodiff.forward(fn, [t.detach().requires_grad_() for t in leaves], [xs[0]])
        return time.perf_counter() - t0

    ps = [t.detach().requires_grad_() for t in leaves]

    def f_then_b() -> tuple[float, float]:
        t0 = time.perf_counter()
        _, saved = autodiff.forward(fn, ps, [xs[0]])
        t1 = time.perf_counter()
        autodiff.backward(saved, ps, gy)
        return t1 - t0, time.perf_counter() - t1

    for _ in range(3):
        grad_then_add()
        into_dot_grad()
    a, b = [], []
    for _ in range(reps):
        a.append(grad_then_add())
        b.append(into_dot_grad())
    alone = C.time_calls(f_alone, reps=reps * 10, warmup=10)
    pairs = [f_then_b() for _ in range(reps * 10 + 10)][10:]
    return {
        "size": size.name,
        "grad_add_ms": C.median(a) * 1e3,
        "dot_grad_ms": C.median(b) * 1e3,
        "ratio": C.median(C.paired_ratios(a, b)),
        "f_alone_us": C.median(alone) * 1e6,
        "f_alternating_us": C.median(p[0] for p in pairs) * 1e6,
        "b_alternating_us": C.median(p[1] for p in pairs) * 1e6,
    }


COLUMNS: list[C.Column] = [
    ("size", "size", ""),
    ("grad_add_ms", "8 B: grad + add_ ms", ".2f"),
    ("dot_grad_ms", "8 B: into .grad ms", ".2f"),
    ("ratio", "ratio", ".2f"),
    ("f_alone_us", "F alone us", ".0f"),
    ("f_alternating_us", "F (F,B alternating) us", ".0f"),
    ("b_alternating_us", "B (F,B alternating) us", ".0f"),
]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(
        prog="backward_costs.py",
        description="Gradient accumulation and allocator costs of a stage's backward.",
    )
    ap.add_argument("--sizes", nargs="+", default=["small", "large"], choices=sorted(C.SIZES))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [measure(C.SIZES[s], args.reps) for s in args.sizes]
    print(C.table(rows, COLUMNS))
    C.write_json(
        args.json,
        {
            "command": ["backward_costs.py", *(argv if argv is not None else sys.argv[1:])],
            "rows": rows,
        },
    )
    return rows


if __name__ == "__main__":
    main()
