"""What a GPT block costs the host: ATen ops, casts and Python calls per block (forward +
backward), and the bytes its non-matmul ops move, beside an independent nanoGPT-style block.

A GPU step of a small or mid-sized transformer is host-bound when it dispatches more ops than it
must (about 15 us of host time per ATen op on an H100 host, 2026-11). A ``TorchDispatchMode`` on
the CPU sees every op the GPU profiler lists, so op counts are measured here without a GPU:

- **ops / casts / python calls per block**: one block (attention + MLP, pre-norm residuals),
  forward and backward, at a tiny width on the CPU, for funcpipe's GPT block
  (``funcpipe.parallel.ops.attention_block`` + ``mlp_block`` at tensor size 1) and for
  :class:`NanoBlock` below (``nn.Linear``-style fused qkv, ``F.scaled_dot_product_attention``),
  written here independently of funcpipe, in the same precision;
- **non-matmul bytes per block per microbatch**: the same block at the demo's real shapes
  (``--size large``: width 1024, 16 heads, 4 sequences of 1024 tokens) on fake tensors (no
  memory, no compute): the bytes read and written by every op that is not a matmul or the fused
  attention kernel: norms, casts, adds, GELU, copies;
- **ops per Pipeline.step**: the demo's model (its size's layers and microbatches, tiny width) as
  one stage of a one-rank Pipeline, as the demo runs it.

Precisions: ``fp32-autocast`` (float32 parameters under bf16 autocast: the demo's CUDA default),
``bf16`` (bfloat16 parameters), ``fp32``. On the CPU, autocast is CPU autocast: its list of ops
that run in bf16 is CUDA's for the matmuls these blocks use. Run::

    python benchmarks/dispatch.py [--json out.json]

Op counts are deterministic: tests/test_dispatch.py pins them as a ceiling (a ratchet).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import funcpipe as fp
from funcpipe.models import gpt
from funcpipe.parallel import ops
from funcpipe.schedule import generate
from funcpipe.tree import tree_leaves

MATMUL = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_addmm_activation"}
"""Ops whose time is the tensor cores' (their bytes are not counted as non-matmul traffic)."""
ATTENTION = ("_scaled_dot_product", "_flash_attention", "_efficient_attention")
"""Prefixes of the fused attention kernels (both blocks call the same one)."""
CASTS = {"_to_copy", "to", "_to_dtype", "type_as"}
FREE = {
    "view", "_unsafe_view", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze",
    "split", "split_with_sizes", "select", "slice", "detach", "alias", "as_strided",
    "_reshape_alias", "reshape", "unbind", "chunk", "narrow", "view_as", "_has_compatible_shallow_copy_type",
}  # fmt: skip
"""Ops that move no data (views): dispatched, so counted as ops, but no bytes."""
FAKE_ONLY = {"device"}
"""Metadata queries fake tensors dispatch (``prim.device``) that a real run never does."""

PRECISIONS = ("fp32-autocast", "bf16", "fp32")


@dataclass
class Count:
    """What one run dispatched."""

    ops: int = 0
    casts: int = 0
    collectives: int = 0  # torch.distributed's ops (namespace c10d): all-reduce, all-gather...
    nonmatmul_bytes: int = 0
    by_op: Counter[str] = field(default_factory=Counter)


