"""Ring attention (sequence/context parallelism): attention over a sequence split on a mesh
axis, the key/value blocks passed around the ring (:func:`ring_attention`), and self-attention
with replicated projections around it (:func:`ring_self_attention`). Re-exported by
:mod:`funcpipe.parallel.ops`, whose conventions they follow."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from funcpipe.errors import InvalidArgument
from funcpipe.parallel import collectives as C
from funcpipe.parallel.heads import _heads, _local_linear, _merge_heads, _split_heads
from funcpipe.parallel.mesh import Axis
from funcpipe.parallel.sharding import OpSharding, Sharding

__all__ = [
    "ring_attention",
    "ring_attention_sharding",
    "ring_self_attention",
    "ring_self_attention_sharding",
]


def _block_scores(q: Tensor, k: Tensor, scale: float, diagonal: bool) -> Tensor:
    scores = q @ k.transpose(-1, -2) * scale
    if diagonal:  # the block on the diagonal: mask keys after each query
        s = scores.shape[-1]
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


class _RingAttention(torch.autograd.Function):
    """Forward: online softmax over the key/value blocks as they come round the ring.
    Backward: recompute each block's probabilities from the saved log-sum-exp; the key/value
    blocks go round again, each carrying the accumulator of its own gradient, and one last
    shift hands every accumulator back to its owner."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, axis: Axis, causal: bool) -> Tensor:
        n, me = axis.size, axis.coord
        scale = 1.0 / math.sqrt(q.shape[-1])
        kv = torch.stack([k, v])
        run_max = run_sum = acc = q.new_zeros(())
        for step in range(n):
            if step:
                kv = C._raw_shift(kv, axis, 1, "forward")
            src = (me - step) % n  # the rank whose keys we now hold
            if causal and src > me:
                continue  # every key is in the future of every local query
            scores = _block_scores(q, kv[0], scale, causal and src == me)
            blk_max = scores.amax(-1, keepdim=True)
            if step == 0:
                run_max = blk_max
                p = (scores - run_max).exp()
                run_sum, acc = p.sum(-1, keepdim=True), p @ kv[1]
                continue
            new_max = torch.maximum(run_max, blk_max)
            fix = (run_max - new_max).exp()
            p = (scores - new_max).exp()
            run_sum = run_sum * fix + p.sum(-1, keepdim=True)
            acc = acc * fix + p @ kv[1]
            run_max = new_max
        out = acc / run_sum
        ctx.save_for_backward(q, k, v, out, run_max + run_sum.log())
        ctx.axis, ctx.causal, ctx.scale = axis, causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, d_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        axis, causal, scale = ctx.axis, ctx.causal, ctx.scale
        n, me = axis.size, axis.coord
        delta = (d_out * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        dkv = torch.zeros_like(kv)
        for step in range(n):
            if step:
                both = C._raw_shift(torch.cat([kv, dkv]), axis, 1, "backward")
                kv, dkv = both[:2], both[2:]
            src = (me - step) % n
            if causal and src > me:
                continue
            p = (_block_scores(q, kv[0], scale, causal and src == me) - lse).exp()
            d_scores = p * (d_out @ kv[1].transpose(-1, -2) - delta)
            dq = dq + d_scores @ kv[0] * scale
            dkv = dkv + torch.stack(
                [d_scores.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ d_out]
            )
        dkv = C._raw_shift(dkv, axis, 1, "backward")  # block (me+1)'s gradient goes home
        return dq, dkv[0], dkv[1], None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, axis: Axis, causal: bool = False) -> Tensor:
    """Exact attention over a sequence split into contiguous blocks over ``axis``.

    ``q``, ``k``, ``v`` are ``[b, h, s/t, e]``: rank c holds positions ``[c*s/t, (c+1)*s/t)``.
    Keys and values travel around the ring (t-1 point-to-point shifts of the stacked pair) and
    are folded in with an online softmax (running max, running sum, rescaled accumulator). With
    ``causal``, blocks of later positions are skipped and the diagonal block is masked.
    Backward recomputes block by block (memory stays O(s/t)): t-1 shifts of the key/value
    blocks with their gradient accumulators, then one shift of the accumulators home.
    """
    if not q.shape == k.shape == v.shape or q.dim() < 2:
        raise InvalidArgument(
            f"ring_attention: q, k, v must have one shape [..., s/t, e]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}."
        )
    C._check_axis(axis, "ring_attention")
    return _RingAttention.apply(q, k, v, axis, bool(causal))


def ring_attention_sharding(*, axis: str = "sequence") -> OpSharding:
    """Shardings of :func:`ring_attention` (``shard_params`` / ``gather_params`` of full weights)."""
    seq = Sharding.of(None, None, axis, None)
    return OpSharding((seq, seq, seq), {}, seq)


def ring_self_attention(
    x: Tensor, params: dict[str, Any], *, axis: Axis, num_heads: int, causal: bool = False
) -> Tensor:
    """Self-attention on ``x[b, s/t, d]`` split on the sequence, with replicated projection
    weights (``q``, ``k``, ``v``, ``o``; their gradients are all-reduced) and
    :func:`ring_attention` in the middle -> ``y[b, s/t, d]``."""
    heads = _heads(x.shape[-1], num_heads, 1, "ring_self_attention")
    p = {
        n: {key: C.copy_to_group(w, axis) for key, w in params[n].items()}
        for n in ("q", "k", "v", "o")
    }
    q, k, v = (_split_heads(_local_linear(x, p[n]), heads) for n in ("q", "k", "v"))
    y = _merge_heads(ring_attention(q, k, v, axis=axis, causal=causal))
    return _local_linear(y, p["o"])


def ring_self_attention_sharding(*, axis: str = "sequence") -> OpSharding:
    """Shardings of :func:`ring_self_attention` (``shard_params`` / ``gather_params`` of full weights)."""
    seq = Sharding.of(None, axis, None)
    lin = {"weight": Sharding.of(None, None), "bias": Sharding.of(None)}
    return OpSharding((seq,), {"q": lin, "k": lin, "v": lin, "o": lin}, seq)
