"""Published runs the planner is checked against (docs/planner.md), as data.

``MEGATRON_2021``: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC21, arXiv 2104.04473), Table 1: GPT models on A100-80GB (DGX A100,
8 GPUs per node, 8 x 200 Gb/s HDR InfiniBand), sequence 2048, vocabulary 51,200, mixed precision,
full activation recompute, microbatch 1 (the paper's weak-scaling runs). Rows: (billions of
parameters, layers, hidden, heads, tensor, pipeline, GPUs, global batch, published TFLOP/s per
GPU). Where each number comes from is in docs/planner.md; the 145.6B row ran the interleaved
schedule with 2 chunks per rank (as the issue states), the others plain 1F1B.
"""

from __future__ import annotations

__all__ = ["MEGATRON_2021"]

MEGATRON_2021: tuple[tuple[float, int, int, int, int, int, int, int, float], ...] = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 30, 3072, 32, 2, 1, 64, 512, 138),
    (7.5, 36, 4096, 32, 4, 1, 128, 512, 142),
    (18.4, 40, 6144, 48, 8, 1, 256, 1024, 135),
    (39.1, 48, 8192, 64, 8, 2, 512, 1536, 138),
    (76.1, 60, 10240, 80, 8, 4, 1024, 1792, 140),
    (145.6, 80, 12288, 96, 8, 8, 1536, 2304, 148),
    (310.1, 96, 16384, 128, 8, 16, 1920, 2160, 155),
    (529.6, 105, 20480, 128, 8, 35, 2520, 2520, 163),
    (1008.0, 128, 25600, 160, 8, 64, 3072, 3072, 163),
)