class OpCounter(TorchDispatchMode):
    """Counts every ATen op dispatched inside it (forward and backward, on this thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = Count()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in FAKE_ONLY:
            return out
        c = self.count
        c.ops += 1
        c.by_op[name] += 1
        if func.namespace == "c10d":
            c.collectives += 1
        if name in CASTS:
            c.casts += 1
        if name not in MATMUL and name not in FREE and not name.startswith(ATTENTION):
            c.nonmatmul_bytes += _bytes(args) + _bytes(kwargs) + _bytes(out)
        return out


def _bytes(tree: Any) -> int:
    return sum(
        t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)
    )


def python_calls(fn: Callable[[], Any]) -> int:
    """Python function calls made while running ``fn`` (this thread; C calls not counted)."""
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


# ------------------------------------------------------------------------------ the two blocks
class NanoBlock(nn.Module):
    """A nanoGPT-style pre-norm block, written without funcpipe: ``nn.Linear`` layers, one fused
    qkv projection, ``F.scaled_dot_product_attention`` (causal), exact GELU."""

    def __init__(self, d: int, heads: int, mlp: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d, dtype=dtype)
        self.c_attn = nn.Linear(d, 3 * d, dtype=dtype)
        self.c_proj = nn.Linear(d, d, dtype=dtype)
        self.ln_2 = nn.LayerNorm(d, dtype=dtype)
        self.c_fc = nn.Linear(d, mlp, dtype=dtype)
        self.c_proj2 = nn.Linear(mlp, d, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, s, d))
        return x + self.c_proj2(F.gelu(self.c_fc(self.ln_2(x))))


@dataclass(frozen=True)
class Shape:
    batch: int
    seq: int
    d_model: int
    heads: int


TINY = Shape(batch=2, seq=16, d_model=64, heads=4)
LARGE = Shape(batch=4, seq=1024, d_model=1024, heads=16)  # the demo's --size large microbatch


def _funcpipe_block(
    shape: Shape, dtype: torch.dtype
) -> tuple[Callable[[Tensor], Tensor], list[Tensor]]:
    cfg = gpt.GPTConfig(
        vocab=256, context=shape.seq, d_model=shape.d_model, heads=shape.heads, layers=1
    )
    block = gpt.init(cfg, seed=0)["blocks"][0]
    block = fp.tree.tree_map(lambda t: t.to(dtype).requires_grad_(), block)
    axis = gpt.single_axis()

    def fn(x: Tensor) -> Tensor:
        h = ops.attention_block(x, block["attn"], axis=axis, num_heads=shape.heads, causal=True)
        return ops.mlp_block(h, block["mlp"], axis=axis)

    return fn, tree_leaves(block)


def _nano_block(
    shape: Shape, dtype: torch.dtype
) -> tuple[Callable[[Tensor], Tensor], list[Tensor]]:
    torch.manual_seed(0)
    module = NanoBlock(shape.d_model, shape.heads, 4 * shape.d_model, dtype)
    return module, list(module.parameters())


BLOCKS = {"funcpipe": _funcpipe_block, "nanogpt": _nano_block}


@contextlib.contextmanager
def _precision(precision: str) -> Iterator[None]:
    if precision == "fp32-autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    else:
        yield


def _param_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16" else torch.float32


def block_step(which: str, shape: Shape, precision: str) -> Callable[[], None]:
    """One forward and backward of one block (gradients of the input and every parameter)."""
    dtype = _param_dtype(precision)
    fn, _ = BLOCKS[which](shape, dtype)
    x = torch.randn(shape.batch, shape.seq, shape.d_model, dtype=dtype, requires_grad=True)

    def step() -> None:
        with _precision(precision):
            y = fn(x)
        torch.autograd.backward(y, torch.ones_like(y))

    return step


def count_block(which: str, shape: Shape, precision: str, *, fake: bool = False) -> Count:
    """ATen ops of one block's forward + backward (on fake tensors with ``fake=True``)."""
    with FakeTensorMode() if fake else contextlib.nullcontext():
        step = block_step(which, shape, precision)
        step()  # warm: first-call work (lazy inits) is not the steady state
        with OpCounter() as counter:
            step()
    return counter.count


def block_table(precisions: tuple[str, ...] = PRECISIONS) -> list[dict[str, Any]]:
    """Per precision and block: ops, casts, Python calls (tiny width) and non-matmul bytes
    (the demo's large shapes, fake tensors)."""
    rows = []
    for precision in precisions:
        for which in BLOCKS:
            tiny = count_block(which, TINY, precision)
            large = count_block(which, LARGE, precision, fake=True)
            step = block_step(which, TINY, precision)
            step()
            rows.append(
                {
                    "precision": precision,
                    "block": which,
                    "ops": tiny.ops,
                    "casts": tiny.casts,
                    "python_calls": python_calls(step),
                    "nonmatmul_bytes_large": large.nonmatmul_bytes,
                    "by_op": dict(tiny.by_op.most_common()),
                }
            )
    return rows


