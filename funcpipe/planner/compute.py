"""Per-layer compute costs on one GPU: F, I and W seconds and the bytes kept for backward.

A roofline per op: matrix products take ``flops / (peak * matmul) + matmul_overhead``
(:mod:`funcpipe.planner.calibration`), memory-bound ops take ``bytes / (bandwidth * share)``.
Backward splits as the zero-bubble paper does: I (input gradients) repeats each product once and
carries the backward of every memory-bound op and of attention; W (weight gradients) repeats each
weight product once. Recompute adds a forward (``full``) or the attention core (``selective``) to
I, where it runs. Tensor parallelism divides every product by ``tensor``; sequence parallelism
divides the memory-bound ops and the stored activations too.
"""

from __future__ import annotations

from dataclasses import dataclass

from funcpipe.planner.calibration import Calibration
from funcpipe.planner.cluster import Cluster
from funcpipe.planner.layout import ClusterLayout
from funcpipe.planner.model import Transformer

__all__ = [
    "FP8_CAST_BYTES",
    "OpCosts",
    "attention_core",
    "attention_linear",
    "cast_seconds",
    "gemm",
    "head_costs",
    "layer_costs",
    "matmul_peak",
]


@dataclass(frozen=True)
class OpCosts:
    """Seconds of ``f``, ``i``, ``w`` for one microbatch, ``recompute`` seconds (already in
    ``i``), ``activation`` bytes kept from F to backward, ``working`` bytes a backward needs
    on top of them while it runs (a recomputed layer's activations)."""

    f: float
    i: float
    w: float
    recompute: float
    activation: float
    working: float = 0.0


FP8_CAST_BYTES = 6
"""HBM bytes per element of quantizing a bf16 tensor to FP8 with current scaling, as Transformer
Engine does it for each FP8 matrix product's input (forward) and output gradient (backward): an
amax pass reads it (2), the cast reads it again (2) and writes it and its transpose (1 + 1)."""


def gemm(m: float, n: float, k: float, peak: float, cal: Calibration) -> float:
    """Seconds of an ``m x k`` by ``k x n`` matrix product at ``peak`` (the calibrated share,
    plus the per-product overhead)."""
    return 2.0 * m * n * k / (peak * cal.matmul) + cal.matmul_overhead


def matmul_peak(model: Transformer, cluster: Cluster) -> float:
    """The peak the model's matrix products run at: FP8's with ``fp8=True``, else its dtype's."""
    return cluster.gpu.peak("fp8" if model.fp8 else model.dtype)


def attention_linear(
    model: Transformer, layout: ClusterLayout, cluster: Cluster, cal: Calibration
) -> float:
    """Seconds of a block's QKV and output projections for one microbatch (each once)."""
    peak = matmul_peak(model, cluster)
    t, h, tokens = layout.tensor, model.hidden, layout.microbatch * model.seq
    q, kvd = model.q_size, model.kv_size
    return gemm(tokens, (q + 2 * kvd) / t, h, peak, cal) + gemm(tokens, h, q / t, peak, cal)


def attention_core(
    model: Transformer, layout: ClusterLayout, cluster: Cluster, cal: Calibration, windowed: bool
) -> tuple[float, float, float]:
    """(forward, backward, selective-recompute) seconds of the attention core of one block and
    microbatch: fused (FLOPs at the attention shares; a window shortens each query's keys) or
    unfused (the score products, softmax and dropout as separate ops, the window only masks)."""
    peak = cluster.gpu.peak(model.dtype)  # softmax(QK^T)V stays in bf16 under fp8 too
    bw = cluster.gpu.bandwidth
    t, b, s = layout.tensor, layout.microbatch, model.seq
    nb = model.bytes
    heads = model.heads / t
    scores = b * heads * s * s  # elements of the score matrices on this GPU
    if model.flash:
        if windowed:
            attn_flops = 4.0 * b * heads * s * model.context(True) * model.head_size
        else:
            attn_flops = 4.0 * b * heads * s * s * model.head_size / 2  # causal: half the square
        core_f = attn_flops / (peak * cal.attention_fwd)
        core_b = 2.5 * attn_flops / (peak * cal.attention_bwd)
        return core_f, core_b, 0.0  # the fused kernel's backward already recomputes the scores
    product = 2 * gemm(s, s, model.head_size, peak, cal) * b * heads
    product -= 2 * cal.matmul_overhead * (b * heads - 1)  # batched: one launch each
    # softmax: read and write the scores; dropout: read, write and a 1-byte mask
    soft = 2 * scores * nb / (bw * cal.softmax) + (2 * nb + 1) * scores / (bw * cal.elementwise)
    core_f = product + soft
    back = 3 * scores * nb / (bw * cal.softmax) + (2 * nb + 1) * scores / (bw * cal.elementwise)
    return core_f, 2 * product + back, core_f


