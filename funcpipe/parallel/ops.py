"""1D (Megatron) tensor-parallel ops, vocab-parallel ops, sequence parallelism, ring attention
(defined in :mod:`funcpipe.parallel.ring`, re-exported here).

Every op is a pure function ``op(inputs..., params, *, axis, ...)`` over this rank's shards;
``axis`` is the :class:`~funcpipe.parallel.Axis` the op splits over (``mesh['tensor']``, or
``mesh['sequence']`` for ring attention). Each op has a ``*_sharding(...)`` function returning an
:class:`~funcpipe.parallel.sharding.OpSharding` whose ``shard_params`` cuts full weights into one
rank's params and whose ``gather_params`` puts per-rank params (or their gradients) back
together. Activations are ``[b, s, d]``; weights follow ``torch.nn.Linear`` (``weight[out, in]``,
``bias[out]``), so a module's state dict shards directly.

Shardings (t = axis size; "rep" = replicated):

============================  =====================  ==============================  ==============
op                            input                  weights                         output
============================  =====================  ==============================  ==============
column_parallel_linear        x[b, s, in] rep        W[out/t, in], b[out/t]          y[b, s, out/t]
row_parallel_linear           x[b, s, in/t]          W[out, in/t], b[out] rep        y[b, s, out] rep
vocab_parallel_embedding      ids[b, s] rep          W[V/t, d]                       y[b, s, d] rep
vocab_parallel_cross_entropy  logits[b, s, V/t]      -                               loss[b, s] rep
parallel_attention, _mlp      x[b, s, d] rep         heads / hidden split            y[b, s, d] rep
sp_column_parallel_linear     x[b, s/t, in]          W[out/t, in], b[out/t]          y[b, s, out/t]
sp_row_parallel_linear        x[b, s, in/t]          W[out, in/t], b[out] rep        y[b, s/t, out]
sp_layer_norm, sp_*_block     x[b, s/t, d]           as 1D                           y[b, s/t, d]
ring_attention                q, k, v[b, h, s/t, e]  -                               o[b, h, s/t, e]
============================  =====================  ==============================  ==============
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from funcpipe.errors import InvalidArgument
from funcpipe.parallel import collectives as C
from funcpipe.parallel.heads import _heads, _local_linear, _merge_heads, _split_heads
from funcpipe.parallel.mesh import Axis
from funcpipe.parallel.ring import (
    ring_attention,
    ring_attention_sharding,
    ring_self_attention,
    ring_self_attention_sharding,
)
from funcpipe.parallel.sharding import OpSharding, Sharding
from funcpipe.parallel.spec import ShardSpec, shard_spec
from funcpipe.stages.keys import sharded

__all__ = [
    "attention",
    "attention_block",
    "attention_block_sharding",
    "column_parallel_linear",
    "column_parallel_sharding",
    "fuse_qkv",
    "mlp_block",
    "mlp_block_sharding",
    "parallel_attention",
    "parallel_attention_sharding",
    "parallel_mlp",
    "parallel_mlp_sharding",
    "ring_attention",
    "ring_attention_sharding",
    "ring_self_attention",
    "ring_self_attention_sharding",
    "row_parallel_linear",
    "row_parallel_sharding",
    "sp_attention_block",
    "sp_attention_block_sharding",
    "sp_column_parallel_linear",
    "sp_column_parallel_sharding",
    "sp_layer_norm",
    "sp_layer_norm_sharding",
    "sp_mlp_block",
    "sp_mlp_block_sharding",
    "sp_row_parallel_linear",
    "sp_row_parallel_sharding",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_cross_entropy_sharding",
    "vocab_parallel_embedding",
    "vocab_parallel_embedding_sharding",
]

LN_EPS = 1e-5
_REP3 = Sharding.of(None, None, None)


def _linear_shardings(kind: str, axis: str, bias: bool) -> dict[str, Sharding]:
    col = kind == "column"
    out = {"weight": Sharding.of(axis, None) if col else Sharding.of(None, axis)}
    if bias:
        out["bias"] = Sharding.of(axis if col else None)
    return out


def _norm_sharding() -> dict[str, Sharding]:
    """A replicated layer norm's params."""
    return {"weight": Sharding.of(None), "bias": Sharding.of(None)}


