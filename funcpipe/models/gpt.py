"""A GPT as pure stage functions, tensor-parallel (1D, Megatron) inside every stage.

The model: token embedding (vocabulary-parallel) plus learned positions, ``layers`` pre-norm
blocks (attention with heads split over the tensor axis, an MLP with a column- then a
row-parallel linear), a final layer norm and an LM head that reuses the token embedding (tied,
vocabulary-parallel: each tensor rank computes the logits of its vocabulary block), trained with
the vocabulary-parallel cross-entropy (the full logits never exist on one rank).

``stages`` splits it for a pipeline: stage 0 holds the embedding, the last stage the final norm
and the head, and the blocks are spread as evenly as possible. Parameters are plain nested dicts;
:func:`init` makes the full (single-device) ones, :func:`split` cuts them per stage and
:func:`shardings` says how each leaf is sharded over the tensor axis
(:meth:`funcpipe.parallel.Sharding.shard` / ``gather``). With a size-1 tensor axis the same
functions are the single-device reference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from funcpipe.errors import InvalidArgument
from funcpipe.parallel import ops
from funcpipe.parallel.mesh import Axis
from funcpipe.parallel.sharding import Sharding
from funcpipe.stages.keys import current_key
from funcpipe.stages.stage import Stage

__all__ = [
    "GPTConfig",
    "blocks_per_stage",
    "flops_per_token",
    "full_forward",
    "init",
    "loss_fn",
    "matmul_params",
    "shardings",
    "single_axis",
    "split",
    "stages",
    "tie_spec",
]


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of the model: ``vocab`` tokens, ``context`` positions, ``d_model`` width,
    ``heads`` attention heads, ``layers`` blocks, ``mlp`` hidden width (default 4 x d_model).

    ``dropout``: of the embeddings and of each block's output before the residual add (the
    activation is replicated over the tensor axis: every tensor rank drops the same elements);
    ``attn_dropout``: of the attention probabilities (heads are split: each tensor rank draws
    its own), default ``dropout``. Dropout draws only inside a keyed stage call (a training
    step: :mod:`funcpipe.stages.keys`); elsewhere (evaluation, sampling) it drops nothing.

    ``mlp`` and ``attn_dropout`` are resolved when the config is made and stored as numbers, so
    ``dataclasses.replace(config, d_model=...)`` (or ``dropout=...``) keeps the old ones: pass
    ``mlp=0`` (``attn_dropout=None``) again to have them follow."""

    vocab: int = 256
    context: int = 64
    d_model: int = 64
    heads: int = 4
    layers: int = 4
    mlp: int = 0
    dropout: float = 0.0
    attn_dropout: float | None = None

    def __post_init__(self) -> None:
        for name in ("vocab", "context", "d_model", "heads", "layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"GPTConfig({name}={value!r}): must be an int >= 1")
        if self.attn_dropout is None:
            object.__setattr__(self, "attn_dropout", self.dropout)
        for name in ("dropout", "attn_dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise InvalidArgument(f"GPTConfig({name}={value!r}): a probability in [0, 1)")
        if self.d_model % self.heads:
            raise InvalidArgument(
                f"GPTConfig: d_model={self.d_model} is not divisible by heads={self.heads}"
            )
        if self.mlp == 0:
            object.__setattr__(self, "mlp", 4 * self.d_model)

    def check_tensor(self, t: int) -> None:
        """The sizes a tensor-parallel degree ``t`` needs, checked up front."""
        for name, value in (("vocab", self.vocab), ("heads", self.heads), ("mlp", self.mlp)):
            if value % t:
                raise InvalidArgument(
                    f"GPTConfig({name}={value}) must be divisible by the tensor-parallel size "
                    f"{t}: it is split over the tensor ranks"
                )


def single_axis() -> Axis:
    """A size-1 tensor axis: every collective is the identity (the single-device reference)."""
    return Axis("tensor", 1, 0, None)


# ------------------------------------------------------------------------------ parameters
class _Draw:
    """Leaves drawn on the CPU from one seeded generator, then moved to ``device`` (on the meta
    device nothing is drawn: shapes and dtypes only)."""

    def __init__(self, seed: int, dtype: torch.dtype, device: torch.device) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.dtype, self.device = dtype, device

    def _put(self, t: Tensor) -> Tensor:
        return t if self.device.type == "cpu" else t.to(self.device)

    def normal(self, *shape: int, std: float) -> Tensor:
        if self.device.type == "meta":
            return torch.empty(shape, dtype=self.dtype, device="meta")
        return self._put(torch.randn(shape, generator=self.g, dtype=self.dtype) * std)

    def const(self, value: float, *shape: int) -> Tensor:
        return torch.full(shape, value, dtype=self.dtype, device=self.device)

    def linear(self, out: int, inp: int, scale: float = 1.0) -> dict[str, Tensor]:
        return {
            "weight": self.normal(out, inp, std=scale / math.sqrt(inp)),
            "bias": self.const(0.0, out),
        }

    def norm(self, d: int) -> dict[str, Tensor]:
        return {"weight": self.const(1.0, d), "bias": self.const(0.0, d)}


def init(
    config: GPTConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """The full parameters, drawn from ``seed``, on ``device`` (default: the CPU).

    Every value is drawn on the CPU from one seeded ``torch.Generator`` and then moved, so every
    rank and every device gets the same parameters bit for bit (a CUDA generator would draw other
    numbers than the CPU's). ``device="meta"`` gives the shapes and dtypes without drawing.
    """
    if not isinstance(config, GPTConfig):
        raise InvalidArgument(f"init(config={config!r}): pass a GPTConfig")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InvalidArgument(f"init(dtype={dtype!r}): a floating dtype such as torch.float32")
    try:
        where = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgument(f"init(device={device!r}): not a device ({e})") from None
    draw = _Draw(seed, dtype, where)
    d, c = config.d_model, config
    resid = 1.0 / math.sqrt(2 * c.layers)  # keep the residual stream's scale with depth
    blocks = []
    for _ in range(c.layers):
        q, k, v = (draw.linear(d, d) for _ in range(3))
        attn = {
            "qkv": {n: ops.fuse_qkv(q[n], k[n], v[n], num_heads=c.heads) for n in q},
            "o": draw.linear(d, d, resid),
            "norm": draw.norm(d),
        }
        mlp = {
            "fc1": draw.linear(c.mlp, d),
            "fc2": draw.linear(d, c.mlp, resid),
            "norm": draw.norm(d),
        }
        blocks.append({"attn": attn, "mlp": mlp})
    return {
        "wte": draw.normal(c.vocab, d, std=0.02),
        "wpe": draw.normal(c.context, d, std=0.02),
        "blocks": blocks,
        "norm": draw.norm(d),
    }


def matmul_params(config: GPTConfig) -> int:
    """``N`` of :func:`flops_per_token`: every parameter but the position embedding (a lookup,
    nothing multiplies it); the token embedding counts once, as the tied LM head's weight.
    Biases and norms are included (about 0.1% of ``N`` at d_model 1024)."""
    d, c = config.d_model, config
    attn = 4 * (d * d + d) + 2 * d
    mlp = (c.mlp * d + c.mlp) + (d * c.mlp + d) + 2 * d
    return c.layers * (attn + mlp) + c.vocab * d + 2 * d


def flops_per_token(config: GPTConfig, *, training: bool = True) -> float:
    """Model FLOPs per token: ``6 N + 12 L d T`` for a training step (``2 N + 4 L d T`` for a
    forward only), where ``N`` = :func:`matmul_params`, ``L`` layers, ``d`` d_model and ``T`` the
    context. ``6 N``: a multiply-add per parameter forward, two backward; ``12 L d T``: the
    attention scores ``q k^T`` and ``softmax @ v``, ``2 d T`` each forward per token and layer,
    times three for the backward (counted over the full square, as in PaLM's MFU, though half of
    a causal mask is zero). Recomputation is not counted: these are model FLOPs, not the
    hardware's."""
    n, attn = matmul_params(config), config.layers * config.d_model * config.context
    return float(6 * n + 12 * attn) if training else float(2 * n + 4 * attn)


def blocks_per_stage(
    config: GPTConfig, n_stages: int, blocks: Sequence[int] | None = None
) -> list[range]:
    """The blocks of each stage: as even as possible, the extra ones on the middle stages
    (the first and the last stage also carry the embedding and the head); or ``blocks``
    per stage when given (an uneven split, e.g. ``(1, 6)`` for 7 layers on 2 stages)."""
    if not isinstance(n_stages, int) or n_stages < 1:
        raise InvalidArgument(f"n_stages={n_stages!r}: an int >= 1")
    if blocks is not None:
        return _given_blocks(config, n_stages, blocks)
    if n_stages > config.layers + 1 and n_stages > 1:
        raise InvalidArgument(
            f"n_stages={n_stages} > layers + 1 = {config.layers + 1}: some stage would be empty; "
            "use more layers or fewer stages"
        )
    base, extra = divmod(config.layers, n_stages)
    order = sorted(range(n_stages), key=lambda s: (s in (0, n_stages - 1), s))
    sizes = [base] * n_stages
    for s in order[:extra]:
        sizes[s] += 1
    out, start = [], 0
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return out


def _given_blocks(config: GPTConfig, n_stages: int, blocks: Sequence[int]) -> list[range]:
    sizes = list(blocks) if isinstance(blocks, (list, tuple)) else None
    if (
        sizes is None
        or len(sizes) != n_stages
        or any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in sizes)
        or sum(sizes) != config.layers
    ):
        raise InvalidArgument(
            f"blocks={blocks!r}: the number of blocks of each of the {n_stages} stages, ints "
            f">= 0 that add up to layers={config.layers}"
        )
    out, start = [], 0
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return out


def split(
    full: dict[str, Any],
    config: GPTConfig,
    n_stages: int,
    *,
    blocks: Sequence[int] | None = None,
) -> tuple[dict[str, Any], ...]:
    """Per-stage params: blocks keyed by their global index; ``wte`` on the first stage and a
    copy on the last (tie them with ``ties={"wte": [(0, "wte"), (n - 1, "wte")]}``).
    ``blocks``: how many blocks each stage holds (default: :func:`blocks_per_stage`'s)."""
    parts = []
    for s, blocks_s in enumerate(blocks_per_stage(config, n_stages, blocks)):
        p: dict[str, Any] = {"blocks": {str(i): full["blocks"][i] for i in blocks_s}}
        if s == 0:
            p["wte"], p["wpe"] = full["wte"], full["wpe"]
        if s == n_stages - 1:
            p["norm"] = full["norm"]
            p["wte"] = full["wte"] if s == 0 else full["wte"].clone()
        parts.append(p)
    return tuple(parts)


def shardings(
    config: GPTConfig,
    n_stages: int,
    *,
    axis: str = "tensor",
    blocks: Sequence[int] | None = None,
) -> tuple[dict[str, Any], ...]:
    """How every leaf of :func:`split`'s params is sharded over ``axis`` (1D tensor parallel)."""
    block = {
        "attn": ops.attention_block_sharding(axis=axis, fused_qkv=True).params,
        "mlp": ops.mlp_block_sharding(axis=axis).params,
    }
    rep1, rep2 = Sharding.of(None), Sharding.of(None, None)
    out = []
    for s, blocks_s in enumerate(blocks_per_stage(config, n_stages, blocks)):
        lay: dict[str, Any] = {"blocks": {str(i): block for i in blocks_s}}
        if s == 0:
            lay["wte"], lay["wpe"] = Sharding.of(axis, None), rep2
        if s == n_stages - 1:
            lay["norm"] = {"weight": rep1, "bias": rep1}
            lay["wte"] = Sharding.of(axis, None)
        out.append(lay)
    return tuple(out)


layouts = shardings  # the old name (a tensor's layout over the mesh is now its sharding)


# ------------------------------------------------------------------------------ stage functions
def stages(
    config: GPTConfig, n_stages: int, *, axis: Axis, blocks: Sequence[int] | None = None
) -> list[Stage]:
    """The stage functions; ``axis`` is this rank's tensor axis (``single_axis()`` for one
    device); ``blocks`` as for :func:`split`."""
    config.check_tensor(axis.size)
    heads = config.heads
    drop, attn_drop = float(config.dropout), float(config.attn_dropout or 0.0)
    out = []
    for s, held in enumerate(blocks_per_stage(config, n_stages, blocks)):
        first, last = s == 0, s == n_stages - 1
        keys = [str(i) for i in held]

        def fn(
            p: dict[str, Any],
            x: Tensor,
            *,
            _first: bool = first,
            _last: bool = last,
            _keys: list[str] = keys,
        ) -> Tensor:
            keyed = (drop or attn_drop) and current_key() is not None
            if _first:
                h = ops.vocab_parallel_embedding(x, {"weight": p["wte"]}, axis=axis)
                h = h + p["wpe"][: x.shape[-1]]
                h = F.dropout(h, drop) if keyed and drop else h
            else:
                h = x
            d, ad = (drop, attn_drop) if keyed else (0.0, 0.0)  # (no key: nothing drawn)
            for k in _keys:
                blk = p["blocks"][k]
                h = ops.attention_block(
                    h, blk["attn"], axis=axis, num_heads=heads, causal=True, dropout=d,
                    attn_dropout=ad,
                )  # fmt: skip
                h = ops.mlp_block(h, blk["mlp"], axis=axis, dropout=d)
            if _last:
                h = F.layer_norm(
                    h, h.shape[-1:], p["norm"]["weight"], p["norm"]["bias"], ops.LN_EPS
                )
                h = ops.column_parallel_linear(
                    h, {"weight": p["wte"]}, axis=axis
                )  # logits [b, s, V/t]
            return h

        name = (
            f"gpt stage {s}: "
            + ("embed + " if first else "")
            + (f"blocks {held.start}-{held.stop - 1}" if held else "no blocks")
            + (" + head" if last else "")
        )
        out.append(Stage(fn, name=name))
    return out


def loss_fn(*, axis: Axis, ignore_index: int | None = None) -> Callable[[Tensor, Tensor], Any]:
    """Mean next-token cross-entropy from vocabulary-parallel logits ``[b, s, V/t]``; in float32
    for bf16 logits too (the cross-entropy computes in float32 without a float32 copy of the
    logits).

    With ``ignore_index`` (e.g. -100 on padding) the loss is ``(sum, count)`` over the tokens
    whose target is not ``ignore_index``, so a step's loss is the mean over every counted token
    of the batch, however they fall into microbatches and data-parallel copies
    (:mod:`funcpipe.runtime.loss_terms`)."""

    def loss(logits: Tensor, targets: Tensor) -> Tensor:
        return ops.vocab_parallel_cross_entropy(logits, targets, axis=axis).mean()

    if ignore_index is None:
        return loss
    ignored = int(ignore_index)

    def counted(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        keep = targets.ne(ignored)
        ids = targets.masked_fill(~keep, 0)
        per_token = ops.vocab_parallel_cross_entropy(logits, ids, axis=axis)
        return per_token.masked_fill(~keep, 0).sum(), keep.sum()

    return counted


def full_forward(params: dict[str, Any], config: GPTConfig, tokens: Tensor) -> Tensor:
    """Logits ``[b, s, V]`` of the whole model on one device (sampling, reference checks)."""
    fns = stages(config, 1, axis=single_axis())
    return fns[0](split(params, config, 1)[0], tokens)


def tie_spec(n_stages: int) -> dict[str, list[tuple[int, str]]] | None:
    """The ``ties=`` argument for :class:`funcpipe.Pipeline` (None for one stage)."""
    return {"wte": [(0, "wte"), (n_stages - 1, "wte")]} if n_stages > 1 else None
