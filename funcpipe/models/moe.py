"""A mixture-of-experts feed-forward layer as pure functions over a parameter dict (one device).

``moe(params, x, config, bias=None) -> (y, stats)``: each of the ``T`` tokens of ``x[..., d]``
is routed to ``top_k`` of ``experts`` SwiGLU experts by a linear router, and ``y`` is the sum of
their outputs weighted by the router's scores, plus ``shared`` experts every token goes through
(DeepSeek). Scores are a ``softmax`` over the experts (Mixtral, Switch) or a ``sigmoid`` per
expert (DeepSeek-V3); the chosen ``top_k`` scores are normalised to sum to 1 when
``normalize`` is set. ``bias`` (one per expert) shifts which experts are chosen, not their
weights: DeepSeek's auxiliary-loss-free balancing, moved between steps by the pure
:func:`update_bias` from the counts the layer returns.

Dropless by default; ``capacity=c`` keeps at most ``ceil(c * T * top_k / experts)`` assignments
per expert, the first in token order, and a dropped assignment contributes nothing (the token
passes on the residual around the layer).

``stats``: ``counts[e]`` (assignments kept per expert: the load), ``aux`` (the Switch
auxiliary loss of these tokens, ``experts * sum_e f_e P_e``, with ``f_e`` the fraction of the
assignments ``e`` got and ``P_e`` its mean score; scaled by nothing) and ``z`` (the router
z-loss, the mean over tokens of ``logsumexp(logits)^2``). Both losses are those of the tokens
given: summed over calls they are per-call (per-microbatch) quantities, not the whole batch's.

The experts' weights are stacked (``w_in[E, d, 2f]``: gate and up interleaved column by column,
gate ``j`` at ``2j`` and up ``j`` at ``2j + 1``, so that equal contiguous blocks of its columns
hold whole pairs; ``w_out[E, f, d]``) and run as one grouped matmul over the tokens sorted by
expert (``torch.nn.functional.grouped_mm``) where the dtype and strides allow it, else a loop
over the experts; the two are tested equal. The shared experts' ``shared_in`` is interleaved
the same way.

Over a ``tensor`` axis of ``t`` ranks each expert (and the shared experts) is split as
Megatron's MLP is: ``w_in``'s columns (``2f / t`` of them, whole gate-up pairs) and
``w_out``'s rows over the ranks (:func:`shardings`). Every tensor rank routes the same tokens
and sends the same rows, each computes its ``1/t`` of every expert's width, and the experts'
outputs are summed over ``tensor`` per row, before the router's weights multiply them, so the
router's gradient is whole on every rank (no leaf needs a reduction over ``tensor``).

``split="tokens"`` instead (Megatron-Core's sequence-parallel MoE with whole experts): each
tensor rank routes its ``1/t`` of the tokens, the experts are spread over the ``expert x
tensor`` ranks (``axis=mesh["expert_tensor"]``, ``E / (ep t)`` whole experts each), the rows
travel over that axis, and the layer's output is all-gathered over ``tensor``. The router's
gradient is summed over ``tensor`` in each backward (it is small), the auxiliary and z losses
and the counts are those of all the tokens on every rank; the shared experts keep their width
split over ``tensor``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from funcpipe.errors import InvalidArgument
from funcpipe.parallel.collectives import (
    _abstract,
    all_gather,
    all_reduce,
    copy_to_group,
    gather_from_group,
    reduce_from_group,
    split_to_group,
)
from funcpipe.parallel.mesh import Axis
from funcpipe.parallel.routing import combine, dispatch
from funcpipe.parallel.sharding import Sharding

__all__ = [
    "SPLITS",
    "MoEConfig",
    "expert_shard",
    "init",
    "moe",
    "route",
    "shardings",
    "update_bias",
]

SPLITS = ("width", "tokens")
"""How an MoE layer uses a tensor axis: split each expert's width over it, or its tokens (and
the experts over the expert x tensor ranks)."""

_GROUPED = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MoEConfig:
    """The layer's shape and routing (see the module's docstring)."""

    d_model: int
    experts: int
    ffn: int
    top_k: int = 2
    shared: int = 0
    score: str = "softmax"
    normalize: bool = True
    capacity: float | None = None

    def __post_init__(self) -> None:
        for name in ("d_model", "experts", "ffn", "top_k"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise InvalidArgument(f"MoEConfig({name}={v!r}): an int >= 1")
        if type(self.shared) is not int or self.shared < 0:
            raise InvalidArgument(f"MoEConfig(shared={self.shared!r}): an int >= 0")
        if not 1 <= self.top_k <= min(8, self.experts):
            raise InvalidArgument(
                f"MoEConfig(top_k={self.top_k}): from 1 to min(8, experts={self.experts})"
            )
        if self.score not in ("softmax", "sigmoid"):
            raise InvalidArgument(f"MoEConfig(score={self.score!r}): 'softmax' or 'sigmoid'")
        c = self.capacity
        if c is not None and (
            isinstance(c, bool) or not isinstance(c, int | float) or not math.isfinite(c) or c <= 0
        ):
            raise InvalidArgument(
                f"MoEConfig(capacity={c!r}): a capacity factor > 0 (1.0: each expert takes its "
                "even share of the assignments), or None (dropless)"
            )


def init(
    config: MoEConfig, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """Random parameters: ``router[E, d]``, ``w_in[E, d, 2f]``, ``w_out[E, f, d]``, and with
    shared experts ``shared_in[d, 2 * shared * f]``, ``shared_out[shared * f, d]``."""
    g = torch.Generator().manual_seed(seed)
    d, e, f = config.d_model, config.experts, config.ffn

    def randn(*shape: int, fan_in: int) -> Tensor:
        return (torch.randn(*shape, generator=g, dtype=torch.float64) / math.sqrt(fan_in)).to(dtype)

    params = {
        "router": randn(e, d, fan_in=d),
        "w_in": randn(e, d, 2 * f, fan_in=d),
        "w_out": randn(e, f, d, fan_in=f),
    }
    if config.shared:
        s = config.shared * f
        params["shared_in"] = randn(d, 2 * s, fan_in=d)
        params["shared_out"] = randn(s, d, fan_in=s)
    return params


def route(
    router: Tensor, x: Tensor, config: MoEConfig, bias: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(weights[T, k], experts[T, k], scores[T, E], logits[T, E])`` of tokens ``x[T, d]``."""
    logits = x @ router.t()
    if config.score == "softmax":
        low = logits.dtype in (torch.bfloat16, torch.float16)  # the softmax in float32 then
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32 if low else None)
        scores = scores.to(logits.dtype) if low else scores
    else:
        scores = torch.sigmoid(logits)
    if bias is None:  # the chosen scores are the weights
        weights, experts = torch.topk(scores, config.top_k, dim=-1)
    else:  # the bias chooses, the scores weigh
        experts = torch.topk(
            (scores + bias.to(scores.dtype)).detach(), config.top_k, dim=-1
        ).indices
        weights = scores.gather(-1, experts)
    if config.normalize and (config.top_k > 1 or config.score == "sigmoid"):
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, experts, scores, logits