# ------------------------------------------------------------------------------ 1D linear
_LINEAR_SPECS: dict[tuple[str, str], ShardSpec] = {}


def _linear_spec(kind: str, axis: str) -> ShardSpec:
    """The spec of a column- or row-parallel linear over mesh axis ``axis``, parsed once (the
    GPT calls four a block, every microbatch; a dict, not ``functools.lru_cache``, which
    torch.compile warns about and traces through)."""
    spec = _LINEAR_SPECS.get((kind, axis))
    if spec is None:
        if kind == "column":
            spec = shard_spec("... i, o i -> ... o", {"o": axis})
        else:
            spec = shard_spec("... i, o i -> ... o", {"i": axis}, reduce="all_reduce")
        if not torch.compiler.is_compiling():  # (a store while tracing breaks its own guard)
            _LINEAR_SPECS[(kind, axis)] = spec
    return spec


def column_parallel_linear(
    x: Tensor, params: dict[str, Tensor], *, axis: Axis, gather_output: bool = False
) -> Tensor:
    """``x[..., in]`` (replicated) times ``weight[out/t, in]`` (+ ``bias[out/t]``) ->
    ``y[..., out/t]``, or ``y[..., out]`` replicated with ``gather_output=True``.

    Forward: no communication (all-gather of ``y`` when gathering). Backward: all-reduce of the
    gradient of ``x``.
    """
    y = _linear_spec("column", axis.name)(
        x, params["weight"], bias=params.get("bias"), mesh={axis.name: axis}
    )
    return C.gather_from_group(y, axis, dim=-1) if gather_output else y


def column_parallel_sharding(
    *, axis: str = "tensor", gather_output: bool = False, bias: bool = True
) -> OpSharding:
    """Shardings of :func:`column_parallel_linear` (``shard_params`` / ``gather_params`` of full weights)."""
    return OpSharding(
        (_REP3,),
        _linear_shardings("column", axis, bias),
        Sharding.of(None, None, None if gather_output else axis),
    )


def row_parallel_linear(x: Tensor, params: dict[str, Tensor], *, axis: Axis) -> Tensor:
    """``x[..., in/t]`` times ``weight[out, in/t]`` -> all-reduce -> ``+ bias[out]`` (added once,
    after the sum) -> ``y[..., out]`` replicated. Forward: one all-reduce of ``y``; backward:
    nothing."""
    spec = _linear_spec("row", axis.name)
    return spec(x, params["weight"], bias=params.get("bias"), mesh={axis.name: axis})


def row_parallel_sharding(*, axis: str = "tensor", bias: bool = True) -> OpSharding:
    """Shardings of :func:`row_parallel_linear` (``shard_params`` / ``gather_params`` of full weights)."""
    return OpSharding((Sharding.of(None, None, axis),), _linear_shardings("row", axis, bias), _REP3)


# ------------------------------------------------------------------------------ vocab parallel
def vocab_parallel_embedding(ids: Tensor, params: dict[str, Tensor], *, axis: Axis) -> Tensor:
    """``ids[b, s]`` (replicated) looked up in ``weight[V/t, d]`` -> ``y[b, s, d]`` replicated.

    Each rank looks up the ids in its vocabulary block and zeros the others; one all-reduce
    (identity backward) sums the blocks.
    """
    w = params["weight"]
    n = w.shape[0]
    local = ids - axis.coord * n
    outside = (local < 0) | (local >= n)
    y = F.embedding(local.masked_fill(outside, 0), w).masked_fill(outside.unsqueeze(-1), 0.0)
    return C.reduce_from_group(y, axis)


def vocab_parallel_embedding_sharding(*, axis: str = "tensor") -> OpSharding:
    """Shardings of :func:`vocab_parallel_embedding` (``shard_params`` / ``gather_params`` of full weights)."""
    return OpSharding((Sharding.of(None, None),), {"weight": Sharding.of(axis, None)}, _REP3)


