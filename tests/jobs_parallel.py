"""Jobs for tests/parallel (run on gloo ranks through the session pool) and their checkers.

Every op test case is a dict ``{"op", "config", "dims", "seed"}``. On every rank,
:func:`run_op_cases` builds the mesh of the config, makes the full tensors from a generator
seeded by the case, shards them with the op's layout, runs forward and backward (the upstream
gradient is a random tensor sharded like the output) and returns the local output, gradients and
byte counts. In the parent, :func:`check_op_case` recomputes everything on one device (plain
torch, independent of funcpipe.parallel) and compares rank by rank and gathered, and compares
the bytes with the closed form of each op's algorithm.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from funcpipe.parallel import (
    Mesh,
    OpSharding,
    ParallelConfig,
    Sharding,
    build_mesh,
    count_bytes,
    ops,
    shard_spec,
    summa,
)
from funcpipe.testing import assert_trees_close
from funcpipe.tree import tree_leaves, tree_map

DT = torch.float64
EL = 8  # bytes per float64
EPS = 1e-5


# ------------------------------------------------------------------------------ meshes (per worker)
def mesh_for(config: dict[str, Any]) -> Mesh:
    """The mesh of ``config``: build_mesh reuses the process groups of an earlier mesh of the
    same config (until the test ends: tests/conftest.py destroys them after each test)."""
    return build_mesh(config)


# ------------------------------------------------------------------------------ closed forms
Traffic = Counter  # (kind, phase, axis) -> bytes one rank sends (ring model)


def _t(kind: str, phase: str, axis: str, volume: float) -> Traffic:
    return Counter({(kind, phase, axis): volume}) if volume else Counter()


def AR(phase: str, axis: str, numel: float, n: int) -> Traffic:
    return _t("all_reduce", phase, axis, 2 * (n - 1) / n * numel * EL)


def AG(phase: str, axis: str, numel_in: float, n: int) -> Traffic:
    return _t("all_gather", phase, axis, (n - 1) * numel_in * EL)


def RS(phase: str, axis: str, numel_in: float, n: int) -> Traffic:
    return _t("reduce_scatter", phase, axis, (n - 1) / n * numel_in * EL)


def BC(phase: str, axis: str, numel: float, n: int, times: int = 1) -> Traffic:
    return _t("broadcast", phase, axis, times * (n - 1) / n * numel * EL)


def RED(phase: str, axis: str, numel: float, n: int, times: int = 1) -> Traffic:
    return _t("reduce", phase, axis, times * (n - 1) / n * numel * EL)


def SEND(phase: str, axis: str, numel: float, n: int, times: int) -> Traffic:
    return _t("send", phase, axis, times * numel * EL) if n > 1 else Counter()


def total(*parts: Traffic) -> Traffic:
    out: Traffic = Counter()
    for p in parts:
        out.update(p)
    return out


# ------------------------------------------------------------------------------ references
def R(g: torch.Generator, *shape: int, scale: float = 1.0) -> Tensor:
    return torch.randn(*shape, generator=g, dtype=DT) * scale


def lin_p(g: torch.Generator, n_out: int, n_in: int, *, io: bool = False) -> dict[str, Tensor]:
    """A linear layer's params: ``[out, in]`` (torch) or ``[in, out]`` (``io``, SUMMA modes)."""
    w = R(g, n_in, n_out, scale=n_in**-0.5) if io else R(g, n_out, n_in, scale=n_in**-0.5)
    return {"weight": w, "bias": R(g, n_out, scale=0.1)}


def norm_p(g: torch.Generator, d: int) -> dict[str, Tensor]:
    return {"weight": 1 + R(g, d, scale=0.1), "bias": R(g, d, scale=0.1)}


def ref_lin(x: Tensor, p: dict[str, Tensor], io: bool = False) -> Tensor:
    y = x @ p["weight"] if io else x @ p["weight"].T
    return y + p["bias"] if "bias" in p else y


def ref_ln(x: Tensor, p: dict[str, Tensor]) -> Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + EPS) * p["weight"] + p["bias"]


def ref_sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def ref_mha(x: Tensor, p: dict[str, Any], heads: int, causal: bool, io: bool = False) -> Tensor:
    b, s, d = x.shape

    def split(y: Tensor) -> Tensor:
        return y.reshape(b, s, heads, d // heads).transpose(1, 2)

    q, k, v = (split(ref_lin(x, p[n], io)) for n in ("q", "k", "v"))
    y = ref_sdpa(q, k, v, causal).transpose(1, 2).reshape(b, s, d)
    return ref_lin(y, p["o"], io)


def ref_mlp(x: Tensor, p: dict[str, Any], io: bool = False) -> Tensor:
    return ref_lin(F.gelu(ref_lin(x, p["fc1"], io)), p["fc2"], io)


def ref_ce(logits: Tensor, target: Tensor) -> Tensor:
    v = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, v), target.reshape(-1), reduction="none").reshape(
        target.shape
    )


# ------------------------------------------------------------------------------ the op registry
Inputs = tuple[Tensor, ...]