def _keep(experts: Tensor, config: MoEConfig, axis: Axis | None = None) -> Tensor | None:
    """Which assignments a capacity keeps (the first ones per expert in token order; None:
    every one). Over an expert axis the order is the ranks' tokens one rank after another, and
    the capacity counts every rank's tokens: each rank learns the others' per-expert counts
    (one all-gather of ``E`` ints, no host read) and places its assignments after those of
    the ranks before it."""
    if config.capacity is None:
        return None
    tokens = experts.shape[0]
    cap: Any = math.ceil(config.capacity * tokens * config.top_k / config.experts)
    flat = experts.reshape(-1)
    before: Any = 0
    if axis is not None and axis.size > 1 and not _abstract(experts):
        with torch.no_grad():
            every = all_gather(_counts(flat, config.experts).unsqueeze(0), axis, dim=0)
        before = every[: axis.coord].sum(0)[flat]  # each assignment: its expert's earlier ones
        cap = torch.ceil(config.capacity * every.sum() / config.experts)
    # each assignment's rank in its expert, in token order: its place in the stable sort by
    # expert minus where its expert starts there (no [T*k, E] one-hot, nothing read on the host)
    order = torch.argsort(flat, stable=True)
    counts = _counts(flat, config.experts)
    starts = counts.cumsum(0) - counts
    ranked = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    position = torch.empty_like(ranked).index_copy(0, order, ranked) + before
    return (position < cap).reshape(experts.shape)