class _VocabCrossEntropy(torch.autograd.Function):
    # The max, the exponentials and the sums run in float32 (float64 stays float64) whatever
    # the logits' dtype: in bfloat16 a confident prediction's exp-sum 1 + 1e-3 rounds to 1 (a
    # loss of 0) and a float16 exp-sum over a large vocabulary overflows. The logits are saved
    # in their own dtype with the row max and exp-sum, and the softmax is recomputed in the
    # backward, so no [b, s, V/t] float32 tensor is kept between the passes.
    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, axis: Axis) -> Tensor:
        n = logits.shape[-1]
        start = axis.coord * n
        wide = logits.detach().to(_wide(logits.dtype))
        gmax = C.all_reduce_max(wide.amax(-1), axis)
        shifted = wide - gmax.unsqueeze(-1)
        local = target - start
        outside = (local < 0) | (local >= n)
        idx = local.masked_fill(outside, 0).unsqueeze(-1)
        tgt = shifted.gather(-1, idx).squeeze(-1).masked_fill(outside, 0.0)
        sums = C._raw_all_reduce(torch.stack([shifted.exp().sum(-1), tgt]), axis, "forward")
        ctx.save_for_backward(logits, idx, outside, gmax, sums[0])
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        logits, idx, outside, gmax, total = ctx.saved_tensors
        wide = logits.to(_wide(logits.dtype))
        grad = (wide - gmax.unsqueeze(-1)).exp() / total.unsqueeze(-1)  # the softmax
        grad.scatter_add_(-1, idx, -(~outside).unsqueeze(-1).to(grad.dtype))
        grad *= g.to(grad.dtype).unsqueeze(-1)
        return grad.to(logits.dtype), None, None


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The dtype the cross-entropy computes in: float32, or float64 for float64 logits."""
    return torch.promote_types(dtype, torch.float32)


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, *, axis: Axis) -> Tensor:
    """Per-token loss ``-log softmax(logits)[target]`` from ``logits[..., V/t]`` split over the
    vocabulary, without materialising the full logits: all-reduce MAX of the row max, one
    all-reduce SUM of (exp-sum, target logit); local backward. ``target[...]`` holds global ids in
    ``[0, V)``; the loss ``[...]`` is replicated.

    The arithmetic is float32 whatever the logits' dtype (float64 logits stay float64): the
    loss is float32, the logits' gradient has the logits' dtype. For bfloat16 or float16 logits
    this is ``F.cross_entropy(logits.float(), target, reduction="none")`` (to float32 rounding),
    without a float32 copy of the logits kept for the backward."""
    if target.shape != logits.shape[:-1]:
        raise InvalidArgument(
            f"vocab_parallel_cross_entropy: target shape {tuple(target.shape)} must be the "
            f"logits shape without its last dim, {tuple(logits.shape[:-1])}."
        )
    if target.is_floating_point():
        raise InvalidArgument(
            f"vocab_parallel_cross_entropy: target must hold integer ids; got {target.dtype}."
        )
    return _VocabCrossEntropy.apply(logits, target, axis)


def vocab_parallel_cross_entropy_sharding(*, axis: str = "tensor") -> OpSharding:
    """Shardings of :func:`vocab_parallel_cross_entropy` (``shard_params`` / ``gather_params`` of full weights)."""
    return OpSharding(
        (Sharding.of(None, None, axis), Sharding.of(None, None)), {}, Sharding.of(None, None)
    )


# ------------------------------------------------------------------------------ attention, MLP
def attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, dropout: float = 0
) -> Tensor:
    """Single-device softmax attention over ``[..., s, e]`` (the local core of the parallel ops):
    ``F.scaled_dot_product_attention``, so CUDA runs a fused (flash / memory-efficient) kernel.
    Causal masking aligns the last query with the last key (query ``i`` of ``s_q`` sees keys
    ``<= i + s_k - s_q``), as for a chunk of queries at the end of a longer key sequence. With
    more queries than keys, a causal query that sees no key gives zeros (the explicit softmax
    gave NaN there). ``dropout``: of the attention probabilities (from the default generator)."""
    s_q, s_k = q.shape[-2], k.shape[-2]
    if not causal or s_q == s_k:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout)
    allowed = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(s_k - s_q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout)


def _local_attention(
    h: Tensor, params: dict[str, Any], heads: int, causal: bool, p: float
) -> Tensor:
    if "qkv" in params:  # one projection; rows head-interleaved: [heads, (q, k, v), e]
        y = _local_linear(h, params["qkv"])
        b, s, w = y.shape
        q, k, v = y.view(b, s, heads, 3, w // (3 * heads)).transpose(1, 2).unbind(3)
    else:
        q, k, v = (_split_heads(_local_linear(h, params[n]), heads) for n in ("q", "k", "v"))
    return _merge_heads(attention(q, k, v, causal=causal, dropout=p))


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, *, num_heads: int) -> Tensor:
    """The fused ``qkv`` weight ``[3 d, d]`` (or bias ``[3 d]``) of :func:`parallel_attention`
    from separate ``q``, ``k``, ``v`` ones: rows grouped per head (``[heads, (q, k, v), e]``),
    so a split of the rows over the tensor axis keeps whole heads on each rank."""
    rows = q.shape[0]
    if num_heads < 1 or rows % num_heads or k.shape != q.shape or v.shape != q.shape:
        raise InvalidArgument(
            f"fuse_qkv: q, k, v of one shape with rows divisible by num_heads={num_heads}; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    per_head = [t.reshape(num_heads, rows // num_heads, *t.shape[1:]) for t in (q, k, v)]
    return torch.stack(per_head, dim=1).reshape(3 * rows, *q.shape[1:])


def parallel_attention(
    x: Tensor,
    params: dict[str, Any],
    *,
    axis: Axis,
    num_heads: int,
    causal: bool = False,
    dropout: float = 0.0,
) -> Tensor:
    """Multi-head attention with the heads split over ``axis``: ``x[b, s, d]`` replicated ->
    ``y[b, s, d]`` replicated. ``q``, ``k``, ``v`` are column-parallel (one shared identity /
    all-reduce on ``x``), ``o`` is row-parallel. Forward: one all-reduce; backward: one.
    ``params`` holds ``q``, ``k``, ``v`` and ``o`` linears, or ``qkv`` (one linear of ``3 d``
    outputs, rows grouped per head: :func:`fuse_qkv`) and ``o``: one matmul instead of three.
    ``dropout`` of the probabilities: each tensor rank's under its own key (``keys.sharded``)."""
    heads = _heads(x.shape[-1], num_heads, axis.size, "parallel_attention")
    h = C.copy_to_group(x, axis)
    with sharded(axis.coord, x.device) if dropout else contextlib.nullcontext():
        y = _local_attention(h, params, heads, causal, dropout)
    return row_parallel_linear(y, params["o"], axis=axis)


