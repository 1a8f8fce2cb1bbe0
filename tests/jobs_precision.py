"""Stages as people write them for speed (autocast, bf16 parameters, torch.compile) against
``reference_step`` of the same stages; importable by pool workers."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import funcpipe as fp
from funcpipe.schedule.generators import generate
from funcpipe.testing import assert_trees_close

D = 8

# mode -> (parameter dtype, rtol, atol) against reference_step of the same stages:
#   compile: float64, aot_eager: the same kernels as eager; only the order of the microbatch
#     sums can differ (the issue asks 1e-10)
#   autocast: float32 parameters, bf16 matmuls on CPU; both sides run the same bf16 kernels per
#     microbatch, the float32 gradient sums differ in order only
#   inductor: the default backend, float32: generated C++ kernels round differently from eager
#   bf16: bf16 parameters and activations; the gradient sums are rounded to bf16 after every
#     microbatch in an order that differs from the reference's (bf16 has 8 bits of mantissa)
MODES: dict[str, tuple[torch.dtype, float, float]] = {
    "compile": (torch.float64, 1e-10, 1e-10),
    "inductor": (torch.float32, 1e-5, 1e-5),
    "autocast": (torch.float32, 1e-5, 1e-6),
    "bf16": (torch.bfloat16, 2e-2, 1e-2),
}


def layer(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A linear layer and a scaled tanh: under bf16 autocast its output (what crosses stages)
    is bf16; compiled, its backward keeps an intermediate (the tanh), which AOTAutograd may
    donate to the backward."""
    return torch.tanh(F.linear(x, params["w"], params["b"])) * 1.5


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error, in float32 for low-precision outputs (as losses are computed)."""
    if out.dtype in (torch.bfloat16, torch.float16):
        out, y = out.float(), y.float()
    return ((out - y) ** 2).mean()


_COMPILED: dict[tuple[int, str], fp.Stage] = {}


def stages(n: int, mode: str, backend: str = "aot_eager") -> list[fp.Stage]:
    """``n`` stages; compiled ones are made once per process and index, so every schedule of a
    test session reuses their graphs (the shapes are the same)."""
    out = []
    for k in range(n):
        plain = fp.Stage(layer, name=f"layer{k}")
        if mode == "autocast":
            out.append(fp.autocast_stage(plain, torch.bfloat16))
        elif mode in ("compile", "inductor"):
            key = (k, "inductor" if mode == "inductor" else backend)
            if key not in _COMPILED:
                options = {} if mode == "inductor" else {"backend": backend}
                _COMPILED[key] = fp.compile_stage(plain, **options)
            out.append(_COMPILED[key])
        else:
            out.append(plain)
    return out


def params(n: int, dtype: torch.dtype, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "w": (torch.randn(D, D, generator=g, dtype=torch.float64) / D**0.5).to(dtype),
            "b": (torch.randn(D, generator=g, dtype=torch.float64) * 0.1).to(dtype),
        }
        for _ in range(n)
    ]


def batch(size: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, D, generator=g, dtype=torch.float64).to(dtype)
    y = torch.randn(size, D, generator=g, dtype=torch.float64).to(dtype)
    return x, y


def vs_reference(
    rank: int,
    name: str,
    mode: str,
    *,
    ranks: int = 2,
    microbatches: int = 4,
    recompute: bool = False,
    steps: int = 2,
    backend: str = "aot_eager",
    overlap: bool = False,
) -> dict[str, Any]:
    """Steps of ``name`` in ``mode`` against ``reference_step``; returns the largest loss and
    gradient differences and the dtypes that crossed stages. In a pool of processes this is
    one rank over gloo, else every rank in this process."""
    dtype, rtol, atol = MODES[mode]
    program = generate(name, ranks=ranks, microbatches=microbatches, overlap=overlap)
    n = len(set(program.replica_of)) if program.replica_of else program.n_stages
    st, ps = stages(n, mode, backend), params(n, dtype)
    pipe = fp.Pipeline(st, program, loss_fn=mse, recompute=recompute)
    worst = 0.0
    for step in range(steps):
        x, y = batch(4 * microbatches + step, dtype, seed=step + 1)  # uneven in the 2nd step
        loss, grads = pipe.step(ps, x, y)
        # the reference runs the stages uncompiled: compiled against eager
        ref = [fp.Stage(layer, name=f"layer{k}") for k in range(n)] if mode == "inductor" else st
        ref_loss, ref_grads = fp.reference_step(
            ref, ps, x, mse, targets=y, microbatches=microbatches
        )
        # over processes the loss is summed in float64, in one process in its own dtype
        assert_trees_close(loss.double(), ref_loss.double(), rtol=rtol, atol=atol)
        mine = tuple(g if g is not None else r for g, r in zip(grads, ref_grads, strict=True))
        assert_trees_close(mine, ref_grads, rtol=rtol, atol=atol)
        for g, r in zip(mine, ref_grads, strict=True):
            for k in g:
                assert g[k].dtype == r[k].dtype == dtype, (k, g[k].dtype, r[k].dtype)
                worst = max(worst, float((g[k].double() - r[k].double()).abs().max()))
    crossing = sorted(
        {
            str(leaf.dtype)
            for layout in pipe._layouts.values()
            for spec in layout.values()
            for leaf in spec.leaves
        }
    )
    return {"worst": worst, "crossing": crossing}