# ------------------------------------------------------------------------ mixture of experts
MOE = {"d_model": 32, "experts": 8, "ffn": 32, "top_k": 2, "batch": 2, "seq": 16}
"""The MoE blocks' tiny shape (float32: the grouped matmul runs, as it would in bf16 on a GPU)."""


class PlainMoE(nn.Module):
    """An MoE feed-forward block written here in plain PyTorch, independently of funcpipe: a
    linear router, softmax, top-k normalised, tokens sorted by expert, one grouped matmul in and
    one out (SwiGLU), scattered back; no auxiliary losses."""

    def __init__(self, d: int, experts: int, ffn: int, top_k: int) -> None:
        super().__init__()
        self.k, self.experts = top_k, experts
        self.gate = nn.Linear(d, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, d, 2 * ffn) / d**0.5)
        self.w_out = nn.Parameter(torch.randn(experts, ffn, d) / ffn**0.5)

    def forward(self, x: Tensor) -> Tensor:
        t = x.reshape(-1, x.shape[-1])
        w, idx = self.gate(t).softmax(-1).topk(self.k, -1)
        w = w / w.sum(-1, keepdim=True)
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        tok = order // self.k
        offs = torch.bincount(flat, minlength=self.experts).cumsum(0).to(torch.int32)
        g, u = F.grouped_mm(t[tok], self.w_in, offs=offs).chunk(2, -1)
        o = F.grouped_mm(F.silu(g) * u, self.w_out, offs=offs) * w.flatten()[order].unsqueeze(-1)
        return torch.zeros_like(t).index_add(0, tok, o).reshape(x.shape)


def _against_plain(
    shape: dict[str, Any], funcpipe_step: Callable[[], None], plain: nn.Module, x: Tensor
) -> dict[str, Any]:
    """ATen ops of one warm forward + backward of each: funcpipe's step and the plain module
    on ``x`` (its output's gradient all ones), and their ratio."""

    def plain_step() -> None:
        y = plain(x)
        y.backward(torch.ones_like(y))

    out: dict[str, Any] = {"shape": shape}
    for name, step in (("funcpipe", funcpipe_step), ("plain", plain_step)):
        step()
        with OpCounter() as counter:
            step()
        out[name] = {"ops": counter.count.ops, "by_op": dict(counter.count.by_op.most_common())}
    out["ratio"] = out["funcpipe"]["ops"] / out["plain"]["ops"]
    return out


def count_moe_blocks() -> dict[str, Any]:
    """ATen ops of one forward + backward of funcpipe's MoE layer (with its auxiliary and z
    losses computed) and of :class:`PlainMoE`, float32, at :data:`MOE`."""
    from funcpipe.models import moe

    m = MOE
    x = torch.randn(m["batch"], m["seq"], m["d_model"], requires_grad=True)
    config = moe.MoEConfig(
        d_model=m["d_model"], experts=m["experts"], ffn=m["ffn"], top_k=m["top_k"]
    )
    params = {k: v.requires_grad_(True) for k, v in moe.init(config).items()}
    plain = PlainMoE(m["d_model"], m["experts"], m["ffn"], m["top_k"])

    def funcpipe_step() -> None:
        y = moe.moe(params, x, config)[0]
        y.backward(torch.ones_like(y))

    return _against_plain(dict(m), funcpipe_step, plain, x)


class PlainMoEBlock(nn.Module):
    """A pre-norm transformer block with :class:`PlainMoE` in the MLP's place: the attention
    half of :class:`NanoBlock`, written here in plain PyTorch (no auxiliary losses)."""

    def __init__(self, d: int, heads: int, experts: int, ffn: int, top_k: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.moe = PlainMoE(d, experts, ffn, top_k)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, s, d))
        return x + self.moe(self.ln_2(x))