def parallel_attention_sharding(
    *, axis: str = "tensor", bias: bool = True, fused_qkv: bool = False
) -> OpSharding:
    """Shardings of :func:`parallel_attention` (``shard_params`` / ``gather_params`` of full
    weights); ``fused_qkv=True`` for params with one ``qkv`` linear."""
    col = _linear_shardings("column", axis, bias)
    qkv = {"qkv": col} if fused_qkv else {"q": col, "k": col, "v": col}
    return OpSharding((_REP3,), {**qkv, "o": _linear_shardings("row", axis, bias)}, _REP3)


def parallel_mlp(x: Tensor, params: dict[str, Any], *, axis: Axis) -> Tensor:
    """``fc2(gelu(fc1(x)))`` with ``fc1`` column- and ``fc2`` row-parallel: ``x[b, s, d]``
    replicated -> ``y[b, s, d]`` replicated; one all-reduce each way."""
    h = F.gelu(column_parallel_linear(x, params["fc1"], axis=axis))
    return row_parallel_linear(h, params["fc2"], axis=axis)


def parallel_mlp_sharding(*, axis: str = "tensor", bias: bool = True) -> OpSharding:
    """Shardings of :func:`parallel_mlp` (``shard_params`` / ``gather_params`` of full weights)."""
    return OpSharding(
        (_REP3,),
        {
            "fc1": _linear_shardings("column", axis, bias),
            "fc2": _linear_shardings("row", axis, bias),
        },
        _REP3,
    )


def _layer_norm(x: Tensor, p: dict[str, Tensor]) -> Tensor:
    return F.layer_norm(x, x.shape[-1:], p["weight"], p["bias"], LN_EPS)


