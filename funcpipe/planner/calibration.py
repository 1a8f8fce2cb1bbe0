"""The efficiencies the planner's roofline uses, and where each number comes from.

Measured on one NVIDIA H100 80GB HBM3 (SXM, 700 W) with ``benchmarks/plan_calibrate.py``
(bf16, torch 2.11, CUDA 13; raw timings in ``benchmarks/results/plan_calibrate_h100.json``), as a
share of that chip's datasheet peak, and applied as the same share of every other chip's peak
(an assumption: A100s usually reach a somewhat *higher* share of their peak in large GEMMs, so
A100 predictions err on the slow side). The validation tables in docs/planner.md were not used.

- GEMM: ``time = flops / (peak * matmul) + matmul_overhead``, fitted over 60 shapes
  (M = 2048-16384 tokens, N, K = 256-16384) in log error: ``matmul = 0.77``,
  ``matmul_overhead = 11 us`` (eager launch and tail effects; rms error 14%).
- memory-bound ops, bytes moved / time / datasheet bandwidth at 2^26-2^28 elements: add and GeLU
  0.85-0.91 (``elementwise = 0.85``), LayerNorm 0.62 (``norm = 0.6``), softmax over 4096 columns
  0.38 (``softmax = 0.38``).
- fused causal attention (``scaled_dot_product_attention``, b=4, 16 heads, s=2048, d=128):
  forward 0.48 and backward 0.37 of peak (``attention_fwd``, ``attention_bwd``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT", "Calibration"]


@dataclass(frozen=True)
class Calibration:
    """Shares of peak reached per kind of op, plus the few fixed costs the model adds."""

    matmul: float = 0.77
    matmul_overhead: float = 11e-6
    elementwise: float = 0.85
    norm: float = 0.6
    softmax: float = 0.38
    attention_fwd: float = 0.48
    attention_bwd: float = 0.37
    workspace_bytes: float = 1.0 * 2**30  # CUDA context, cuBLAS / NCCL workspaces


DEFAULT = Calibration()
