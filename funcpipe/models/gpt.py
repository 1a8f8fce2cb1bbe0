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

With ``GPTConfig(experts=E)`` the MLP of every ``moe_every``-th block is a mixture of ``E``
experts (:mod:`funcpipe.models.moe`: a top-k router, SwiGLU experts of width ``expert_ffn``,
``shared_experts`` always on), split over the mesh's expert axis when :func:`stages` gets one.
Each stage then passes ``(h, aux)``: ``aux`` the sum of its MoE layers' Switch auxiliary losses
over this microbatch added to what it received, so :func:`loss_fn` adds ``aux_weight * aux``
to the cross-entropy and the auxiliary loss's gradient reaches every router through the
pipeline's own backward, under any schedule. :func:`expert_paths` names the expert leaves for
``Pipeline(experts=...)``; :func:`expert_load` counts each expert's tokens on one device;
:mod:`funcpipe.models.gpt_balance` balances the experts (DeepSeek's bias, the batch's Switch
loss) with values the stages take as side inputs.
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
from funcpipe.models import moe
from funcpipe.parallel import ops
from funcpipe.parallel.mesh import Axis
from funcpipe.parallel.sharding import Sharding
from funcpipe.stages.keys import current_key
from funcpipe.stages.stage import Stage
from funcpipe.stages.tally import collecting, tally