@dataclass(frozen=True)
class Op:
    """One op under test: its mode, how to make and run it, its reference, layout and traffic.

    ``multiples(sizes)`` gives, per dim name, what the drawn size must be a multiple of.
    """

    mode: str
    multiples: Callable[[dict[str, int]], dict[str, int]]
    make: Callable[[dict[str, int], torch.Generator], tuple[Inputs, Any]]
    run: Callable[[Mesh, Inputs, Any, dict[str, int]], Tensor]
    ref: Callable[[Inputs, Any, dict[str, int]], Tensor]
    layout: Callable[[dict[str, int]], OpSharding]
    traffic: Callable[[dict[str, int], dict[str, int]], Traffic]


OPS: dict[str, Op] = {}


def _one_d(
    name: str,
    multiples: Callable[[int], dict[str, int]],
    make: Callable[[dict[str, int], torch.Generator], tuple[Inputs, Any]],
    run: Callable[..., Tensor],
    ref: Callable[[Inputs, Any, dict[str, int]], Tensor],
    layout: Callable[[dict[str, int]], OpSharding],
    traffic: Callable[[dict[str, int], int], Traffic],
    *,
    mode: str = "1d",
    axis: str = "tensor",
) -> None:
    OPS[name] = Op(
        mode,
        lambda sz: multiples(sz[axis]),
        make,
        lambda mesh, xs, p, d: run(*xs, p, axis=mesh[axis], d=d),
        ref,
        layout,
        lambda d, sz: traffic(d, sz[axis]),
    )