def mlp_block(x: Tensor, params: dict[str, Any], *, axis: Axis, dropout: float = 0.0) -> Tensor:
    """Pre-norm residual MLP: ``x + parallel_mlp(layer_norm(x))``; norm params replicated.
    ``dropout`` of the MLP's output before the residual add (replicated: every tensor rank
    drops the same elements under the stage call's key, :mod:`funcpipe.stages.keys`)."""
    y = parallel_mlp(_layer_norm(x, params["norm"]), params, axis=axis)
    return x + (F.dropout(y, dropout) if dropout else y)


def mlp_block_sharding(*, axis: str = "tensor") -> OpSharding:
    """Shardings of :func:`mlp_block` (``shard_params`` / ``gather_params`` of full weights)."""
    inner = parallel_mlp_sharding(axis=axis)
    return OpSharding((_REP3,), {**inner.params, "norm": _norm_sharding()}, _REP3)


def attention_block(
    x: Tensor,
    params: dict[str, Any],
    *,
    axis: Axis,
    num_heads: int,
    causal: bool = False,
    dropout: float = 0.0,
    attn_dropout: float = 0.0,
) -> Tensor:
    """Pre-norm residual attention: ``x + parallel_attention(layer_norm(x))``. ``dropout`` of
    the attention's output before the residual add (replicated, as :func:`mlp_block`'s),
    ``attn_dropout`` of its probabilities (heads split: :func:`parallel_attention`)."""
    h = _layer_norm(x, params["norm"])
    y = parallel_attention(
        h, params, axis=axis, num_heads=num_heads, causal=causal, dropout=attn_dropout
    )
    return x + (F.dropout(y, dropout) if dropout else y)


def attention_block_sharding(*, axis: str = "tensor", fused_qkv: bool = False) -> OpSharding:
    """Shardings of :func:`attention_block` (``shard_params`` / ``gather_params`` of full weights)."""
    inner = parallel_attention_sharding(axis=axis, fused_qkv=fused_qkv)
    return OpSharding((_REP3,), {**inner.params, "norm": _norm_sharding()}, _REP3)


# ------------------------------------------------------------------------------ sequence parallel
def sp_layer_norm(x: Tensor, params: dict[str, Tensor], *, axis: Axis) -> Tensor:
    """Layer norm of ``x[b, s/t, d]`` (split on the sequence); the replicated params see only
    this rank's tokens, so their gradients are all-reduced (identity / all-reduce pair)."""
    w = C.copy_to_group(params["weight"], axis)
    b = C.copy_to_group(params["bias"], axis)
    return F.layer_norm(x, x.shape[-1:], w, b, LN_EPS)


def sp_layer_norm_sharding(*, axis: str = "tensor") -> OpSharding:
    """Shardings of :func:`sp_layer_norm` (``shard_params`` / ``gather_params`` of full weights)."""
    seq = Sharding.of(None, axis, None)
    return OpSharding((seq,), _norm_sharding(), seq)


def sp_column_parallel_linear(x: Tensor, params: dict[str, Tensor], *, axis: Axis) -> Tensor:
    """``x[b, s/t, in]`` -> all-gather of the sequence -> column-parallel -> ``y[b, s, out/t]``.
    Backward: reduce-scatter of the gradient of ``x`` along the sequence."""
    spec = shard_spec("b s i, o i -> b s o", {"o": axis.name}, in_shards={0: {"s": axis.name}})
    return spec(x, params["weight"], bias=params.get("bias"), mesh={axis.name: axis})


def sp_column_parallel_sharding(*, axis: str = "tensor", bias: bool = True) -> OpSharding:
    """Shardings of :func:`sp_column_parallel_linear` (``shard_params`` / ``gather_params`` of full weights)."""
    return OpSharding(
        (Sharding.of(None, axis, None),),
        _linear_shardings("column", axis, bias),
        Sharding.of(None, None, axis),
    )