def _counts(ids: Tensor, n: int) -> Tensor:
    """How many of ``ids`` are each of ``0..n-1``, without reading them on the host (a CUDA
    ``bincount`` reads the largest one: a sync)."""
    return ids.new_zeros(n).index_add(0, ids, torch.ones_like(ids))


def _swiglu(h: Tensor) -> Tensor:
    """SwiGLU over interleaved columns: gate ``j`` at ``2j``, up ``j`` at ``2j + 1``."""
    gate, up = h.unflatten(-1, (-1, 2)).unbind(-1)
    return F.silu(gate) * up


def _tensor_parallel(rows: Tensor, tensor: Axis | None, mlp: Any, *args: Tensor) -> Tensor:
    """``mlp(rows, *args)`` where each tensor rank holds ``1/t`` of the MLP's width: the rows
    enter replicated (their gradient summed over ``tensor`` in backward) and the partial
    outputs are summed over ``tensor``; ``mlp`` itself without a tensor axis."""
    if tensor is None or tensor.size == 1:
        return mlp(rows, *args)
    return reduce_from_group(mlp(copy_to_group(rows, tensor), *args), tensor)


def _shared(tokens: Tensor, w_in: Tensor, w_out: Tensor) -> Tensor:
    return _swiglu(tokens @ w_in) @ w_out


def _experts(rows: Tensor, w_in: Tensor, w_out: Tensor, counts: Tensor) -> Tensor:
    """Each expert's SwiGLU over its rows (``rows`` sorted by expert, ``counts`` per expert)."""
    if _abstract(rows):  # shape inference (meta or fake): any expert's shapes are all of them
        return _swiglu(rows @ w_in[0]) @ w_out[0]
    aligned = all(t.dtype in _GROUPED for t in (rows, w_in, w_out)) and all(
        (t.shape[-1] * t.element_size()) % 16 == 0 for t in (rows, w_in, w_out)
    )
    if aligned:  # (zero rows included: the grouped matmul takes them)
        offs = counts.cumsum(0).to(torch.int32)
        h = F.grouped_mm(rows, w_in, offs=offs)
        return F.grouped_mm(_swiglu(h), w_out, offs=offs)
    outs = []
    start = 0
    for e, n in enumerate(counts.tolist()):
        part = rows[start : start + n]
        outs.append(_swiglu(part @ w_in[e]) @ w_out[e])
        start += n
    return torch.cat(outs) if outs else rows.new_zeros((0, w_out.shape[-1]))


