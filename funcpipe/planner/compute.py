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

__all__ = ["OpCosts", "head_costs", "layer_costs"]


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


def _gemm(m: float, n: float, k: float, peak: float, cal: Calibration) -> float:
    return 2.0 * m * n * k / (peak * cal.matmul) + cal.matmul_overhead


def layer_costs(
    model: Transformer, layout: ClusterLayout, cluster: Cluster, cal: Calibration
) -> OpCosts:
    """One transformer block on one GPU of its tensor group, for one microbatch."""
    peak = cluster.gpu.peak(model.dtype)
    bw = cluster.gpu.bandwidth
    t, b, s, h = layout.tensor, layout.microbatch, model.seq, model.hidden
    nb = model.bytes
    tokens = b * s
    kvd = model.kv * model.head_dim
    heads = model.heads / t
    linear = (
        _gemm(tokens, (h + 2 * kvd) / t, h, peak, cal)
        + _gemm(tokens, h, h / t, peak, cal)
        + _gemm(tokens, model.ff / t, h, peak, cal)
        + _gemm(tokens, h, model.ff / t, peak, cal)
    )
    # memory-bound ops: 2 norms, GeLU, 2 (bias + dropout + residual); SP shards them
    x = tokens * h / (t if layout.sequence_parallel else 1)
    norm_f = 2 * (2 * x * nb) / (bw * cal.norm)
    elem_f = (2 * tokens * model.ff / t * nb + 2 * (3 * x * nb + x)) / (bw * cal.elementwise)
    mem_f, mem_b = norm_f + elem_f, 2 * (norm_f + elem_f)
    scores = b * heads * s * s  # elements of the score matrices on this GPU
    if model.flash:
        attn_flops = 4.0 * b * heads * s * s * model.head_dim / 2  # causal: half the square
        core_f = attn_flops / (peak * cal.attention_fwd)
        core_b = 2.5 * attn_flops / (peak * cal.attention_bwd)
        selective = 0.0  # the fused kernel's backward already recomputes the scores
    else:
        product = 2 * _gemm(s, s, model.head_dim, peak, cal) * b * heads
        product -= 2 * cal.matmul_overhead * (b * heads - 1)  # batched: one launch each
        # softmax: read and write the scores; dropout: read, write and a 1-byte mask
        soft = 2 * scores * nb / (bw * cal.softmax) + (2 * nb + 1) * scores / (bw * cal.elementwise)
        core_f = product + soft
        back = 3 * scores * nb / (bw * cal.softmax) + (2 * nb + 1) * scores / (bw * cal.elementwise)
        core_b = 2 * product + back
        selective = core_f
    f = linear + core_f + mem_f
    # activations kept per block (Korthikanti et al. 2022, bytes for 2-byte dtypes)
    sbh = s * b * h * nb / 2
    score_bytes = 0.0 if model.flash else 5 * model.heads * s / (h * t)
    kept = 34 / t if layout.sequence_parallel else 10 + 24 / t
    full_act = sbh * (kept + score_bytes)
    if layout.recompute == "full":
        extra, act, working = f, 2 * sbh / (t if layout.sequence_parallel else 1), full_act
    elif layout.recompute == "selective":
        extra, act, working = selective, sbh * kept, 0.0
    else:
        extra, act, working = 0.0, full_act, 0.0
    i = linear + core_b + mem_b + extra
    return OpCosts(f=f, i=i, w=linear, recompute=extra, activation=act, working=working)


def head_costs(
    model: Transformer, layout: ClusterLayout, cluster: Cluster, cal: Calibration
) -> OpCosts:
    """The output layer and the loss (vocab-parallel over ``tensor``) for one microbatch."""
    peak = cluster.gpu.peak(model.dtype)
    bw = cluster.gpu.bandwidth
    tokens = layout.microbatch * model.seq
    v = model.vocab / layout.tensor
    logits = _gemm(tokens, v, model.hidden, peak, cal)
    ce_f = 12 * tokens * v / (bw * cal.elementwise)  # float32 softmax over the logits
    ce_b = 8 * tokens * v / (bw * cal.elementwise)
    kept = tokens * v * (model.bytes + 4)  # the logits and their float32 softmax
    return OpCosts(f=logits + ce_f, i=logits + ce_b, w=logits, recompute=0.0, activation=kept)