T = "tensor"
# ---- 1D linear layers
_one_d(
    "column",
    lambda t: {"o": t},
    lambda d, g: ((R(g, d["b"], d["s"], d["i"]),), lin_p(g, d["o"], d["i"])),
    lambda x, p, axis, d: ops.column_parallel_linear(x, p, axis=axis),
    lambda xs, p, d: ref_lin(xs[0], p),
    lambda d: ops.column_parallel_sharding(),
    lambda d, t: AR("backward", T, d["b"] * d["s"] * d["i"], t),
)
_one_d(
    "column_gather",
    lambda t: {"o": t},
    lambda d, g: ((R(g, d["b"], d["s"], d["i"]),), lin_p(g, d["o"], d["i"])),
    lambda x, p, axis, d: ops.column_parallel_linear(x, p, axis=axis, gather_output=True),
    lambda xs, p, d: ref_lin(xs[0], p),
    lambda d: ops.column_parallel_sharding(gather_output=True),
    lambda d, t: total(
        AG("forward", T, d["b"] * d["s"] * d["o"] // t, t),
        AR("backward", T, d["b"] * d["s"] * d["i"], t),
    ),
)
_one_d(
    "row",
    lambda t: {"i": t},
    lambda d, g: ((R(g, d["b"], d["s"], d["i"]),), lin_p(g, d["o"], d["i"])),
    lambda x, p, axis, d: ops.row_parallel_linear(x, p, axis=axis),
    lambda xs, p, d: ref_lin(xs[0], p),
    lambda d: ops.row_parallel_sharding(),
    lambda d, t: AR("forward", T, d["b"] * d["s"] * d["o"], t),
)
# ---- vocab parallel
_one_d(
    "vocab_embedding",
    lambda t: {"v": t},
    lambda d, g: (
        (torch.randint(d["v"], (d["b"], d["s"]), generator=g),),
        {"weight": R(g, d["v"], d["d"])},
    ),
    lambda ids, p, axis, d: ops.vocab_parallel_embedding(ids, p, axis=axis),
    lambda xs, p, d: F.embedding(xs[0], p["weight"]),
    lambda d: ops.vocab_parallel_embedding_sharding(),
    lambda d, t: AR("forward", T, d["b"] * d["s"] * d["d"], t),
)
_one_d(
    "vocab_cross_entropy",
    lambda t: {"v": t},
    lambda d, g: (
        (
            R(g, d["b"], d["s"], d["v"], scale=3.0),
            torch.randint(d["v"], (d["b"], d["s"]), generator=g),
        ),
        {},
    ),
    lambda logits, target, p, axis, d: ops.vocab_parallel_cross_entropy(logits, target, axis=axis),
    lambda xs, p, d: ref_ce(xs[0], xs[1]),
    lambda d: ops.vocab_parallel_cross_entropy_sharding(),
    lambda d, t: total(
        AR("forward", T, d["b"] * d["s"], t), AR("forward", T, 2 * d["b"] * d["s"], t)
    ),
)


# ---- attention, MLP, blocks (1D)
def _attn_p(d: dict[str, int], g: torch.Generator, io: bool = False) -> dict[str, Any]:
    w = d["h"] * d["e"]
    return {n: lin_p(g, w, w, io=io) for n in ("q", "k", "v", "o")}


def _mlp_p(d: dict[str, int], g: torch.Generator, io: bool = False) -> dict[str, Any]:
    w = d["h"] * d["e"]
    return {"fc1": lin_p(g, d["f"], w, io=io), "fc2": lin_p(g, w, d["f"], io=io)}


def _x(d: dict[str, int], g: torch.Generator) -> Inputs:
    return (R(g, d["b"], d["s"], d["h"] * d["e"]),)


def _width(d: dict[str, int]) -> int:
    return d["h"] * d["e"]


_one_d(
    "attention",
    lambda t: {"h": t},
    lambda d, g: (_x(d, g), _attn_p(d, g)),
    lambda x, p, axis, d: ops.parallel_attention(
        x, p, axis=axis, num_heads=d["h"], causal=bool(d["causal"])
    ),
    lambda xs, p, d: ref_mha(xs[0], p, d["h"], bool(d["causal"])),
    lambda d: ops.parallel_attention_sharding(),
    lambda d, t: total(
        AR("forward", T, d["b"] * d["s"] * _width(d), t),
        AR("backward", T, d["b"] * d["s"] * _width(d), t),
    ),
)
_one_d(
    "mlp",
    lambda t: {"f": t},
    lambda d, g: (_x(d, g), _mlp_p(d, g)),
    lambda x, p, axis, d: ops.parallel_mlp(x, p, axis=axis),
    lambda xs, p, d: ref_mlp(xs[0], p),
    lambda d: ops.parallel_mlp_sharding(),
    lambda d, t: total(
        AR("forward", T, d["b"] * d["s"] * _width(d), t),
        AR("backward", T, d["b"] * d["s"] * _width(d), t),
    ),
)
_one_d(
    "mlp_block",
    lambda t: {"f": t},
    lambda d, g: (_x(d, g), {**_mlp_p(d, g), "norm": norm_p(g, _width(d))}),
    lambda x, p, axis, d: ops.mlp_block(x, p, axis=axis),
    lambda xs, p, d: xs[0] + ref_mlp(ref_ln(xs[0], p["norm"]), p),
    lambda d: ops.mlp_block_sharding(),
    lambda d, t: total(
        AR("forward", T, d["b"] * d["s"] * _width(d), t),
        AR("backward", T, d["b"] * d["s"] * _width(d), t),
    ),
)
_one_d(
    "attention_block",
    lambda t: {"h": t},
    lambda d, g: (_x(d, g), {**_attn_p(d, g), "norm": norm_p(g, _width(d))}),
    lambda x, p, axis, d: ops.attention_block(
        x, p, axis=axis, num_heads=d["h"], causal=bool(d["causal"])
    ),
    lambda xs, p, d: xs[0] + ref_mha(ref_ln(xs[0], p["norm"]), p, d["h"], bool(d["causal"])),
    lambda d: ops.attention_block_sharding(),
    lambda d, t: total(
        AR("forward", T, d["b"] * d["s"] * _width(d), t),
        AR("backward", T, d["b"] * d["s"] * _width(d), t),
    ),
)

# ---- sequence parallel (Megatron style, over the tensor axis)
_one_d(
    "sp_layer_norm",
    lambda t: {"s": t},
    lambda d, g: (_x(d, g), norm_p(g, _width(d))),
    lambda x, p, axis, d: ops.sp_layer_norm(x, p, axis=axis),
    lambda xs, p, d: ref_ln(xs[0], p),
    lambda d: ops.sp_layer_norm_sharding(),
    lambda d, t: total(AR("backward", T, _width(d), t), AR("backward", T, _width(d), t)),
)
_one_d(
    "sp_column",
    lambda t: {"s": t, "o": t},
    lambda d, g: ((R(g, d["b"], d["s"], d["i"]),), lin_p(g, d["o"], d["i"])),
    lambda x, p, axis, d: ops.sp_column_parallel_linear(x, p, axis=axis),
    lambda xs, p, d: ref_lin(xs[0], p),
    lambda d: ops.sp_column_parallel_sharding(),
    lambda d, t: total(
        AG("forward", T, d["b"] * d["s"] // t * d["i"], t),
        RS("backward", T, d["b"] * d["s"] * d["i"], t),
    ),
)
_one_d(
    "sp_row",
    lambda t: {"s": t, "i": t},
    lambda d, g: ((R(g, d["b"], d["s"], d["i"]),), lin_p(g, d["o"], d["i"])),
    lambda x, p, axis, d: ops.sp_row_parallel_linear(x, p, axis=axis),
    lambda xs, p, d: ref_lin(xs[0], p),
    lambda d: ops.sp_row_parallel_sharding(),
    lambda d, t: total(
        RS("forward", T, d["b"] * d["s"] * d["o"], t),
        AG("backward", T, d["b"] * d["s"] // t * d["o"], t),
        AR("backward", T, d["o"], t),
    ),
)


def _sp_block_traffic(d: dict[str, int], t: int) -> Traffic:
    w, bs = _width(d), d["b"] * d["s"]
    return total(
        AG("forward", T, bs // t * w, t),
        RS("forward", T, bs * w, t),
        RS("backward", T, bs * w, t),
        AG("backward", T, bs // t * w, t),
        AR("backward", T, w, t),  # the row-parallel bias
        AR("backward", T, w, t),  # norm weight
        AR("backward", T, w, t),  # norm bias
    )


_one_d(
    "sp_mlp_block",
    lambda t: {"s": t, "f": t},
    lambda d, g: (_x(d, g), {**_mlp_p(d, g), "norm": norm_p(g, _width(d))}),
    lambda x, p, axis, d: ops.sp_mlp_block(x, p, axis=axis),
    lambda xs, p, d: xs[0] + ref_mlp(ref_ln(xs[0], p["norm"]), p),
    lambda d: ops.sp_mlp_block_sharding(),
    _sp_block_traffic,
)
_one_d(
    "sp_attention_block",
    lambda t: {"s": t, "h": t},
    lambda d, g: (_x(d, g), {**_attn_p(d, g), "norm": norm_p(g, _width(d))}),
    lambda x, p, axis, d: ops.sp_attention_block(
        x, p, axis=axis, num_heads=d["h"], causal=bool(d["causal"])
    ),
    lambda xs, p, d: xs[0] + ref_mha(ref_ln(xs[0], p["norm"]), p, d["h"], bool(d["causal"])),
    lambda d: ops.sp_attention_block_sharding(),
    _sp_block_traffic,
)

# ---- ring attention (sequence mode)
S = "sequence"


def _ring_traffic(d: dict[str, int], t: int) -> Traffic:
    kv = 2 * d["b"] * d["h"] * d["s"] // t * d["e"]
    return total(
        SEND("forward", S, kv, t, t - 1),
        SEND("backward", S, 2 * kv, t, t - 1),  # blocks with their gradient accumulators
        SEND("backward", S, kv, t, 1),  # accumulators home
    )


_one_d(
    "ring_attention",
    lambda t: {"s": t},
    lambda d, g: (tuple(R(g, d["b"], d["h"], d["s"], d["e"]) for _ in range(3)), {}),
    lambda q, k, v, p, axis, d: ops.ring_attention(q, k, v, axis=axis, causal=bool(d["causal"])),
    lambda xs, p, d: ref_sdpa(*xs, bool(d["causal"])),
    lambda d: ops.ring_attention_sharding(),
    _ring_traffic,
    mode="sequence",
    axis=S,
)
_one_d(
    "ring_self_attention",
    lambda t: {"s": t},
    lambda d, g: (_x(d, g), _attn_p(d, g)),
    lambda x, p, axis, d: ops.ring_self_attention(
        x, p, axis=axis, num_heads=d["h"], causal=bool(d["causal"])
    ),
    lambda xs, p, d: ref_mha(xs[0], p, d["h"], bool(d["causal"])),
    lambda d: ops.ring_self_attention_sharding(),
    lambda d, t: total(
        _ring_traffic(d, t),
        *(AR("backward", S, _width(d) ** 2, t) for _ in range(4)),
        *(AR("backward", S, _width(d), t) for _ in range(4)),
    ),
    mode="sequence",
    axis=S,
)


# ------------------------------------------------------------------------------ 2D, 2.5D, 3D
ROW, COL, DEP = "tensor_row", "tensor_col", "tensor_dep"
IN, WT, OUT = "tensor_in", "tensor_wt", "tensor_out"


def _grid_axes(mesh: Mesh, mode: str) -> dict[str, Any]:
    if mode == "2d":
        return {"row": mesh[ROW], "col": mesh[COL]}
    if mode == "2.5d":
        return {"dep": mesh[DEP], "row": mesh[ROW], "col": mesh[COL]}
    return {"in_axis": mesh[IN], "wt_axis": mesh[WT], "out_axis": mesh[OUT]}


def _summa_linear_traffic(
    b: int, s: int, i: int, o: int, q: int, dep: int, *, bias: bool = True
) -> Traffic:
    """SUMMA on a q x q grid (per depth layer), batch b split over dep*q rows."""
    x_loc = b // (dep * q) * s * i // q
    w_loc = i // q * o // q
    out = total(
        BC("forward", COL, x_loc, q, q),
        BC("forward", ROW, w_loc, q, q),
        BC("backward", ROW, w_loc, q, q),
        RED("backward", COL, x_loc, q, q),
        BC("backward", COL, x_loc, q, q),
        RED("backward", ROW, w_loc, q, q),
        AR("backward", DEP, w_loc, dep),
    )
    if bias:
        out = total(out, AR("backward", ROW, o // q, q), AR("backward", DEP, o // q, dep))
    return out


def _summa_norm_traffic(b: int, s: int, w: int, q: int, dep: int) -> Traffic:
    rows = b // (dep * q) * s
    return total(
        AR("forward", COL, rows, q),
        AR("forward", COL, rows, q),
        AR("backward", COL, rows, q),
        AR("backward", COL, rows, q),
        *(AR("backward", ROW, w // q, q) for _ in range(2)),
        *(AR("backward", DEP, w // q, dep) for _ in range(2)),
    )


def _cube_linear_traffic(
    b: int, s: int, i: int, o: int, c: int, *, swap: bool = False, bias: bool = True
) -> Traffic:
    a_in, a_out = (OUT, IN) if swap else (IN, OUT)
    out = total(
        AG("forward", a_in, b // c**2 * s * i // c, c),
        AG("forward", WT, i // c**2 * o // c, c),
        RS("forward", a_out, b // c * s * o // c, c),
        AG("backward", a_out, b // c**2 * s * o // c, c),
        RS("backward", a_in, b // c * s * i // c, c),
        RS("backward", WT, i // c * o // c, c),
    )
    if bias:
        out = total(out, AR("backward", WT, o // c, c), AR("backward", a_out, o // c, c))
    return out


def _cube_norm_traffic(b: int, s: int, w: int, c: int) -> Traffic:
    rows = b // c**2 * s
    return total(
        *(AR(ph, OUT, rows, c) for ph in ("forward", "forward", "backward", "backward")),
        *(AR("backward", ax, w // c, c) for ax in (WT, WT, IN, IN)),
    )


def _grid_sizes(mode: str, sz: dict[str, int]) -> tuple[int, int]:
    """(q or c, depth)."""
    if mode == "3d":
        return sz[IN], 1
    return sz[ROW], sz.get(DEP, 1) if mode == "2.5d" else 1


def _linear_traffic(
    mode: str,
    sz: dict[str, int],
    b: int,
    s: int,
    i: int,
    o: int,
    *,
    swap: bool = False,
    bias: bool = True,
) -> Traffic:
    q, dep = _grid_sizes(mode, sz)
    if mode == "3d":
        return _cube_linear_traffic(b, s, i, o, q, swap=swap, bias=bias)
    return _summa_linear_traffic(b, s, i, o, q, dep, bias=bias)


def _norm_traffic(mode: str, sz: dict[str, int], b: int, s: int, w: int) -> Traffic:
    q, dep = _grid_sizes(mode, sz)
    return _cube_norm_traffic(b, s, w, q) if mode == "3d" else _summa_norm_traffic(b, s, w, q, dep)


def _batch_multiple(mode: str, sz: dict[str, int]) -> int:
    q, dep = _grid_sizes(mode, sz)
    return q * q if mode == "3d" else q * dep


def _wide_multiple(mode: str, sz: dict[str, int]) -> int:
    """What an ``in`` width must divide by (c^2 for 3D weights, q otherwise)."""
    q, _ = _grid_sizes(mode, sz)
    return q * q if mode == "3d" else q


_SUFFIX = {"2d": "2d", "2.5d": "2p5d", "3d": "3d"}


def _register_grid(mode: str) -> None:
    sfx = _SUFFIX[mode]
    lib = summa

    def fn(name: str) -> Callable[..., Any]:
        return getattr(lib, f"{name}_{sfx}")

    def layout(name: str) -> Callable[[dict[str, int]], OpSharding]:
        return lambda d: getattr(lib, f"{name}_{sfx}_sharding")()

    def bm(sz: dict[str, int]) -> int:
        return _batch_multiple(mode, sz)

    def wm(sz: dict[str, int]) -> int:
        return _wide_multiple(mode, sz)

    def q_of(sz: dict[str, int]) -> int:
        return _grid_sizes(mode, sz)[0]

    OPS[f"linear_{sfx}"] = Op(
        mode,
        lambda sz: {"b": bm(sz), "i": wm(sz), "o": q_of(sz)},
        lambda d, g: ((R(g, d["b"], d["s"], d["i"]),), lin_p(g, d["o"], d["i"], io=True)),
        lambda mesh, xs, p, d: fn("linear")(xs[0], p, **_grid_axes(mesh, mode)),
        lambda xs, p, d: ref_lin(xs[0], p, io=True),
        layout("linear"),
        lambda d, sz: _linear_traffic(mode, sz, d["b"], d["s"], d["i"], d["o"]),
    )
    OPS[f"layer_norm_{sfx}"] = Op(
        mode,
        lambda sz: {"b": bm(sz), "w": q_of(sz)},
        lambda d, g: ((R(g, d["b"], d["s"], d["w"]),), norm_p(g, d["w"])),
        lambda mesh, xs, p, d: fn("layer_norm")(xs[0], p, **_grid_axes(mesh, mode)),
        lambda xs, p, d: ref_ln(xs[0], p),
        layout("layer_norm"),
        lambda d, sz: _norm_traffic(mode, sz, d["b"], d["s"], d["w"]),
    )

    def emb_traffic(d: dict[str, int], sz: dict[str, int]) -> Traffic:
        q, dep = _grid_sizes(mode, sz)
        n = d["v"] * d["w"] // q
        if mode == "3d":
            return total(AR("backward", WT, n, q), AR("backward", IN, n, q))
        return total(AR("backward", ROW, n, q), AR("backward", DEP, n, dep))

    OPS[f"embedding_{sfx}"] = Op(
        mode,
        lambda sz: {"b": bm(sz), "w": q_of(sz)},
        lambda d, g: (
            (torch.randint(d["v"], (d["b"], d["s"]), generator=g),),
            {"weight": R(g, d["v"], d["w"])},
        ),
        lambda mesh, xs, p, d: fn("embedding")(xs[0], p, **_grid_axes(mesh, mode)),
        lambda xs, p, d: F.embedding(xs[0], p["weight"]),
        layout("embedding"),
        emb_traffic,
    )

    def cls_traffic(d: dict[str, int], sz: dict[str, int]) -> Traffic:
        q = q_of(sz)
        rows = d["b"] // bm(sz) * d["s"]
        ce_axis = IN if mode == "3d" else COL
        return total(
            _linear_traffic(mode, sz, d["b"], d["s"], d["w"], d["v"], bias=False),
            AR("forward", ce_axis, rows, q),
            AR("forward", ce_axis, 2 * rows, q),
        )

    OPS[f"classifier_loss_{sfx}"] = Op(
        mode,
        lambda sz: {"b": bm(sz), "w": wm(sz), "v": q_of(sz)},
        lambda d, g: (
            (R(g, d["b"], d["s"], d["w"]), torch.randint(d["v"], (d["b"], d["s"]), generator=g)),
            {"weight": R(g, d["w"], d["v"], scale=d["w"] ** -0.5)},
        ),
        lambda mesh, xs, p, d: fn("classifier_loss")(
            xs[0], p, target=xs[1], **_grid_axes(mesh, mode)
        ),
        lambda xs, p, d: ref_ce(xs[0] @ p["weight"], xs[1]),
        layout("classifier_loss"),
        cls_traffic,
    )

    def mlp_traffic(d: dict[str, int], sz: dict[str, int]) -> Traffic:
        b, s, w, f = d["b"], d["s"], _width(d), d["f"]
        return total(
            _norm_traffic(mode, sz, b, s, w),
            _linear_traffic(mode, sz, b, s, w, f),
            _linear_traffic(mode, sz, b, s, f, w, swap=True),
        )

    OPS[f"mlp_block_{sfx}"] = Op(
        mode,
        lambda sz: {"b": bm(sz), "h": wm(sz), "f": wm(sz)},
        lambda d, g: (_x(d, g), {**_mlp_p(d, g, io=True), "norm": norm_p(g, _width(d))}),
        lambda mesh, xs, p, d: fn("mlp_block")(xs[0], p, **_grid_axes(mesh, mode)),
        lambda xs, p, d: xs[0] + ref_mlp(ref_ln(xs[0], p["norm"]), p, io=True),
        layout("mlp_block"),
        mlp_traffic,
    )

    def attn_traffic(d: dict[str, int], sz: dict[str, int]) -> Traffic:
        b, s, w = d["b"], d["s"], _width(d)
        return total(
            _norm_traffic(mode, sz, b, s, w),
            *(_linear_traffic(mode, sz, b, s, w, w) for _ in range(3)),
            _linear_traffic(mode, sz, b, s, w, w, swap=True),
        )

    OPS[f"attention_block_{sfx}"] = Op(
        mode,
        lambda sz: {"b": bm(sz), "h": wm(sz)},
        lambda d, g: (_x(d, g), {**_attn_p(d, g, io=True), "norm": norm_p(g, _width(d))}),
        lambda mesh, xs, p, d: fn("attention_block")(
            xs[0], p, num_heads=d["h"], causal=bool(d["causal"]), **_grid_axes(mesh, mode)
        ),
        lambda xs, p, d: (
            xs[0] + ref_mha(ref_ln(xs[0], p["norm"]), p, d["h"], bool(d["causal"]), io=True)
        ),
        layout("attention_block"),
        attn_traffic,
    )


for _mode in ("2d", "2.5d", "3d"):
    _register_grid(_mode)


# ------------------------------------------------------------------------------ running a case
def _make(op: Op, dims: dict[str, int], seed: int) -> tuple[Inputs, Any, Tensor]:
    g = torch.Generator().manual_seed(seed)
    xs, params = op.make(dims, g)
    with torch.no_grad():
        shape = op.ref(xs, params, dims).shape
    return xs, params, R(g, *shape)


def _grad_layout(layout: Sharding) -> Sharding:
    """The upstream gradient of a partial-sum output is the same on every rank."""
    return Sharding(layout.dims)


def _leaf(t: Tensor) -> Tensor:
    return t.requires_grad_(True) if t.is_floating_point() else t


def _summary(records: Sequence[Any]) -> dict[tuple[str, str, str], float]:
    out: dict[tuple[str, str, str], float] = {}
    for r in records:
        key = (r.kind, r.phase, r.axis)
        out[key] = out.get(key, 0.0) + r.volume
    return out


def run_op_cases(rank: int, cases: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """On every rank: run each case's op forward and backward on this rank's shards."""
    results = []
    for case in cases:
        op = OPS[case["op"]]
        mesh = mesh_for(case["config"])
        xs, params, g_full = _make(op, case["dims"], case["seed"])
        lay = op.layout(case["dims"])
        local_xs = tuple(_leaf(x) for x in lay.shard_inputs(xs, mesh.place))
        local_p = tree_map(_leaf, lay.shard_params(params, mesh.place))
        with count_bytes() as counter:
            out = op.run(mesh, local_xs, local_p, case["dims"])
            out.backward(_grad_layout(lay.output).shard(g_full, mesh.place))
        results.append(
            {
                "out": out.detach(),
                "in_grads": [x.grad if x.is_floating_point() else None for x in local_xs],
                "param_grads": tree_map(lambda t: t.grad, local_p),
                "traffic": _summary(counter.records),
            }
        )
    return results


def reference(op: Op, case: dict[str, Any]) -> tuple[Tensor, list[Tensor | None], Any]:
    """Single-device output and gradients (plain torch)."""
    xs, params, g_full = _make(op, case["dims"], case["seed"])
    xs = tuple(_leaf(x.clone()) for x in xs)
    params = tree_map(lambda t: t.clone().requires_grad_(True), params)
    out = op.ref(xs, params, case["dims"])
    out.backward(g_full)
    return (
        out.detach(),
        [x.grad if x.is_floating_point() else None for x in xs],
        tree_map(lambda t: t.grad, params),
    )


def check_op_case(case: dict[str, Any], per_rank: Sequence[dict[str, Any]], world: int) -> None:
    """Compare every rank's output, input grads and param grads with the reference shards, the
    gathered tensors with the full reference, and every rank's traffic with the closed form."""
    op = OPS[case["op"]]
    config = ParallelConfig.from_dict(case["config"], world_size=world)
    places = config.places()
    lay = op.layout(case["dims"])
    out, in_grads, p_grads = reference(op, case)
    expected = {k: v for k, v in op.traffic(case["dims"], config.axis_sizes).items() if v}
    for r, res in enumerate(per_rank):
        where = f"{case} rank {r}"
        assert_trees_close(res["out"], lay.output.shard(out, places[r]), msg=f"{where} output")
        for k, (got, ref) in enumerate(zip(res["in_grads"], in_grads, strict=True)):
            if ref is not None:
                assert_trees_close(got, lay.inputs[k].shard(ref, places[r]), msg=f"{where} d_in{k}")
        assert_trees_close(
            res["param_grads"], lay.shard_params(p_grads, places[r]), msg=f"{where} d_params"
        )
        got = {k: v for k, v in res["traffic"].items() if v}
        assert set(got) == set(expected), f"{where}: traffic {got} != closed form {expected}"
        for key, v in expected.items():
            assert math.isclose(got[key], v, rel_tol=1e-12), (
                f"{where}: {key} moved {got[key]} bytes, closed form {v}"
            )
    assert_trees_close(lay.output.gather([r["out"] for r in per_rank], places), out, msg="gathered")
    assert_trees_close(
        lay.gather_params([r["param_grads"] for r in per_rank], places), p_grads, msg="gathered"
    )
    for k, ref in enumerate(in_grads):
        if ref is not None:
            got = lay.inputs[k].gather([r["in_grads"][k] for r in per_rank], places)
            assert_trees_close(got, ref, msg=f"gathered d_in{k}")


def leaves_count(tree: Any) -> int:
    return len(tree_leaves(tree))


# ------------------------------------------------------------------------------ mesh job
def mesh_info(rank: int, configs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per config: every axis's size, this rank's coordinate and the global ranks of its group."""
    import torch.distributed as dist

    out = []
    for config in configs:
        mesh = mesh_for(config)
        out.append(
            {
                name: (ax.size, ax.coord, sorted(dist.get_process_group_ranks(ax.group)))
                for name, ax in mesh.items()
            }
        )
    return out


# ------------------------------------------------------------------------------ collective pairs
# pair -> (kind of its input, kind of its output): "R" replicated over the axis, "V" varying
PAIR_KINDS = {
    "copy_to_group": ("R", "V"),
    "reduce_from_group": ("V", "R"),
    "all_reduce": ("V", "V"),
    "all_gather": ("V", "V"),
    "reduce_scatter": ("V", "V"),
    "split_to_group": ("R", "V"),
    "gather_from_group": ("V", "R"),
    "broadcast": ("V", "V"),
    "reduce_to": ("V", "V"),
    "ring_shift": ("V", "V"),
    "split_then_gather": ("R", "R"),
}


def apply_pair(name: str, x: Tensor, axis: Any, dim: int, arg: int) -> Tensor:
    from funcpipe.parallel import collectives as C

    if name == "copy_to_group":
        return C.copy_to_group(x, axis)
    if name == "reduce_from_group":
        return C.reduce_from_group(x, axis)
    if name == "all_reduce":
        return C.all_reduce(x, axis)
    if name == "all_gather":
        return C.all_gather(x, axis, dim=dim)
    if name == "reduce_scatter":
        return C.reduce_scatter(x, axis, dim=dim)
    if name == "split_to_group":
        return C.split_to_group(x, axis, dim=dim)
    if name == "gather_from_group":
        return C.gather_from_group(x, axis, dim=dim)
    if name == "broadcast":
        return C.broadcast(x, axis, src=arg % axis.size)
    if name == "reduce_to":
        return C.reduce_to(x, axis, dst=arg % axis.size)
    if name == "ring_shift":
        return C.ring_shift(x, axis, offset=arg)
    if name == "split_then_gather":
        return C.gather_from_group(C.split_to_group(x, axis, dim=dim), axis, dim=dim)
    raise KeyError(name)


def pair_tensor(seed: int, tag: int, kind: str, rank: int, shape: Sequence[int]) -> Tensor:
    """Replicated tensors are equal on every rank; varying ones differ by rank."""
    g = torch.Generator().manual_seed(seed * 1009 + tag * 101 + (rank + 1 if kind == "V" else 0))
    return R(g, *shape)


def run_pair_cases(rank: int, cases: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from funcpipe.parallel import collectives as C

    out = []
    for case in cases:
        mesh = mesh_for(case["config"])
        axis = mesh[case["axis"]]
        kin, kout = PAIR_KINDS[case["pair"]]
        x = pair_tensor(case["seed"], 0, kin, rank, case["shape"])
        x_before = x.clone()
        x.requires_grad_(True)
        backend = str(dist.get_backend(axis.group))
        if case.get("fallback"):
            C._NATIVE_REDUCE_SCATTER[backend] = False
        try:
            with count_bytes() as counter:
                y = apply_pair(case["pair"], x, axis, case["dim"], case["arg"])
                gy = pair_tensor(case["seed"], 1, kout, rank, y.shape)
                gy_before = gy.clone()
                y.backward(gy)
        finally:
            C._NATIVE_REDUCE_SCATTER.pop(backend, None)
        out.append(
            {
                "y": y.detach(),
                "fwd": float((y.detach() * gy).sum()),
                "bwd": float((x_before * x.grad).sum()),
                "mutated": not (torch.equal(x.detach(), x_before) and torch.equal(gy, gy_before)),
                "traffic": _summary(counter.records),
                "algorithms": sorted({r.algorithm for r in counter.records}),
                "total": counter.total,
                "payload": counter.payload,
            }
        )
    return out


# ------------------------------------------------------------------------------ sharding specs
def spec_of(case: dict[str, Any]) -> Any:
    return shard_spec(
        case["pattern"],
        case["axes"],
        reduce=case.get("reduce"),
        scatter=case.get("scatter"),
        in_shards={int(k): v for k, v in case.get("in_shards", {}).items()},
        gather_output=case.get("gather_output", False),
    )


def _operands(pattern: str) -> tuple[list[list[list[str]]], list[list[str]]]:
    """Groups of axis names per operand: 'a (b c)' -> [['a'], ['b', 'c']]."""
    import re

    def parse(text: str) -> list[list[str]]:
        return [g.strip("()").split() for g in re.findall(r"\([^)]*\)|\S+", text.strip())]

    lhs, rhs = pattern.split("->")
    return [parse(t) for t in lhs.split(",")], parse(rhs)


def spec_full(case: dict[str, Any]) -> tuple[list[Tensor], Tensor, tuple[int, ...]]:
    """Full inputs, the full upstream gradient and the full output shape of a spec case."""
    sizes = case["sizes"]
    ins, out = _operands(case["pattern"])
    g = torch.Generator().manual_seed(case["seed"])
    xs = [R(g, *[math.prod(sizes[a] for a in grp) for grp in op]) for op in ins]
    shape = tuple(math.prod(sizes[a] for a in grp) for grp in out)
    return xs, R(g, *shape), shape


def spec_reference(case: dict[str, Any], xs: Sequence[Tensor]) -> Tensor:
    """einops.einsum over the ungrouped axes (an independent path from the spec's)."""
    import einops

    sizes = case["sizes"]
    ins, out = _operands(case["pattern"])

    def text(op: list[list[str]], grouped: bool) -> str:
        return " ".join(
            ("(" + " ".join(grp) + ")") if grouped and len(grp) > 1 else " ".join(grp) for grp in op
        )

    flat = [
        einops.rearrange(
            x, f"{text(op, True)} -> {text(op, False)}", **{a: sizes[a] for grp in op for a in grp}
        )
        for x, op in zip(xs, ins, strict=True)
    ]
    y = einops.einsum(*flat, ", ".join(text(op, False) for op in ins) + " -> " + text(out, False))
    return einops.rearrange(y, f"{text(out, False)} -> {text(out, True)}")


def _group_sizes(case: dict[str, Any]) -> dict[str, int]:
    ins, out = _operands(case["pattern"])
    return {a: case["sizes"][a] for op in [*ins, out] for grp in op if len(grp) > 1 for a in grp}


def run_spec_cases(rank: int, cases: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for case in cases:
        mesh = mesh_for(case["config"])
        spec = spec_of(case)
        xs, g_full, _ = spec_full(case)
        local = [
            spec.input_sharding(i).shard(x, mesh.place).requires_grad_(True)
            for i, x in enumerate(xs)
        ]
        with count_bytes() as counter:
            y = spec(*local, mesh=mesh, **_group_sizes(case))
            y.backward(_grad_layout(spec.output_sharding).shard(g_full, mesh.place))
        out.append(
            {
                "out": y.detach(),
                "grads": [x.grad for x in local],
                "traffic": _summary(counter.records),
            }
        )
    return out


def check_spec_case(case: dict[str, Any], per_rank: Sequence[dict[str, Any]], world: int) -> None:
    spec = spec_of(case)
    places = ParallelConfig.from_dict(case["config"], world_size=world).places()
    xs, g_full, _ = spec_full(case)
    xs = [x.clone().requires_grad_(True) for x in xs]
    ref = spec_reference(case, xs)
    ref.backward(g_full)
    lay = spec.output_sharding
    where = f"{case} ({spec!r})"
    assert_trees_close(
        lay.gather([r["out"] for r in per_rank], places), ref.detach(), msg=f"{where} output"
    )
    for r, res in enumerate(per_rank):
        if not lay.partial:
            assert_trees_close(
                res["out"], lay.shard(ref.detach(), places[r]), msg=f"{where} rank {r}"
            )
        for i, x in enumerate(xs):
            want = spec.input_sharding(i).shard(x.grad, places[r])
            assert_trees_close(res["grads"][i], want, msg=f"{where} rank {r} d_in{i}")


def mesh_api(rank: int, config: dict[str, Any]) -> dict[str, Any]:
    """The Mapping interface of a Mesh, its repr and its error for an unknown axis."""
    from funcpipe.errors import InvalidArgument

    mesh = mesh_for(config)
    try:
        mesh["tensor_row"]
        error = ""
    except InvalidArgument as e:
        error = str(e)
    try:
        build_mesh(ParallelConfig.from_dict(config, world_size=2 * mesh.config.world_size))
        mismatch = ""
    except InvalidArgument as e:
        mismatch = str(e)
    return {
        "repr": repr(mesh),
        "axes": list(mesh),
        "len": len(mesh),
        "error": error,
        "mismatch": mismatch,
    }