def moe(
    params: dict[str, Tensor],
    x: Tensor,
    config: MoEConfig,
    bias: Tensor | None = None,
    *,
    axis: Axis | None = None,
    load: Tensor | None = None,
    tensor: Axis | None = None,
    split: str = "width",
) -> tuple[Tensor, dict[str, Tensor]]:
    """The layer on ``x[..., d]`` (see the module's docstring): ``(y, stats)``.

    ``tensor``: ``x`` is the same on each of its ranks; ``split="width"`` splits each expert's
    width over it, ``"tokens"`` the tokens (``axis`` then the expert x tensor axis); the params
    as :func:`shardings` cuts them for that split.

    ``axis``: expert parallelism over that mesh axis. Its ``n`` ranks each hold
    ``experts / n`` experts (``w_in``, ``w_out``: the experts ``coord * E/n`` onwards, as
    :func:`expert_shard` cuts them) and the router and shared experts whole; each passes its own
    tokens, which go to their experts' ranks and back (:func:`funcpipe.parallel.routing.dispatch`,
    ``combine``). Dropless only. ``stats`` are this rank's tokens'; the router's and shared
    experts' gradients are this rank's share (summed over the axis by the data-parallel
    reduction, as for any replicated weight).

    ``load``: each expert's fraction of the assignments over the *whole batch* (``[E]``, from
    a counting pass: ``counts / counts.sum()``); ``stats["aux"]`` is then ``E * sum_e load_e *
    P_e`` with ``P_e`` these tokens' mean score, whose mean over equal microbatches and copies
    is exactly the batch's Switch loss, and whose gradient each microbatch's backward gives
    in full, under any schedule (without it: this call's own fractions)."""
    local, sp = _check_inputs(params, x, config, bias, axis, load, tensor, split)
    tp: Axis = tensor if sp else None  # type: ignore[assignment]  # (the tokens split over it)
    shape = x.shape
    whole = x.reshape(-1, config.d_model)
    tokens = _own_tokens(whole, tp) if sp else whole
    router = copy_to_group(params["router"], tp) if sp else params["router"]
    k, e = config.top_k, config.experts
    weights, experts, scores, logits = route(router, tokens, config, bias)
    keep = _keep(experts, config, axis)
    if keep is not None:
        weights = weights * keep.to(weights.dtype)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = _counts(flat, e)
    source = order // k  # each sorted assignment's token
    rows = tokens.index_select(0, source)
    w_in, w_out = params["w_in"], params["w_out"]
    width = None if sp else tensor  # the axis each expert's width is split over
    if axis is None or axis.size == 1:
        out = _tensor_parallel(rows, width, _experts, w_in, w_out, counts)
    else:
        out = _expert_parallel(w_in, w_out, rows, flat[order], axis, local, width)
    out = out * weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    y = torch.zeros_like(tokens).index_add(0, source, out)
    if sp:
        y = gather_from_group(y, tp, dim=0)
    if config.shared:
        y = y + _tensor_parallel(whole, tensor, _shared, params["shared_in"], params["shared_out"])
    kept = counts if keep is None else _counts(flat[keep.reshape(-1)], e)
    return y.reshape(shape), _stats(counts, kept, scores, logits, load, whole.shape[0], k, tp)


def _stats(
    counts: Tensor,
    kept: Tensor,
    scores: Tensor,
    logits: Tensor,
    load: Tensor | None,
    tokens: int,
    k: int,
    tensor: Axis | None,
) -> dict[str, Tensor]:
    """The layer's ``counts`` (kept assignments), Switch ``aux`` and ``z`` losses over all its
    ``tokens`` (with ``tensor``: each rank scored its share; the counts are summed over it and
    the losses are the mean of the ranks')."""
    e = counts.shape[0]
    if tensor is not None:  # (one all-reduce: the kept counts are the counts without a capacity)
        same = kept is counts
        counts, kept = _summed(torch.stack([counts, kept]), tensor).unbind(0)
        kept = counts if same else kept
    if load is None:  # this call's fractions, counts / (T k), the division folded into E
        fraction, scale = counts.to(scores.dtype), e / max(tokens * k, 1)
    else:
        fraction, scale = load.to(scores.dtype), float(e)
    mine = scores.shape[0]
    stats = {
        "counts": kept,
        "aux": scale * (fraction * scores.mean(0)).sum() if mine else scores.new_zeros(()),
        "z": torch.logsumexp(logits, dim=-1).pow(2).mean() if mine else logits.new_zeros(()),
    }
    if tensor is not None:  # (both losses in one collective)
        both = torch.stack([stats["aux"], stats["z"].to(stats["aux"].dtype)])
        aux, z = _mean_over(both, tensor).unbind(0)
        stats["aux"], stats["z"] = aux, z.to(stats["z"].dtype)
    return stats


def _check_inputs(
    params: dict[str, Tensor],
    x: Tensor,
    config: MoEConfig,
    bias: Tensor | None,
    axis: Axis | None,
    load: Tensor | None,
    tensor: Axis | None,
    split: str,
) -> tuple[int, bool]:
    """:func:`moe`'s arguments checked: (the experts each rank of ``axis`` holds, whether the
    tokens are split over ``tensor``)."""
    if x.shape[-1] != config.d_model:
        raise InvalidArgument(
            f"moe: x[..., {x.shape[-1]}], the config has d_model={config.d_model}"
        )
    if bias is not None and (
        not isinstance(bias, Tensor) or tuple(bias.shape) != (config.experts,)
    ):
        got = tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
        raise InvalidArgument(
            f"moe: bias must have one value per expert ({config.experts},); got {got}"
        )
    local = _check_axis(axis, config, params)
    sp = _check_tensor(tensor, config, params, split, axis)
    if load is not None and (
        not isinstance(load, Tensor) or tuple(load.shape) != (config.experts,)
    ):
        got = tuple(load.shape) if isinstance(load, Tensor) else type(load).__name__
        raise InvalidArgument(
            f"moe: load must be each expert's fraction of the batch's assignments "
            f"({config.experts},); got {got}"
        )
    return local, sp