def count_gpt_moe_blocks() -> dict[str, Any]:
    """ATen ops of one forward + backward of the GPT's MoE block (attention, then the pre-norm
    MoE layer with its auxiliary loss, its counts tallied as in a step) and of
    :class:`PlainMoEBlock`, float32, at :data:`MOE` with 4 heads."""
    from funcpipe.stages.tally import collecting

    m = MOE
    cfg = gpt.GPTConfig(
        vocab=256, context=m["seq"], d_model=m["d_model"], heads=4, layers=1,
        experts=m["experts"], top_k=m["top_k"], expert_ffn=m["ffn"],
    )  # fmt: skip
    block = fp.tree.tree_map(lambda t: t.requires_grad_(), gpt.init(cfg, seed=0)["blocks"][0])
    plain = PlainMoEBlock(m["d_model"], 4, m["experts"], m["ffn"], m["top_k"])
    x = torch.randn(m["batch"], m["seq"], m["d_model"], requires_grad=True)
    axis = gpt.single_axis()

    def funcpipe_step() -> None:
        with collecting({}):
            h = ops.attention_block(x, block["attn"], axis=axis, num_heads=4, causal=True)
            y, stats = gpt._moe_block(h, block["moe"], cfg.moe_config, None, 0.0, None, None)
            fp.stages.tally.tally("counts", stats["counts"])
        (y.sum() + 0.01 * stats["aux"]).backward()

    return _against_plain({**m, "heads": 4}, funcpipe_step, plain, x)


# ------------------------------------------------------------------------ tensor parallel
def count_block_tensor_parallel(rank: int, tensor: int, precision: str = "fp32") -> dict[str, Any]:
    """One rank's ATen ops for one block (forward + backward) at ``tensor`` ranks, in a process
    group of ``tensor`` processes (a pool job: call on every rank): total, collectives, and the
    ops other than collectives, to compare with the block at tensor size 1."""
    from funcpipe.parallel import build_mesh
    from funcpipe.parallel.sharding import shard_tree

    mesh = build_mesh({"tensor": tensor})
    axis = mesh["tensor"]
    shape = Shape(batch=2, seq=8, d_model=16 * tensor, heads=2 * tensor)
    cfg = gpt.GPTConfig(
        vocab=256, context=shape.seq, d_model=shape.d_model, heads=shape.heads, layers=1
    )
    dtype = _param_dtype(precision)
    full = gpt.init(cfg, seed=0, dtype=dtype)["blocks"][0]
    sharding = {
        "attn": ops.attention_block_sharding(fused_qkv=True).params,
        "mlp": ops.mlp_block_sharding().params,
    }
    block = fp.tree.tree_map(lambda t: t.requires_grad_(), shard_tree(full, sharding, mesh.place))
    x = torch.randn(shape.batch, shape.seq, shape.d_model, dtype=dtype, requires_grad=True)

    def step() -> None:
        with _precision(precision):
            h = ops.attention_block(x, block["attn"], axis=axis, num_heads=shape.heads, causal=True)
            y = ops.mlp_block(h, block["mlp"], axis=axis)
        torch.autograd.backward(y, torch.ones_like(y))

    step()
    with OpCounter() as counter:
        step()
    c = counter.count
    return {
        "rank": rank,
        "tensor": tensor,
        "ops": c.ops,
        "collectives": c.collectives,
        "by_op": dict(c.by_op),
    }


