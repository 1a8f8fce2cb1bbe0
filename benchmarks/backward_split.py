"""Time of I + W against one full B for the same stage (funcpipe's backward split).

B is timed as the runtime runs it by default (``Pipeline(batch_weights=True)``: Linear weight
gradients added in place after one engine call) and as autograd's own backward (``B (engine)``).

    python benchmarks/backward_split.py [--width 512] [--batch 64] [--layers 4] [--reps 30]

Prints a table and writes JSON (``--json FILE``). One thread, float32, CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from funcpipe.runtime import autodiff


def measure(width: int, batch: int, layers: int, reps: int, *, seed: int = 0) -> dict[str, float]:
    """B against I then W, as the interpreter runs them (parameter gradients summed in place into
    the leaves' ``.grad``), each path on its own leaves, alternating. B is the runtime's whole
    backward (``Pipeline(batch_weights=True)``, the default: one engine call stopping at each
    Linear, whose weight gradient is then added in place); ``B (engine)`` is autograd's own
    (``batch_weights=False``)."""
    from funcpipe.runtime import linear

    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(width, width, generator=g) / width**0.5 for _ in range(layers)]
    weights += [torch.zeros(width) for _ in range(layers)]
    whole = [p.clone().requires_grad_() for p in weights]
    engine = [p.clone().requires_grad_() for p in weights]
    split = [p.clone().requires_grad_() for p in weights]

    def stage(ps, inputs):  # type: ignore[no-untyped-def]
        (h,) = inputs
        for k in range(layers):
            h = torch.nn.functional.gelu(torch.nn.functional.linear(h, ps[k], ps[layers + k]))
        return [h]

    x = torch.randn(batch, width, generator=g)
    gy = [torch.randn(batch, width, generator=g)]
    full, full_engine, split_i, split_w = [], [], [], []
    same = True
    nodes_whole, nodes_split = autodiff.param_nodes(whole), autodiff.param_nodes(split)
    for _ in range(reps):
        _, saved = autodiff.forward(stage, whole, [x])
        t0 = time.perf_counter()
        b_in, later = autodiff.backward_deferred(saved, whole, gy, nodes=nodes_whole)
        if later is not None:
            linear.weight_batch([later], whole)
        full.append(time.perf_counter() - t0)
        _, saved = autodiff.forward(stage, engine, [x])
        t0 = time.perf_counter()
        autodiff.backward(saved, engine, gy, accumulate=True)
        full_engine.append(time.perf_counter() - t0)
        _, saved = autodiff.forward(stage, split, [x])
        t0 = time.perf_counter()
        i_in = autodiff.backward_input(saved, split, gy, nodes=nodes_split)
        t1 = time.perf_counter()
        autodiff.backward_weight(saved, split, accumulate=True)
        t2 = time.perf_counter()
        split_i.append(t1 - t0)
        split_w.append(t2 - t1)
        same = same and all(
            torch.allclose(a, c, rtol=1e-5, atol=1e-6) for a, c in zip(b_in, i_in, strict=True)
        )
    same = same and all(
        torch.allclose(a.grad, c.grad, rtol=1e-4, atol=1e-5)  # type: ignore[arg-type]
        for trio in zip(whole, engine, split, strict=True)
        for a, c in ((trio[0], trio[2]), (trio[1], trio[2]))
    )
    b, be, i, w = (statistics.median(v) * 1e3 for v in (full, full_engine, split_i, split_w))
    return {
        "width": width,
        "batch": batch,
        "layers": layers,
        "B_ms": b,
        "B_engine_ms": be,
        "I_ms": i,
        "W_ms": w,
        "ratio": (i + w) / b,
        "ratio_engine": (i + w) / be,
        "grads_equal": same,
    }


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, nargs="*", default=[512, 1024])
    ap.add_argument("--batch", type=int, nargs="*", default=[64, 256])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [
        measure(wd, bt, args.layers, args.reps)
        for wd, bt in zip(args.width, args.batch, strict=False)
    ]
    print(
        f"{'width':>6} {'batch':>6} {'B ms':>8} {'I ms':>8} {'W ms':>8} {'(I+W)/B':>8}"
        f" {'B (engine) ms':>14} {'(I+W)/B (engine)':>17}  grads equal"
    )
    for r in rows:
        print(
            f"{r['width']:>6} {r['batch']:>6} {r['B_ms']:>8.2f} {r['I_ms']:>8.2f} {r['W_ms']:>8.2f}"
            f" {r['ratio']:>8.3f} {r['B_engine_ms']:>14.2f} {r['ratio_engine']:>17.3f}"
            f"  {r['grads_equal']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