def _own_tokens(tokens: Tensor, tensor: Axis) -> Tensor:
    """This tensor rank's ``1/t`` of the tokens (their gradient all-gathered in backward)."""
    if tokens.shape[0] % tensor.size:
        raise InvalidArgument(
            f"moe(split='tokens'): {tokens.shape[0]} tokens do not divide over tensor axis "
            f"{tensor.name!r} of {tensor.size} ranks; use a batch x sequence that {tensor.size} "
            "divides, or split='width'"
        )
    return split_to_group(tokens, tensor, dim=0)


def _summed(counts: Tensor, tensor: Axis) -> Tensor:
    with torch.no_grad():
        return all_reduce(counts, tensor)


def _mean_over(value: Tensor, tensor: Axis) -> Tensor:
    """The mean over ``tensor`` of each rank's value (equal token shares: the whole's)."""
    return reduce_from_group(value, tensor) / tensor.size


def _check_axis(axis: Axis | None, config: MoEConfig, params: dict[str, Tensor]) -> int:
    """The experts each rank of ``axis`` holds (all of them without one), checked."""
    if axis is None:
        return config.experts
    if not isinstance(axis, Axis):
        raise InvalidArgument(f"moe: axis={axis!r} must be a funcpipe.parallel.Axis or None")
    if config.experts % axis.size:
        raise InvalidArgument(
            f"moe: experts={config.experts} do not divide over axis {axis.name!r} of "
            f"{axis.size} ranks: use a multiple of {axis.size} experts, or another axis size"
        )
    local = config.experts // axis.size
    held = params["w_in"].shape[0]
    if held != local:
        raise InvalidArgument(
            f"moe: params['w_in'] holds {held} experts; over axis {axis.name!r} of {axis.size} "
            f"ranks each holds {local} (expert_shard(params, config, axis) cuts them)"
        )
    return local


def _check_tensor(
    tensor: Axis | None,
    config: MoEConfig,
    params: dict[str, Tensor],
    split: str,
    axis: Axis | None,
) -> bool:
    """``split`` over ``tensor``, checked against ``axis`` and the params held; whether the
    tokens are split (a tensor axis of more than one rank and ``split="tokens"``)."""
    if split not in SPLITS:
        raise InvalidArgument(f"moe: split={split!r}; one of {SPLITS}")
    if tensor is None:
        return False
    if not isinstance(tensor, Axis):
        raise InvalidArgument(f"moe: tensor={tensor!r} must be a funcpipe.parallel.Axis or None")
    t, f = tensor.size, config.ffn
    tokens = split == "tokens" and t > 1
    if tokens and (axis is None or axis.name != "expert_tensor"):
        raise InvalidArgument(
            f"moe(split='tokens') over tensor axis {tensor.name!r} of {t} ranks "
            f"with axis={None if axis is None else axis.name!r}: each tensor rank routes "
            "its own tokens, so the experts must be spread over the expert x tensor ranks "
            "(axis=mesh['expert_tensor']), or their gradients would miss the other "
            "ranks' tokens"
        )
    need = config.shared * f if split == "tokens" else f  # the widths split over tensor
    if need % t:
        what = "the shared experts'" if split == "tokens" else "every expert's"
        raise InvalidArgument(
            f"moe: ffn={f} (shared={config.shared}) does not divide over tensor axis "
            f"{tensor.name!r} of {t} ranks: each holds 1/{t} of {what} width; use a multiple "
            f"of {t}"
        )
    width = f if split == "tokens" else f // t  # each expert's width held here
    shared = config.shared * f // t  # the shared experts' width: split over tensor either way
    held = {"w_out": (params["w_out"].shape[-2], width, "rows"),
            "w_in": (params["w_in"].shape[-1], 2 * width, "columns")}  # fmt: skip
    if config.shared:
        held |= {"shared_out": (params["shared_out"].shape[0], shared, "rows"),
                 "shared_in": (params["shared_in"].shape[-1], 2 * shared, "columns")}  # fmt: skip
    for name, (got, want, dim) in held.items():
        if got != want:  # (a whole copy would be summed t times over: refused, not summed)
            raise InvalidArgument(
                f"moe: params[{name!r}] holds {got} {dim} of its width; with split={split!r} "
                f"over tensor axis {tensor.name!r} of {t} ranks each holds {want} "
                "(moe.shardings gives the split: shard_tree(params, shardings(config, "
                "split=...), place))"
            )
    return tokens