__all__ = [
    "GPTConfig",
    "blocks_per_stage",
    "expert_load",
    "expert_paths",
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
    ``mlp=0`` (``attn_dropout=None``) again to have them follow.

    ``experts``: 0 for dense MLPs, else the experts of each MoE layer; ``top_k`` experts per
    token; ``moe_every``: block ``i`` is an MoE block when ``(i + 1) % moe_every == 0`` (1:
    every block); ``shared_experts`` every token goes through; ``expert_ffn``: each expert's
    hidden width (default ``mlp``, as Mixtral's experts are its dense MLP's width);
    ``moe_tensor``: how an MoE block uses a tensor axis (:data:`funcpipe.models.moe.SPLITS`):
    ``"width"`` splits each expert's width over it, ``"tokens"`` its tokens, with the experts
    over the expert x tensor ranks (``stages(..., expert=mesh["expert_tensor"])``)."""

    vocab: int = 256
    context: int = 64
    d_model: int = 64
    heads: int = 4
    layers: int = 4
    mlp: int = 0
    dropout: float = 0.0
    attn_dropout: float | None = None
    experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    shared_experts: int = 0
    expert_ffn: int = 0
    moe_tensor: str = "width"

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
        for name in ("experts", "top_k", "moe_every", "shared_experts", "expert_ffn"):
            value = getattr(self, name)
            if type(value) is not int or value < (1 if name in ("top_k", "moe_every") else 0):
                raise InvalidArgument(f"GPTConfig({name}={value!r}): an int >= 0 (top_k, "
                                      "moe_every: >= 1)")  # fmt: skip
        if self.moe_tensor not in moe.SPLITS:
            raise InvalidArgument(
                f"GPTConfig(moe_tensor={self.moe_tensor!r}): one of {moe.SPLITS} (split each "
                "expert's width over the tensor ranks, or the tokens)"
            )
        if self.experts:
            if self.expert_ffn == 0:
                object.__setattr__(self, "expert_ffn", self.mlp)
            if not self.moe_blocks:
                raise InvalidArgument(
                    f"GPTConfig(experts={self.experts}, moe_every={self.moe_every}): no block "
                    f"of the {self.layers} is an MoE block; use moe_every <= layers"
                )
            _ = self.moe_config  # (validates top_k against the experts)

    @property
    def moe_blocks(self) -> tuple[int, ...]:
        """The blocks whose MLP is a mixture of experts (none for a dense model)."""
        if not self.experts:
            return ()
        return tuple(i for i in range(self.layers) if (i + 1) % self.moe_every == 0)

    @property
    def moe_config(self) -> moe.MoEConfig:
        """The MoE layers' :class:`~funcpipe.models.moe.MoEConfig`."""
        return moe.MoEConfig(
            d_model=self.d_model, experts=self.experts, ffn=self.expert_ffn, top_k=self.top_k,
            shared=self.shared_experts,
        )  # fmt: skip

    def check_tensor(self, t: int) -> None:
        """The sizes a tensor-parallel degree ``t`` needs, checked up front."""
        sizes = [("vocab", self.vocab), ("heads", self.heads), ("mlp", self.mlp)]
        if self.experts and self.moe_tensor == "width":  # each expert's width is split too
            sizes.append(("expert_ffn", self.expert_ffn))
        elif self.experts and self.shared_experts:  # (whole experts; the shared ones' width)
            sizes.append(("shared_experts x expert_ffn", self.shared_experts * self.expert_ffn))
        for name, value in sizes:
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

    def experts(self, c: moe.MoEConfig, resid: float) -> dict[str, Tensor]:
        """An MoE layer's parameters (the layout of :func:`funcpipe.models.moe.init`)."""
        d, e, f = c.d_model, c.experts, c.ffn
        out = {
            "router": self.normal(e, d, std=1 / math.sqrt(d)),
            "w_in": self.normal(e, d, 2 * f, std=1 / math.sqrt(d)),
            "w_out": self.normal(e, f, d, std=resid / math.sqrt(f)),
        }
        if c.shared:
            out["shared_in"] = self.normal(d, 2 * c.shared * f, std=1 / math.sqrt(d))
            out["shared_out"] = self.normal(c.shared * f, d, std=resid / math.sqrt(c.shared * f))
        return out


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
    for i in range(c.layers):
        q, k, v = (draw.linear(d, d) for _ in range(3))
        attn = {
            "qkv": {n: ops.fuse_qkv(q[n], k[n], v[n], num_heads=c.heads) for n in q},
            "o": draw.linear(d, d, resid),
            "norm": draw.norm(d),
        }
        if i in c.moe_blocks:
            blocks.append({"attn": attn, "moe": {**draw.experts(c.moe_config, resid),
                                                 "norm": draw.norm(d)}})  # fmt: skip
            continue
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
    Biases and norms are included (about 0.1% of ``N`` at d_model 1024). With experts, an MoE
    block counts the parameters a token meets: the router, ``top_k`` experts and the shared
    ones."""
    d, c = config.d_model, config
    attn = 4 * (d * d + d) + 2 * d
    mlp = (c.mlp * d + c.mlp) + (d * c.mlp + d) + 2 * d
    n_moe = len(c.moe_blocks)
    active = c.experts * d + (c.top_k + c.shared_experts) * 3 * d * c.expert_ffn + 2 * d
    return c.layers * attn + (c.layers - n_moe) * mlp + n_moe * active + c.vocab * d + 2 * d


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
    attn = ops.attention_block_sharding(axis=axis, fused_qkv=True).params
    block = {"attn": attn, "mlp": ops.mlp_block_sharding(axis=axis).params}
    rep1, rep2 = Sharding.of(None), Sharding.of(None, None)
    experts: dict[str, Any] = {"norm": {"weight": rep1, "bias": rep1}}
    if config.experts:  # E/ep experts per copy (the mesh's expert axis), their width over axis
        experts |= moe.shardings(
            config.moe_config, expert="expert", tensor=axis, split=config.moe_tensor
        )
    moe_block = {"attn": attn, "moe": experts}
    out = []
    for s, blocks_s in enumerate(blocks_per_stage(config, n_stages, blocks)):
        lay: dict[str, Any] = {
            "blocks": {str(i): moe_block if i in config.moe_blocks else block for i in blocks_s}
        }
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
    config: GPTConfig,
    n_stages: int,
    *,
    axis: Axis,
    blocks: Sequence[int] | None = None,
    expert: Axis | None = None,
) -> list[Stage]:
    """The stage functions; ``axis`` is this rank's tensor axis (``single_axis()`` for one
    device); ``blocks`` as for :func:`split`; ``expert``: the mesh's expert axis, over which
    the MoE layers' experts are split (``None``: every expert here). With experts a stage takes
    and returns ``(h, aux)`` (the first takes the tokens, the last returns the logits)."""
    config.check_tensor(axis.size)
    split = config.moe_tensor
    if config.experts and split == "tokens" and axis.size > 1:
        name = None if expert is None else expert.name
        if name != "expert_tensor":
            raise InvalidArgument(
                f"GPTConfig(moe_tensor='tokens') over a tensor axis of {axis.size} with "
                f"expert={name!r}: each tensor rank routes its own tokens, so the experts are "
                "spread over the expert x tensor ranks; pass expert=mesh['expert_tensor']"
            )
    mixed = bool(config.experts)
    # (made once, not per block and microbatch: the MoE layers' config, each block's row of
    # the routing bias and load)
    mcfg = config.moe_config if mixed else None
    row = {str(i): j for j, i in enumerate(config.moe_blocks)}
    rows = (len(config.moe_blocks), config.experts)
    heads = config.heads
    drop, attn_drop = float(config.dropout), float(config.attn_dropout or 0.0)
    out = []
    for s, held in enumerate(blocks_per_stage(config, n_stages, blocks)):
        first, last = s == 0, s == n_stages - 1
        keys = [str(i) for i in held]

        def fn(
            p: dict[str, Any],
            x: Tensor,
            aux: Tensor | None = None,
            *,
            route_bias: Tensor | None = None,
            route_load: Tensor | None = None,
            _first: bool = first,
            _last: bool = last,
            _keys: list[str] = keys,
        ) -> Any:
            keyed = (drop or attn_drop) and current_key() is not None
            for name, t in (("route_bias", route_bias), ("route_load", route_load)):
                if t is not None and tuple(t.shape) != rows:
                    raise InvalidArgument(
                        f"gpt stage: {name} has shape {tuple(t.shape)}; it holds a row per MoE "
                        f"block and a value per expert: {rows} (gpt_balance.route_bias(config))"
                    )
            if _first:
                h = ops.vocab_parallel_embedding(x, {"weight": p["wte"]}, axis=axis)
                h = h + p["wpe"][: x.shape[-1]]
                h = F.dropout(h, drop) if keyed and drop else h
                # (float32 at least: bf16 sums of small losses lose them; float64 stays)
                aux = h.new_zeros((), dtype=_wide(h.dtype)) if mixed else None
            else:
                h = x
            d, ad = (drop, attn_drop) if keyed else (0.0, 0.0)  # (no key: nothing drawn)
            for k in _keys:
                blk = p["blocks"][k]
                h = ops.attention_block(
                    h, blk["attn"], axis=axis, num_heads=heads, causal=True, dropout=d,
                    attn_dropout=ad,
                )  # fmt: skip
                if "moe" not in blk:
                    h = ops.mlp_block(h, blk["mlp"], axis=axis, dropout=d)
                    continue
                j = row[k]
                bias = None if route_bias is None else route_bias[j]
                load = None if route_load is None else route_load[j]
                h, stats = _moe_block(
                    h, blk["moe"], mcfg or config.moe_config, expert, d, bias, load, axis, split
                )
                a = stats["aux"].to(_wide(stats["aux"].dtype))
                aux = a if aux is None else aux + a.to(aux.dtype)
                tally(f"blocks.{k}.moe.counts", stats["counts"])  # (summed by the step)
            if _last:
                h = F.layer_norm(
                    h, h.shape[-1:], p["norm"]["weight"], p["norm"]["bias"], ops.LN_EPS
                )
                h = ops.column_parallel_linear(
                    h, {"weight": p["wte"]}, axis=axis
                )  # logits [b, s, V/t]
            return (h, aux) if mixed else h

        name = (
            f"gpt stage {s}: "
            + ("embed + " if first else "")
            + (f"blocks {held.start}-{held.stop - 1}" if held else "no blocks")
            + (" + head" if last else "")
        )
        out.append(Stage(fn, name=name))
    return out


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float64 as it is, anything narrower as float32 (not torch.promote_types: an ATen op)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _moe_block(
    h: Tensor,
    p: dict[str, Any],
    config: moe.MoEConfig,
    expert: Axis | None,
    dropout: float,
    bias: Tensor | None,
    load: Tensor | None,
    tensor: Axis | None = None,
    split: str = "width",
) -> tuple[Tensor, dict[str, Tensor]]:
    """The pre-norm MoE sublayer: ``h + moe(layer_norm(h))`` (its output dropped like the
    MLP's), and the layer's stats; ``split`` says how it uses ``tensor``."""
    x = F.layer_norm(h, h.shape[-1:], p["norm"]["weight"], p["norm"]["bias"], ops.LN_EPS)
    y, stats = moe.moe(p, x, config, bias, axis=expert, load=load, tensor=tensor, split=split)
    return h + (F.dropout(y, dropout) if dropout else y), stats


def loss_fn(
    *, axis: Axis, ignore_index: int | None = None, aux_weight: float = 0.01
) -> Callable[[Any, Tensor], Any]:
    """Mean next-token cross-entropy from vocabulary-parallel logits ``[b, s, V/t]``; in float32
    for bf16 logits too (the cross-entropy computes in float32 without a float32 copy of the
    logits). With experts the outputs are ``(logits, aux)`` and the loss adds
    ``aux_weight * aux`` (the MoE layers' Switch losses of this microbatch; 0: the
    cross-entropy alone, e.g. to evaluate).

    With ``ignore_index`` (e.g. -100 on padding) the loss is ``(sum, count)`` over the tokens
    whose target is not ``ignore_index``, so a step's loss is the mean over every counted token
    of the batch, however they fall into microbatches and data-parallel copies
    (:mod:`funcpipe.runtime.loss_terms`)."""

    weight = float(aux_weight)

    def loss(out: Any, targets: Tensor) -> Tensor:
        logits, aux = out if isinstance(out, tuple) else (out, None)
        ce = ops.vocab_parallel_cross_entropy(logits, targets, axis=axis).mean()
        return ce if aux is None or not weight else ce + weight * aux

    if ignore_index is None:
        return loss
    ignored = int(ignore_index)

    def counted(out: Any, targets: Tensor) -> tuple[Tensor, Tensor]:
        logits, aux = out if isinstance(out, tuple) else (out, None)
        keep = targets.ne(ignored)
        ids = targets.masked_fill(~keep, 0)
        per_token = ops.vocab_parallel_cross_entropy(logits, ids, axis=axis)
        total, count = per_token.masked_fill(~keep, 0).sum(), keep.sum()
        if aux is not None and weight:  # the microbatch's aux, weighted by its tokens
            total = total + weight * aux * count
        return total, count

    return counted


def full_forward(params: dict[str, Any], config: GPTConfig, tokens: Tensor) -> Tensor:
    """Logits ``[b, s, V]`` of the whole model on one device (sampling, reference checks)."""
    fns = stages(config, 1, axis=single_axis())
    out = fns[0](split(params, config, 1)[0], tokens)
    return out[0] if config.experts else out


def expert_load(params: dict[str, Any], config: GPTConfig, tokens: Tensor) -> Tensor:
    """``[MoE blocks, experts]``: the tokens each expert of each MoE block takes (its top-k
    assignments) for ``tokens``, on one device with the full params."""
    if not config.experts:
        raise InvalidArgument("expert_load: the GPTConfig has no experts (experts=0)")
    counts: dict[str, Tensor] = {}
    fn = stages(config, 1, axis=single_axis())[0]
    with torch.no_grad(), collecting(counts):  # (what the blocks tally)
        fn(split(params, config, 1)[0], tokens)
    return torch.stack([counts[f"blocks.{i}.moe.counts"] for i in config.moe_blocks])


def expert_paths(
    config: GPTConfig, n_stages: int, *, blocks: Sequence[int] | None = None
) -> list[tuple[int, str]]:
    """``Pipeline(experts=...)`` for :func:`split`'s params: each MoE block's ``w_in`` and
    ``w_out``, as ``(stage, "blocks.<i>.moe.w_in")``."""
    return [
        (s, f"blocks.{i}.moe.{leaf}")
        for s, held in enumerate(blocks_per_stage(config, n_stages, blocks))
        for i in held
        if i in config.moe_blocks
        for leaf in ("w_in", "w_out")
    ]


def tie_spec(n_stages: int) -> dict[str, list[tuple[int, str]]] | None:
    """The ``ties=`` argument for :class:`funcpipe.Pipeline` (None for one stage)."""
    return {"wte": [(0, "wte"), (n_stages - 1, "wte")]} if n_stages > 1 else None