def cast_seconds(elements: float, model: Transformer, cluster: Cluster, cal: Calibration) -> float:
    """Seconds of quantizing ``elements`` to FP8 (:data:`FP8_CAST_BYTES` each); 0 without fp8."""
    if not model.fp8:
        return 0.0
    return elements * FP8_CAST_BYTES / (cluster.gpu.bandwidth * cal.elementwise)


def layer_costs(
    model: Transformer,
    layout: ClusterLayout,
    cluster: Cluster,
    cal: Calibration,
    *,
    windowed: bool = False,
) -> OpCosts:
    """One dense transformer block on one GPU of its tensor group, for one microbatch
    (``windowed``: its attention through the model's sliding window)."""
    peak = matmul_peak(model, cluster)
    bw = cluster.gpu.bandwidth
    t, b, s, h = layout.tensor, layout.microbatch, model.seq, model.hidden
    nb = model.bytes
    tokens = b * s
    up = (model.matrices - 1) * model.ff  # the gate and up matrices' width
    linear = (
        attention_linear(model, layout, cluster, cal)
        + gemm(tokens, up / t, h, peak, cal)
        + gemm(tokens, h, model.ff / t, peak, cal)
    )
    # memory-bound ops: 2 norms, the activation, 2 (bias + dropout + residual); SP shards them
    x = tokens * h / (t if layout.sequence_parallel else 1)
    norm_f = 2 * (2 * x * nb) / (bw * cal.norm)
    act = model.matrices * tokens * model.ff / t * nb  # read the up (and gate), write one
    elem_f = (act + 2 * (3 * x * nb + x)) / (bw * cal.elementwise)
    mem_f, mem_b = norm_f + elem_f, 2 * (norm_f + elem_f)
    if model.fp8:  # each product's input in F, its output gradient in I
        q, kvd = model.q_size, model.kv_size
        mem_f += cast_seconds(2 * x + tokens * (q + model.ff) / t, model, cluster, cal)
        mem_b += cast_seconds(2 * x + tokens * (q + 2 * kvd + up) / t, model, cluster, cal)
    core_f, core_b, selective = attention_core(model, layout, cluster, cal, windowed)
    f = linear + core_f + mem_f
    # activations kept per block (Korthikanti et al. 2022, bytes for 2-byte dtypes)
    sbh = s * b * h * nb / 2
    score_bytes = 0.0 if model.flash else 5 * model.heads * s / (h * t)
    kept = 34 / t if layout.sequence_parallel else 10 + 24 / t
    full_act = sbh * (kept + score_bytes)
    if layout.recompute == "full":
        extra, act_kept, working = f, 2 * sbh / (t if layout.sequence_parallel else 1), full_act
    elif layout.recompute == "selective":
        extra, act_kept, working = selective, sbh * kept, 0.0
    else:
        extra, act_kept, working = 0.0, full_act, 0.0
    i = linear + core_b + mem_b + extra
    return OpCosts(f=f, i=i, w=linear, recompute=extra, activation=act_kept, working=working)


def head_costs(
    model: Transformer, layout: ClusterLayout, cluster: Cluster, cal: Calibration
) -> OpCosts:
    """The output layer and the loss (vocab-parallel over ``tensor``) for one microbatch."""
    peak = cluster.gpu.peak(model.dtype)
    bw = cluster.gpu.bandwidth
    tokens = layout.microbatch * model.seq
    v = model.vocab / layout.tensor
    logits = gemm(tokens, v, model.hidden, peak, cal)
    ce_f = 12 * tokens * v / (bw * cal.elementwise)  # float32 softmax over the logits
    ce_b = 8 * tokens * v / (bw * cal.elementwise)
    kept = tokens * v * (model.bytes + 4)  # the logits and their float32 softmax
    return OpCosts(f=logits + ce_f, i=logits + ce_b, w=logits, recompute=0.0, activation=kept)