def _expert_parallel(
    w_in: Tensor,
    w_out: Tensor,
    rows: Tensor,
    expert: Tensor,
    axis: Axis,
    local: int,
    tensor: Axis | None = None,
) -> Tensor:
    """Each row (an assignment, sorted by expert) through its expert on the rank holding it
    (over ``tensor``: each of its ranks exchanges with the expert ranks of its own coordinate,
    and computes its share of the width)."""
    got, routed = dispatch(rows, expert // local, axis, extras=(expert,))
    mine = routed.extras[0] - axis.coord * local
    order = torch.argsort(mine, stable=True)
    ordered = got.index_select(0, order)
    out = _tensor_parallel(ordered, tensor, _experts, w_in, w_out, _counts(mine, local))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return combine(out.index_select(0, inverse), routed)


def expert_shard(params: dict[str, Tensor], config: MoEConfig, axis: Axis) -> dict[str, Tensor]:
    """This rank's params for :func:`moe` over ``axis``: its experts' ``w_in`` and ``w_out``
    (``experts / n`` of them, from ``coord * experts / n``), the rest whole."""
    n = axis.size
    if config.experts % n:
        raise InvalidArgument(
            f"expert_shard: experts={config.experts} do not divide over axis {axis.name!r} of {n}"
        )
    local = config.experts // n
    lo = axis.coord * local
    out = dict(params)
    out["w_in"], out["w_out"] = params["w_in"][lo : lo + local], params["w_out"][lo : lo + local]
    return out


def shardings(
    config: MoEConfig,
    *,
    expert: str | None = "expert",
    tensor: str | None = "tensor",
    split: str = "width",
) -> dict[str, Sharding]:
    """How each of :func:`init`'s leaves is split over the mesh: the experts over ``expert``
    (dim 0) and, with ``split="width"``, their width over ``tensor`` (``w_in``'s columns, whole
    gate-up pairs; ``w_out``'s rows); with ``"tokens"`` the experts over ``expert`` then
    ``tensor`` (the expert x tensor axis's order) and whole. The shared experts' width over
    ``tensor``, the router whole. ``None``: not split over that axis."""
    if split not in SPLITS:
        raise InvalidArgument(f"moe.shardings: split={split!r}; one of {SPLITS}")
    if split == "tokens":
        over = tuple(a for a in (expert, tensor) if a is not None)
        by = Sharding.of(over or None, None, None)
        out = {"router": Sharding.of(None, None), "w_in": by, "w_out": by}
    else:
        out = {
            "router": Sharding.of(None, None),
            "w_in": Sharding.of(expert, None, tensor),
            "w_out": Sharding.of(expert, tensor, None),
        }
    if config.shared:
        out |= {"shared_in": Sharding.of(None, tensor), "shared_out": Sharding.of(tensor, None)}
    return out


def update_bias(bias: Tensor, counts: Tensor, *, rate: float = 1e-3) -> Tensor:
    """DeepSeek-V3's balancing step, as a value: each expert's bias moves by ``rate`` towards
    even load (up where it got fewer than the mean of ``counts``, down where more)."""
    if tuple(counts.shape) != tuple(bias.shape):
        raise InvalidArgument(
            f"update_bias: counts {tuple(counts.shape)} and bias {tuple(bias.shape)} must both "
            "have one value per expert (counts from this layer's stats, summed over the step)"
        )
    mean = counts.to(bias.dtype).mean()
    return bias + rate * torch.sign(mean - counts.to(bias.dtype))
