"""2D (SUMMA), 2.5D and 3D tensor-parallel ops.

**2D** on a q x q grid (axes ``row`` = ``mesh['tensor_row']`` and ``col`` = ``mesh['tensor_col']``;
the rank at row i, column j): activations ``X[b/q, s, h/q]`` hold batch block i and hidden block
j; weights ``W[in/q, out/q]`` hold block (i, j) (note: ``[in, out]``, the matmul order, not
``nn.Linear``'s ``[out, in]``). ``C = X W`` takes q steps; at step k, ``X[i, k]`` is broadcast
along grid row i (the group of axis ``col``) and ``W[k, j]`` along grid column j (the group of
axis ``row``), and each rank adds their product. Backward: ``dX = SUMMA(dC, W^T)``, each step a
broadcast of ``W[k, j]`` and a reduce of the partial products to the rank at column k;
``dW = SUMMA(X^T, dC)``, a broadcast of ``X[i, k]`` and a reduce to the rank at row k.

**2.5D** (axes ``dep``, ``row``, ``col``; t = d*q*q): d stacked 2D grids. The batch is split over
depth then rows (``X[b/(d q), s, h/q]``), weights are replicated over depth, and every weight
gradient is all-reduced across depth (an identity / all-reduce pair on the weights).

**3D** on a c x c x c cube (axes ``in_axis``, ``wt_axis``, ``out_axis``; the rank at
in=j, wt=i, out=k): ``X[b/c^2, s, h/c]`` holds batch block (i, j) and hidden block k;
``W[in/c^2, out/c]`` holds in-block (k, i) and out-block j. ``x`` is all-gathered over
``in_axis``, ``W`` over ``wt_axis``, and the product reduce-scattered over ``out_axis``; each
pair's backward mirrors it. The output is split like the input with ``in_axis`` and
``out_axis`` swapped, so consecutive layers alternate the two roles (the blocks do this).

Each mode has a linear layer, a layer norm, an embedding, a classifier with its loss
(vocab-parallel cross-entropy over the axis that splits the logits) and the two pre-norm
residual blocks of a transformer, each with a ``*_sharding`` function for sharding full weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from funcpipe.errors import InvalidArgument
from funcpipe.parallel import collectives as C
from funcpipe.parallel.mesh import Axis
from funcpipe.parallel.ops import LN_EPS, attention, vocab_parallel_cross_entropy
from funcpipe.parallel.sharding import OpSharding, Sharding
from funcpipe.tree import tree_map

__all__ = [
    "attention_block_2d",
    "attention_block_2d_sharding",
    "attention_block_2p5d",
    "attention_block_2p5d_sharding",
    "attention_block_3d",
    "attention_block_3d_sharding",
    "classifier_loss_2d",
    "classifier_loss_2d_sharding",
    "classifier_loss_2p5d",
    "classifier_loss_2p5d_sharding",
    "classifier_loss_3d",
    "classifier_loss_3d_sharding",
    "embedding_2d",
    "embedding_2d_sharding",
    "embedding_2p5d",
    "embedding_2p5d_sharding",
    "embedding_3d",
    "embedding_3d_sharding",
    "layer_norm_2d",
    "layer_norm_2d_sharding",
    "layer_norm_2p5d",
    "layer_norm_2p5d_sharding",
    "layer_norm_3d",
    "layer_norm_3d_sharding",
    "linear_2d",
    "linear_2d_sharding",
    "linear_2p5d",
    "linear_2p5d_sharding",
    "linear_3d",
    "linear_3d_sharding",
    "mlp_block_2d",
    "mlp_block_2d_sharding",
    "mlp_block_2p5d",
    "mlp_block_2p5d_sharding",
    "mlp_block_3d",
    "mlp_block_3d_sharding",
]

Params = dict[str, Any]


def _grid(row: Axis, col: Axis, what: str) -> int:
    if row.size != col.size:
        raise InvalidArgument(
            f"{what}: the grid must be square; got row={row.name!r} of size {row.size} and "
            f"col={col.name!r} of size {col.size}. Build it with mode='2d' or '2.5d'."
        )
    return row.size


def _heads(num_heads: int, parts: int, what: str) -> int:
    if not isinstance(num_heads, int) or num_heads < 1 or num_heads % parts:
        raise InvalidArgument(
            f"{what}: num_heads={num_heads!r} must be a positive multiple of {parts} (heads "
            "are split over that many ranks)."
        )
    return num_heads // parts


def _attend(q: Tensor, k: Tensor, v: Tensor, heads: int, causal: bool) -> Tensor:
    """Attention over local heads of ``[b, s, heads*e]`` tensors."""

    def split(y: Tensor) -> Tensor:
        b, s, w = y.shape
        return y.reshape(b, s, heads, w // heads).transpose(1, 2)

    out = attention(split(q), split(k), split(v), causal=causal)
    b, h, s, e = out.shape
    return out.transpose(1, 2).reshape(b, s, h * e)


# ------------------------------------------------------------------------------ 2D
class _Summa(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, row: Axis, col: Axis) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.row, ctx.col = row, col
        out = None
        for k in range(row.size):
            a = C._raw_broadcast(x, col, k, "forward")  # X[i, k] along grid row i
            b = C._raw_broadcast(w, row, k, "forward")  # W[k, j] along grid column j
            part = a @ b
            out = part if out is None else out + part
        if out is None:  # unreachable: a grid has at least one step
            raise RuntimeError("internal: empty SUMMA grid")
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        x, w = ctx.saved_tensors
        row, col = ctx.row, ctx.col
        dx = dw = None
        if ctx.needs_input_grad[0]:  # dX[i, k] = sum_j dC[i, j] W[k, j]^T
            for k in range(row.size):
                b = C._raw_broadcast(w, row, k, "backward")
                part = C._raw_reduce(g @ b.transpose(0, 1), col, k, "backward")
                if col.coord == k:
                    dx = part
        if ctx.needs_input_grad[1]:  # dW[k, j] = sum_i X[i, k]^T dC[i, j]
            for k in range(row.size):
                a = C._raw_broadcast(x, col, k, "backward")
                part = torch.einsum("...i,...o->io", a, g)
                part = C._raw_reduce(part, row, k, "backward")
                if row.coord == k:
                    dw = part
        return dx, dw, None, None


def linear_2d(x: Tensor, params: Params, *, row: Axis, col: Axis) -> Tensor:
    """SUMMA ``x[b/q, s, in/q] @ weight[in/q, out/q] (+ bias[out/q]) -> y[b/q, s, out/q]``.

    Forward: q broadcasts of ``x`` blocks along grid rows and q of ``W`` blocks along grid
    columns. Backward: q broadcasts + q reduces for each of ``dX`` and ``dW``; the bias
    gradient is all-reduced over ``row``.
    """
    _grid(row, col, "linear_2d")
    w = params["weight"]
    if x.shape[-1] != w.shape[0]:
        raise InvalidArgument(
            f"linear_2d: x[..., {x.shape[-1]}] (in/q) does not match weight of shape "
            f"{tuple(w.shape)} ([in/q, out/q]) on a {row.size}x{col.size} grid."
        )
    y = x @ w if row.size == 1 else _Summa.apply(x, w, row, col)
    if params.get("bias") is not None:
        y = y + C.copy_to_group(params["bias"], row)
    return y


def linear_2d_sharding(
    *, row: str = "tensor_row", col: str = "tensor_col", bias: bool = True
) -> OpSharding:
    """Shardings of :func:`linear_2d` (``shard_params`` / ``gather_params`` of full weights)."""
    act = Sharding.of(row, None, col)
    params = {"weight": Sharding.of(row, col), "bias": Sharding.of(col)}
    if not bias:
        del params["bias"]
    return OpSharding((act,), params, act)


def _moments(x: Tensor, axis: Axis, width: int) -> tuple[Tensor, Tensor]:
    """Mean and biased variance over the last dim, split over ``axis`` (``width`` in total)."""
    mean = C.all_reduce(x.sum(-1, keepdim=True), axis) / width
    xc = x - mean
    var = C.all_reduce((xc * xc).sum(-1, keepdim=True), axis) / width
    return xc, var


def _split_norm(x: Tensor, params: Params, split: Axis, replicas: tuple[Axis, ...]) -> Tensor:
    xc, var = _moments(x, split, x.shape[-1] * split.size)
    w, b = params["weight"], params["bias"]
    for ax in replicas:
        w, b = C.copy_to_group(w, ax), C.copy_to_group(b, ax)
    return xc * torch.rsqrt(var + LN_EPS) * w + b


def layer_norm_2d(x: Tensor, params: Params, *, row: Axis, col: Axis) -> Tensor:
    """Layer norm of ``x[b/q, s, h/q]``: two all-reduces over ``col`` for the statistics
    (all-reduce backward); ``weight``, ``bias[h/q]`` get their gradients all-reduced over ``row``."""
    _grid(row, col, "layer_norm_2d")
    return _split_norm(x, params, col, (row,))


def layer_norm_2d_sharding(*, row: str = "tensor_row", col: str = "tensor_col") -> OpSharding:
    """Shardings of :func:`layer_norm_2d` (``shard_params`` / ``gather_params`` of full weights)."""
    act = Sharding.of(row, None, col)
    return OpSharding((act,), {"weight": Sharding.of(col), "bias": Sharding.of(col)}, act)


def embedding_2d(ids: Tensor, params: Params, *, row: Axis, col: Axis) -> Tensor:
    """``ids[b/q, s]`` looked up in ``weight[V, d/q]`` -> ``x[b/q, s, d/q]`` (the 2D activation
    sharding); no forward communication, the weight gradient is all-reduced over ``row``."""
    _grid(row, col, "embedding_2d")
    return F.embedding(ids, C.copy_to_group(params["weight"], row))


def embedding_2d_sharding(*, row: str = "tensor_row", col: str = "tensor_col") -> OpSharding:
    """Shardings of :func:`embedding_2d` (``shard_params`` / ``gather_params`` of full weights)."""
    return OpSharding(
        (Sharding.of(row, None),), {"weight": Sharding.of(None, col)}, Sharding.of(row, None, col)
    )


def classifier_loss_2d(
    x: Tensor, params: Params, *, target: Tensor, row: Axis, col: Axis
) -> Tensor:
    """Per-token cross-entropy of ``x[b/q, s, d/q] @ weight[d/q, V/q]`` against
    ``target[b/q, s]``: the logits stay split over ``col`` (vocab-parallel cross-entropy);
    ``loss[b/q, s]`` is replicated over ``col``."""
    logits = linear_2d(x, {"weight": params["weight"]}, row=row, col=col)
    return vocab_parallel_cross_entropy(logits, target, axis=col)


def classifier_loss_2d_sharding(*, row: str = "tensor_row", col: str = "tensor_col") -> OpSharding:
    """Shardings of :func:`classifier_loss_2d` (``shard_params`` / ``gather_params`` of full weights)."""
    return OpSharding(
        (Sharding.of(row, None, col), Sharding.of(row, None)),
        {"weight": Sharding.of(row, col)},
        Sharding.of(row, None),
    )


def mlp_block_2d(x: Tensor, params: Params, *, row: Axis, col: Axis) -> Tensor:
    """``x + fc2(gelu(fc1(layer_norm(x))))`` with 2D layers; ``x[b/q, s, d/q]``."""
    h = layer_norm_2d(x, params["norm"], row=row, col=col)
    h = F.gelu(linear_2d(h, params["fc1"], row=row, col=col))
    return x + linear_2d(h, params["fc2"], row=row, col=col)


def mlp_block_2d_sharding(*, row: str = "tensor_row", col: str = "tensor_col") -> OpSharding:
    """Shardings of :func:`mlp_block_2d` (``shard_params`` / ``gather_params`` of full weights)."""
    lin = linear_2d_sharding(row=row, col=col).params
    norm = layer_norm_2d_sharding(row=row, col=col).params
    act = Sharding.of(row, None, col)
    return OpSharding((act,), {"norm": norm, "fc1": lin, "fc2": lin}, act)


def attention_block_2d(
    x: Tensor, params: Params, *, row: Axis, col: Axis, num_heads: int, causal: bool = False
) -> Tensor:
    """``x + o(attention(q, k, v))`` on ``x[b/q, s, d/q]``: q, k, v and o are 2D linears; the
    heads are split over ``col`` (hidden block j = head block j), so attention itself is local."""
    heads = _heads(num_heads, col.size, "attention_block_2d")
    h = layer_norm_2d(x, params["norm"], row=row, col=col)
    q, k, v = (linear_2d(h, params[n], row=row, col=col) for n in ("q", "k", "v"))
    return x + linear_2d(_attend(q, k, v, heads, causal), params["o"], row=row, col=col)


def attention_block_2d_sharding(*, row: str = "tensor_row", col: str = "tensor_col") -> OpSharding:
    """Shardings of :func:`attention_block_2d` (``shard_params`` / ``gather_params`` of full weights)."""
    lin = linear_2d_sharding(row=row, col=col).params
    norm = layer_norm_2d_sharding(row=row, col=col).params
    act = Sharding.of(row, None, col)
    return OpSharding((act,), {"norm": norm, "q": lin, "k": lin, "v": lin, "o": lin}, act)


# ------------------------------------------------------------------------------ 2.5D
def _over_depth(params: Params, dep: Axis) -> Params:
    """Weights are replicated over depth while each depth sees its own batch: all-reduce their
    gradients across depth (identity forward)."""
    return tree_map(lambda w: C.copy_to_group(w, dep), params)


def _sharding_2p5d(lay: OpSharding, dep: str, row: str) -> OpSharding:
    """A 2D sharding with the batch (dim 0 of activations) split over ``(dep, row)``."""

    def deepen(act: Sharding) -> Sharding:
        first = act.dims[0]
        dims = ((dep, *first), *act.dims[1:]) if first == (row,) else act.dims
        return Sharding(dims, act.partial)

    return OpSharding(tuple(deepen(a) for a in lay.inputs), lay.params, deepen(lay.output))


def linear_2p5d(x: Tensor, params: Params, *, dep: Axis, row: Axis, col: Axis) -> Tensor:
    """2.5D linear: ``x[b/(d q), s, in/q]``, ``weight[in/q, out/q]`` replicated over depth;
    SUMMA within each depth layer, weight and bias gradients all-reduced across depth."""
    return linear_2d(x, _over_depth(params, dep), row=row, col=col)


def linear_2p5d_sharding(
    *,
    dep: str = "tensor_dep",
    row: str = "tensor_row",
    col: str = "tensor_col",
    bias: bool = True,
) -> OpSharding:
    """Shardings of :func:`linear_2p5d` (``shard_params`` / ``gather_params`` of full weights)."""
    return _sharding_2p5d(linear_2d_sharding(row=row, col=col, bias=bias), dep, row)


def layer_norm_2p5d(x: Tensor, params: Params, *, dep: Axis, row: Axis, col: Axis) -> Tensor:
    """2.5D layer norm: :func:`layer_norm_2d` with params gradients also reduced across depth."""
    return layer_norm_2d(x, _over_depth(params, dep), row=row, col=col)


def layer_norm_2p5d_sharding(
    *, dep: str = "tensor_dep", row: str = "tensor_row", col: str = "tensor_col"
) -> OpSharding:
    """Shardings of :func:`layer_norm_2p5d` (``shard_params`` / ``gather_params`` of full weights)."""
    return _sharding_2p5d(layer_norm_2d_sharding(row=row, col=col), dep, row)


def embedding_2p5d(ids: Tensor, params: Params, *, dep: Axis, row: Axis, col: Axis) -> Tensor:
    """``ids[b/(d q), s]`` in ``weight[V, d/q]`` -> ``x[b/(d q), s, d/q]``."""
    return embedding_2d(ids, _over_depth(params, dep), row=row, col=col)


def embedding_2p5d_sharding(
    *, dep: str = "tensor_dep", row: str = "tensor_row", col: str = "tensor_col"
) -> OpSharding:
    """Shardings of :func:`embedding_2p5d` (``shard_params`` / ``gather_params`` of full weights)."""
    return _sharding_2p5d(embedding_2d_sharding(row=row, col=col), dep, row)


def classifier_loss_2p5d(
    x: Tensor, params: Params, *, target: Tensor, dep: Axis, row: Axis, col: Axis
) -> Tensor:
    """2.5D :func:`classifier_loss_2d`; ``loss[b/(d q), s]``."""
    return classifier_loss_2d(x, _over_depth(params, dep), target=target, row=row, col=col)


def classifier_loss_2p5d_sharding(
    *, dep: str = "tensor_dep", row: str = "tensor_row", col: str = "tensor_col"
) -> OpSharding:
    """Shardings of :func:`classifier_loss_2p5d` (``shard_params`` / ``gather_params`` of full weights)."""
    return _sharding_2p5d(classifier_loss_2d_sharding(row=row, col=col), dep, row)


def mlp_block_2p5d(x: Tensor, params: Params, *, dep: Axis, row: Axis, col: Axis) -> Tensor:
    return mlp_block_2d(x, _over_depth(params, dep), row=row, col=col)


def mlp_block_2p5d_sharding(
    *, dep: str = "tensor_dep", row: str = "tensor_row", col: str = "tensor_col"
) -> OpSharding:
    """Shardings of :func:`mlp_block_2p5d` (``shard_params`` / ``gather_params`` of full weights)."""
    return _sharding_2p5d(mlp_block_2d_sharding(row=row, col=col), dep, row)


def attention_block_2p5d(
    x: Tensor,
    params: Params,
    *,
    dep: Axis,
    row: Axis,
    col: Axis,
    num_heads: int,
    causal: bool = False,
) -> Tensor:
    p = _over_depth(params, dep)
    return attention_block_2d(x, p, row=row, col=col, num_heads=num_heads, causal=causal)


def attention_block_2p5d_sharding(
    *, dep: str = "tensor_dep", row: str = "tensor_row", col: str = "tensor_col"
) -> OpSharding:
    """Shardings of :func:`attention_block_2p5d` (``shard_params`` / ``gather_params`` of full weights)."""
    return _sharding_2p5d(attention_block_2d_sharding(row=row, col=col), dep, row)


# ------------------------------------------------------------------------------ 3D
def _cube(in_axis: Axis, wt_axis: Axis, out_axis: Axis, what: str) -> None:
    if not in_axis.size == wt_axis.size == out_axis.size:
        raise InvalidArgument(
            f"{what}: the three axes must have one size (a cube); got in_axis "
            f"{in_axis.size}, wt_axis {wt_axis.size}, out_axis {out_axis.size}. Build the "
            "mesh with mode='3d'."
        )


def linear_3d(x: Tensor, params: Params, *, in_axis: Axis, wt_axis: Axis, out_axis: Axis) -> Tensor:
    """3D linear: ``x[b/c^2, s, in/c]`` (batch over (wt, in), hidden over out) times
    ``weight[in/c^2, out/c]`` (in over (out, wt), out over in) (+ ``bias[out/c]`` over in)
    -> ``y[b/c^2, s, out/c]`` with batch over (wt, out) and hidden over in.

    Forward: all-gather ``x`` over ``in_axis``, ``W`` over ``wt_axis``; reduce-scatter the
    product over ``out_axis``. Backward: all-gather of ``dy`` over ``out_axis``, reduce-scatter
    of ``dx`` over ``in_axis`` and of ``dW`` over ``wt_axis``; the bias gradient is all-reduced
    over ``wt_axis`` and ``out_axis``.
    """
    _cube(in_axis, wt_axis, out_axis, "linear_3d")
    xf = C.all_gather(x, in_axis, dim=0)
    wf = C.all_gather(params["weight"], wt_axis, dim=0)
    if xf.shape[-1] != wf.shape[0]:
        raise InvalidArgument(
            f"linear_3d: x of shape {tuple(x.shape)} and weight of shape "
            f"{tuple(params['weight'].shape)} do not fit on a cube of side {in_axis.size}: "
            f"x[..., in/c] needs weight[in/c^2, out/c]."
        )
    y = C.reduce_scatter(xf @ wf, out_axis, dim=0)
    if params.get("bias") is not None:
        y = y + C.copy_to_group(C.copy_to_group(params["bias"], wt_axis), out_axis)
    return y


def linear_3d_sharding(
    *,
    in_axis: str = "tensor_in",
    wt_axis: str = "tensor_wt",
    out_axis: str = "tensor_out",
    bias: bool = True,
) -> OpSharding:
    """Shardings of :func:`linear_3d` (``shard_params`` / ``gather_params`` of full weights)."""
    params = {"weight": Sharding.of((out_axis, wt_axis), in_axis), "bias": Sharding.of(in_axis)}
    if not bias:
        del params["bias"]
    return OpSharding(
        (Sharding.of((wt_axis, in_axis), None, out_axis),),
        params,
        Sharding.of((wt_axis, out_axis), None, in_axis),
    )


def layer_norm_3d(
    x: Tensor, params: Params, *, in_axis: Axis, wt_axis: Axis, out_axis: Axis
) -> Tensor:
    """Layer norm of ``x[b/c^2, s, h/c]`` (hidden over ``out_axis``): statistics all-reduced
    over ``out_axis``; ``weight``, ``bias[h/c]`` gradients all-reduced over the other two."""
    _cube(in_axis, wt_axis, out_axis, "layer_norm_3d")
    return _split_norm(x, params, out_axis, (wt_axis, in_axis))


def layer_norm_3d_sharding(
    *, in_axis: str = "tensor_in", wt_axis: str = "tensor_wt", out_axis: str = "tensor_out"
) -> OpSharding:
    """Shardings of :func:`layer_norm_3d` (``shard_params`` / ``gather_params`` of full weights)."""
    act = Sharding.of((wt_axis, in_axis), None, out_axis)
    return OpSharding((act,), {"weight": Sharding.of(out_axis), "bias": Sharding.of(out_axis)}, act)


def embedding_3d(
    ids: Tensor, params: Params, *, in_axis: Axis, wt_axis: Axis, out_axis: Axis
) -> Tensor:
    """``ids[b/c^2, s]`` in ``weight[V, d/c]`` (hidden over ``out_axis``) -> ``x[b/c^2, s, d/c]``;
    the weight gradient is all-reduced over ``wt_axis`` and ``in_axis``."""
    _cube(in_axis, wt_axis, out_axis, "embedding_3d")
    w = C.copy_to_group(C.copy_to_group(params["weight"], wt_axis), in_axis)
    return F.embedding(ids, w)


def embedding_3d_sharding(
    *, in_axis: str = "tensor_in", wt_axis: str = "tensor_wt", out_axis: str = "tensor_out"
) -> OpSharding:
    """Shardings of :func:`embedding_3d` (``shard_params`` / ``gather_params`` of full weights)."""
    return OpSharding(
        (Sharding.of((wt_axis, in_axis), None),),
        {"weight": Sharding.of(None, out_axis)},
        Sharding.of((wt_axis, in_axis), None, out_axis),
    )


def classifier_loss_3d(
    x: Tensor, params: Params, *, target: Tensor, in_axis: Axis, wt_axis: Axis, out_axis: Axis
) -> Tensor:
    """Per-token cross-entropy of ``linear_3d(x, weight[d/c^2, V/c])``: the logits come out
    split over ``in_axis`` (vocab-parallel cross-entropy there); ``target`` and ``loss`` are
    ``[b/c^2, s]`` with the batch over (wt, out)."""
    logits = linear_3d(
        x, {"weight": params["weight"]}, in_axis=in_axis, wt_axis=wt_axis, out_axis=out_axis
    )
    return vocab_parallel_cross_entropy(logits, target, axis=in_axis)


def classifier_loss_3d_sharding(
    *, in_axis: str = "tensor_in", wt_axis: str = "tensor_wt", out_axis: str = "tensor_out"
) -> OpSharding:
    """Shardings of :func:`classifier_loss_3d` (``shard_params`` / ``gather_params`` of full weights)."""
    lin = linear_3d_sharding(in_axis=in_axis, wt_axis=wt_axis, out_axis=out_axis, bias=False)
    rows = Sharding.of((wt_axis, out_axis), None)
    return OpSharding((lin.inputs[0], rows), lin.params, rows)


def _swap3(
    fn: Callable[..., Tensor], x: Tensor, p: Params, axes: tuple[Axis, Axis, Axis], swap: bool
) -> Tensor:
    i, w, o = axes
    if swap:
        i, o = o, i
    return fn(x, p, in_axis=i, wt_axis=w, out_axis=o)


def mlp_block_3d(
    x: Tensor, params: Params, *, in_axis: Axis, wt_axis: Axis, out_axis: Axis
) -> Tensor:
    """``x + fc2(gelu(fc1(layer_norm(x))))``: ``fc1`` with the given roles, ``fc2`` with
    ``in_axis`` and ``out_axis`` swapped, so the output is laid out like ``x``."""
    axes = (in_axis, wt_axis, out_axis)
    h = _swap3(layer_norm_3d, x, params["norm"], axes, False)
    h = F.gelu(_swap3(linear_3d, h, params["fc1"], axes, False))
    return x + _swap3(linear_3d, h, params["fc2"], axes, True)


def mlp_block_3d_sharding(
    *, in_axis: str = "tensor_in", wt_axis: str = "tensor_wt", out_axis: str = "tensor_out"
) -> OpSharding:
    """Shardings of :func:`mlp_block_3d` (``shard_params`` / ``gather_params`` of full weights)."""
    fwd = linear_3d_sharding(in_axis=in_axis, wt_axis=wt_axis, out_axis=out_axis)
    back = linear_3d_sharding(in_axis=out_axis, wt_axis=wt_axis, out_axis=in_axis)
    norm = layer_norm_3d_sharding(in_axis=in_axis, wt_axis=wt_axis, out_axis=out_axis)
    params = {"norm": norm.params, "fc1": fwd.params, "fc2": back.params}
    return OpSharding(fwd.inputs, params, fwd.inputs[0])


def attention_block_3d(
    x: Tensor,
    params: Params,
    *,
    in_axis: Axis,
    wt_axis: Axis,
    out_axis: Axis,
    num_heads: int,
    causal: bool = False,
) -> Tensor:
    """``x + o(attention(q, k, v))``: q, k, v come out with the hidden (heads) split over
    ``in_axis`` and the batch over (wt, out), so attention is local; ``o`` swaps the roles back."""
    heads = _heads(num_heads, in_axis.size, "attention_block_3d")
    axes = (in_axis, wt_axis, out_axis)
    h = _swap3(layer_norm_3d, x, params["norm"], axes, False)
    q, k, v = (_swap3(linear_3d, h, params[n], axes, False) for n in ("q", "k", "v"))
    return x + _swap3(linear_3d, _attend(q, k, v, heads, causal), params["o"], axes, True)


def attention_block_3d_sharding(
    *, in_axis: str = "tensor_in", wt_axis: str = "tensor_wt", out_axis: str = "tensor_out"
) -> OpSharding:
    """Shardings of :func:`attention_block_3d` (``shard_params`` / ``gather_params`` of full weights)."""
    fwd = linear_3d_sharding(in_axis=in_axis, wt_axis=wt_axis, out_axis=out_axis)
    back = linear_3d_sharding(in_axis=out_axis, wt_axis=wt_axis, out_axis=in_axis)
    norm = layer_norm_3d_sharding(in_axis=in_axis, wt_axis=wt_axis, out_axis=out_axis)
    params = {"norm": norm.params, "q": fwd.params, "k": fwd.params, "v": fwd.params}
    params["o"] = back.params
    return OpSharding(fwd.inputs, params, fwd.inputs[0])


# ------------------------------------------------------------------------------ old names
# the ``*_layout`` names from before a tensor's layout was called its sharding, for old code
attention_block_2d_layout = attention_block_2d_sharding
attention_block_2p5d_layout = attention_block_2p5d_sharding
attention_block_3d_layout = attention_block_3d_sharding
classifier_loss_2d_layout = classifier_loss_2d_sharding
classifier_loss_2p5d_layout = classifier_loss_2p5d_sharding
classifier_loss_3d_layout = classifier_loss_3d_sharding
embedding_2d_layout = embedding_2d_sharding
embedding_2p5d_layout = embedding_2p5d_sharding
embedding_3d_layout = embedding_3d_sharding
layer_norm_2d_layout = layer_norm_2d_sharding
layer_norm_2p5d_layout = layer_norm_2p5d_sharding
layer_norm_3d_layout = layer_norm_3d_sharding
linear_2d_layout = linear_2d_sharding
linear_2p5d_layout = linear_2p5d_sharding
linear_3d_layout = linear_3d_sharding
mlp_block_2d_layout = mlp_block_2d_sharding
mlp_block_2p5d_layout = mlp_block_2p5d_sharding
mlp_block_3d_layout = mlp_block_3d_sharding