def sp_row_parallel_linear(x: Tensor, params: dict[str, Tensor], *, axis: Axis) -> Tensor:
    """``x[b, s, in/t]`` -> row-parallel -> reduce-scatter along the sequence -> ``+ bias`` ->
    ``y[b, s/t, out]``. Backward: all-gather of the gradient of ``y``; the bias, replicated but
    applied to this rank's tokens only, gets its gradient all-reduced."""
    spec = shard_spec("b s i, o i -> b s o", {"i": axis.name}, reduce="reduce_scatter", scatter="s")
    y = spec(x, params["weight"], mesh={axis.name: axis})
    if params.get("bias") is not None:
        y = y + C.copy_to_group(params["bias"], axis)
    return y


def sp_row_parallel_sharding(*, axis: str = "tensor", bias: bool = True) -> OpSharding:
    """Shardings of :func:`sp_row_parallel_linear` (``shard_params`` / ``gather_params`` of full weights)."""
    return OpSharding(
        (Sharding.of(None, None, axis),),
        _linear_shardings("row", axis, bias),
        Sharding.of(None, axis, None),
    )


def sp_mlp_block(x: Tensor, params: dict[str, Any], *, axis: Axis) -> Tensor:
    """Sequence-parallel pre-norm MLP on ``x[b, s/t, d]``: one all-gather and one reduce-scatter
    forward, the mirror pair backward (plus the all-reduces of the replicated params' grads)."""
    h = sp_layer_norm(x, params["norm"], axis=axis)
    h = F.gelu(sp_column_parallel_linear(h, params["fc1"], axis=axis))
    return x + sp_row_parallel_linear(h, params["fc2"], axis=axis)


def sp_mlp_block_sharding(*, axis: str = "tensor") -> OpSharding:
    """Shardings of :func:`sp_mlp_block` (``shard_params`` / ``gather_params`` of full weights)."""
    seq = Sharding.of(None, axis, None)
    params = {
        "norm": _norm_sharding(),
        "fc1": _linear_shardings("column", axis, True),
        "fc2": _linear_shardings("row", axis, True),
    }
    return OpSharding((seq,), params, seq)


def sp_attention_block(
    x: Tensor, params: dict[str, Any], *, axis: Axis, num_heads: int, causal: bool = False
) -> Tensor:
    """Sequence-parallel pre-norm attention on ``x[b, s/t, d]``: the normed tokens are
    all-gathered once (reduce-scatter backward), heads are split as in 1D, and the output
    projection reduce-scatters back to the sequence split."""
    heads = _heads(x.shape[-1], num_heads, axis.size, "sp_attention_block")
    h = C.all_gather(sp_layer_norm(x, params["norm"], axis=axis), axis, dim=1)
    y = _local_attention(h, params, heads, causal, 0.0)
    return x + sp_row_parallel_linear(y, params["o"], axis=axis)


def sp_attention_block_sharding(*, axis: str = "tensor") -> OpSharding:
    """Shardings of :func:`sp_attention_block` (``shard_params`` / ``gather_params`` of full weights)."""
    seq = Sharding.of(None, axis, None)
    col = _linear_shardings("column", axis, True)
    params = {"norm": _norm_sharding(), "q": col, "k": col, "v": col}
    params["o"] = _linear_shardings("row", axis, True)
    return OpSharding((seq,), params, seq)


# ------------------------------------------------------------------------------ old names
# the ``*_layout`` names from before a tensor's layout was called its sharding, for old code
attention_block_layout = attention_block_sharding
column_parallel_layout = column_parallel_sharding
mlp_block_layout = mlp_block_sharding
parallel_attention_layout = parallel_attention_sharding
parallel_mlp_layout = parallel_mlp_sharding
ring_attention_layout = ring_attention_sharding
ring_self_attention_layout = ring_self_attention_sharding
row_parallel_layout = row_parallel_sharding
sp_attention_block_layout = sp_attention_block_sharding
sp_column_parallel_layout = sp_column_parallel_sharding
sp_layer_norm_layout = sp_layer_norm_sharding
sp_mlp_block_layout = sp_mlp_block_sharding
sp_row_parallel_layout = sp_row_parallel_sharding
vocab_parallel_cross_entropy_layout = vocab_parallel_cross_entropy_sharding
vocab_parallel_embedding_layout = vocab_parallel_embedding_sharding