# ------------------------------------------------------------------------- a Pipeline step
def count_pipeline_step(
    size: str = "large", precision: str = "fp32-autocast", *, microbatches: int = 0, layers: int = 0
) -> dict[str, Any]:
    """ATen ops of one ``Pipeline.step`` of the demo's model at ``size``'s layers and
    microbatches (tiny width), one rank, tensor size 1; ``bf16``: bf16 parameters whose
    gradients are summed in float32 (``grad_dtype``), as the demo runs on CUDA. ``microbatches``
    and ``layers`` override the size's."""
    from funcpipe.cli.demo import SIZES

    s = SIZES[size]
    s = s._replace(microbatches=microbatches or s.microbatches, layers=layers or s.layers)
    cfg = gpt.GPTConfig(
        vocab=256, context=TINY.seq, d_model=TINY.d_model, heads=TINY.heads, layers=s.layers
    )
    dtype = _param_dtype(precision)
    params = fp.tree.tree_map(lambda t: t.to(dtype), gpt.split(gpt.init(cfg, seed=0), cfg, 1))
    axis = gpt.single_axis()
    stage = gpt.stages(cfg, 1, axis=axis)[0]
    if precision == "fp32-autocast":
        stage = fp.autocast_stage(stage, torch.bfloat16)
    pipe = fp.Pipeline(
        [stage],
        generate("1f1b", ranks=1, microbatches=s.microbatches),
        loss_fn=gpt.loss_fn(axis=axis),
        grad_dtype=torch.float32 if precision == "bf16" else None,  # bf16: float32 sums
    )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, cfg.vocab, (s.microbatches * TINY.batch, cfg.context + 1), generator=g
    )
    x, y = tokens[:, :-1], tokens[:, 1:]
    pipe.step(params, x, y)  # first step: shape inference, checks
    with OpCounter() as counter:
        pipe.step(params, x, y)
    calls = python_calls(lambda: pipe.step(params, x, y))
    return {
        "size": size,
        "precision": precision,
        "layers": s.layers,
        "microbatches": s.microbatches,
        "ops": counter.count.ops,
        "casts": counter.count.casts,
        "python_calls": calls,
        "ops_per_block_per_microbatch": counter.count.ops / (s.layers * s.microbatches),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="", help="write the results here too")
    ap.add_argument("--by-op", action="store_true", help="print each block's ops by name")
    o = ap.parse_args(argv)
    torch.set_num_threads(1)
    blocks = block_table()
    print("| precision | block | ATen ops | casts | Python calls | non-matmul MB (large) |")
    print("|---|---|---:|---:|---:|---:|")
    for r in blocks:
        print(
            f"| {r['precision']} | {r['block']} | {r['ops']} | {r['casts']} | "
            f"{r['python_calls']} | {r['nonmatmul_bytes_large'] / 1e6:.0f} |"
        )
    for precision in PRECISIONS:
        f, n = (
            next(r for r in blocks if r["precision"] == precision and r["block"] == b)
            for b in BLOCKS
        )
        print(
            f"{precision}: funcpipe / nanogpt = {f['ops'] / n['ops']:.2f}x ops, "
            f"{f['nonmatmul_bytes_large'] / n['nonmatmul_bytes_large']:.2f}x non-matmul bytes"
        )
    steps = [count_pipeline_step(precision=p) for p in ("fp32-autocast", "bf16")]
    for step in steps:
        print(
            f"Pipeline.step, demo large ({step['layers']} layers x {step['microbatches']} "
            f"microbatches, tiny width, {step['precision']}): {step['ops']} ATen ops, "
            f"{step['casts']} casts, {step['python_calls']} Python calls "
            f"({step['ops_per_block_per_microbatch']:.0f} ops per block per microbatch)"
        )
    moe_blocks = count_moe_blocks()
    print(
        f"MoE block (float32, {MOE['experts']} experts, top {MOE['top_k']}): funcpipe "
        f"{moe_blocks['funcpipe']['ops']} ATen ops (auxiliary and z losses included), plain "
        f"PyTorch {moe_blocks['plain']['ops']}: {moe_blocks['ratio']:.2f}x"
    )
    if o.by_op:
        for r in blocks:
            print(r["precision"], r["block"], r["by_op"])
    if o.json:
        with open(o.json, "w") as f:
            json.dump(
                {
                    "blocks": blocks,
                    "pipeline_steps": steps,
                    "moe_blocks": moe_blocks,
                    "shapes": [asdict(TINY), asdict(LARGE)],
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
