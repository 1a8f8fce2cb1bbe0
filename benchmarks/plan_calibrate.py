"""Measure the efficiencies the planner (funcpipe.planner) is calibrated on, on one GPU.

``python benchmarks/plan_calibrate.py > out.json`` on a CUDA machine (needs torch, nothing from
funcpipe). In bf16 it times: matrix products ``(M, K) @ (K, N)`` over the shapes a transformer
block makes; memory-bound ops (add, GeLU, LayerNorm, softmax over 4096 columns); causal fused
attention (``scaled_dot_product_attention``) forward and forward + backward. Each number is the
mean of 20 runs after 3 warm-ups, timed with CUDA events. ``--shares`` reads such a JSON and
prints each as a share of the chip's datasheet peak: what ``funcpipe/planner/calibration.py``
holds. ``benchmarks/results/plan_calibrate_h100.json`` is one run on an H100 80GB HBM3.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

SHAPES = (
    (256, 1024), (512, 2048), (768, 3072), (1024, 4096), (1536, 6144), (2048, 8192),
    (3072, 12288), (4096, 16384), (1024, 1024), (2048, 2048), (4096, 4096), (8192, 8192),
    (12288, 12288), (6144, 1536), (16384, 4096),
)  # fmt: skip
ATTENTION = ((1, 16, 2048, 64), (1, 32, 2048, 128), (4, 16, 2048, 128), (1, 12, 2048, 96),
             (2, 24, 1024, 128), (1, 8, 4096, 128))  # fmt: skip
H100 = (989e12, 3.35e12)  # dense bf16 FLOP/s, HBM3 bytes/s (SXM datasheet)


def measure() -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    def timed(fn: Callable[[], object], reps: int = 20) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / 1e3 / reps

    dt, dev = torch.bfloat16, "cuda"
    out: dict[str, Any] = {"dev": torch.cuda.get_device_name(), "g": [], "m": [], "a": []}
    for m in (2048, 4096, 8192, 16384):
        for n, k in SHAPES:
            x = torch.randn(m, k, device=dev, dtype=dt)
            w = torch.randn(k, n, device=dev, dtype=dt)
            out["g"].append([m, n, k, timed(lambda x=x, w=w: x @ w)])
    for numel in (2**22, 2**24, 2**26, 2**28):
        x = torch.randn(numel, device=dev, dtype=dt)
        y = torch.randn(numel, device=dev, dtype=dt)
        x2 = x.view(-1, 4096)
        ln = torch.nn.LayerNorm(4096, device=dev, dtype=dt)
        ops: tuple[tuple[str, Callable[[], object]], ...] = (
            ("add", lambda x=x, y=y: x + y),
            ("gelu", lambda x=x: F.gelu(x)),
            ("ln", lambda x2=x2, ln=ln: ln(x2)),
            ("sm", lambda x2=x2: torch.softmax(x2, -1)),
        )
        for name, fn in ops:
            out["m"].append([name, numel, timed(fn)])
    for b, h, s, e in ATTENTION:
        q, k, v = (
            torch.randn(b, h, s, e, device=dev, dtype=dt, requires_grad=True) for _ in range(3)
        )

        def fwd(q: Any = q, k: Any = k, v: Any = v) -> Any:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        g = torch.randn_like(fwd())
        both = timed(lambda fwd=fwd, q=q, k=k, v=v, g=g: torch.autograd.grad(fwd(), (q, k, v), g))
        out["a"].append([b, h, s, e, timed(fwd), both])
    return out


def shares(r: dict[str, Any], peak: float = H100[0], bw: float = H100[1]) -> None:
    for m, n, k, t in r["g"]:
        print(f"gemm {m:6d} {n:6d} {k:6d}  {2 * m * n * k / t / 1e12:6.1f} TFLOP/s  "
              f"{2 * m * n * k / t / peak:.3f} of peak")  # fmt: skip
    for op, numel, t in r["m"]:
        moved = (3 if op == "add" else 2) * numel * 2
        print(
            f"{op:4s} {numel:10d}  {moved / t / 1e9:7.0f} GB/s  {moved / t / bw:.3f} of bandwidth"
        )
    for b, h, s, e, tf, tfb in r["a"]:
        flops = 4 * b * h * s * s * e / 2  # causal: half the square
        print(f"attention b={b} h={h} s={s} d={e}: forward {flops / tf / peak:.3f}, "
              f"backward {2.5 * flops / (tfb - tf) / peak:.3f} of peak")  # fmt: skip


def main() -> None:
    if sys.argv[1:2] == ["--shares"]:
        with open(sys.argv[2]) as fh:
            shares(json.load(fh))
    else:
        print(json.dumps(measure()))


if __name__ == "__main__":
    main()
