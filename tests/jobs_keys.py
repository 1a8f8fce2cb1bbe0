"""Pool jobs for tests/test_random_keys.py: dropout over processes against the reference."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import funcpipe as fp
from funcpipe.models import gpt
from funcpipe.parallel.mesh import build_mesh
from funcpipe.parallel.sharding import shard_tree
from funcpipe.schedule import generate

F64 = torch.float64
CFG = gpt.GPTConfig(vocab=16, context=8, d_model=16, heads=4, layers=2, mlp=32)


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(6, 6), nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.drop(self.fc(x)))


def dropout_model(blocks: int = 4) -> nn.Module:
    """A float64 MLP with dropout in training mode inside each of its repeated blocks."""
    torch.manual_seed(3)
    net = nn.Module()
    net.blocks = nn.Sequential(*[Block() for _ in range(blocks)])
    net.forward = net.blocks.forward  # type: ignore[method-assign]
    return net.to(F64).train()


def data(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(rows, 6, generator=g, dtype=F64), torch.randn(
        rows, 6, generator=g, dtype=F64
    )


def split_dropout(
    rank: int,
    schedule: str,
    seed: int | None,
    data_copies: int = 1,
    microbatches: int = 2,
    overlap: bool = False,
) -> Any:
    """One dropout step over processes (seed None: drawn after torch.manual_seed(rank's seed));
    ``overlap``: with overlapped pairs, under the strict (NCCL-rules) transport."""
    import os

    program = generate(schedule, ranks=2, microbatches=microbatches, overlap=overlap)
    x, y = data()
    rows = x.shape[0] // data_copies
    part = fp.split_module(dropout_model(), program.n_stages, example=x[: rows // microbatches])
    if overlap:
        os.environ["FUNCPIPE_STRICT_P2P"] = "1"
    try:
        pipe = fp.Pipeline(part.stages, program, loss_fn=mse, transport="dist")
    finally:
        os.environ.pop("FUNCPIPE_STRICT_P2P", None)
    try:
        d = rank % data_copies if data_copies > 1 else 0
        torch.manual_seed(11)
        loss, grads = pipe.step(
            part.params, x[d * rows : (d + 1) * rows], y[d * rows : (d + 1) * rows], seed=seed
        )
        return float(loss), grads
    finally:
        pipe.close()


def seeds_disagree(rank: int, explicit: bool) -> Any:
    """Processes seeded differently step once (``explicit``: seed= passed, differing): the
    error each raises, or the loss."""
    program = generate("1f1b", ranks=2, microbatches=2)
    x, y = data()
    part = fp.split_module(dropout_model(), 2, example=x[:4])
    pipe = fp.Pipeline(part.stages, program, loss_fn=mse, transport="dist")
    try:
        torch.manual_seed(11 + rank)  # not alike: process 0's seed is the step's
        return float(pipe.step(part.params, x, y, seed=rank if explicit else None).loss)
    except fp.InvalidArgument as e:
        return str(e)
    finally:
        pipe.close()


def gpt_params(twin_heads: bool) -> dict[str, Any]:
    """Full GPT params; ``twin_heads``: heads 2, 3 copies of heads 0, 1 (so at tensor 2 both
    ranks compute the same thing unless their random numbers differ)."""
    full = gpt.init(CFG, seed=0, dtype=F64)
    if twin_heads:
        half = CFG.d_model // 2
        for b in full["blocks"]:
            a = b["attn"]
            w = a["qkv"]["weight"].view(CFG.heads, -1, CFG.d_model)
            w[2:] = w[:2].clone()
            a["qkv"]["bias"].view(CFG.heads, -1)[2:] = a["qkv"]["bias"].view(CFG.heads, -1)[:2]
            a["o"]["weight"][:, half:] = a["o"]["weight"][:, :half].clone()
    return full


def gpt_tensor2(rank: int, cfg: gpt.GPTConfig, twin_heads: bool, seed: int) -> dict[str, Any]:
    """One step of the GPT at pipeline 1 x tensor 2: loss and this rank's gradient shards."""
    mesh = build_mesh({"pipeline": 1, "tensor": 2})
    place, axis = mesh.place, mesh["tensor"]
    full = gpt.split(gpt_params(twin_heads), cfg, 1)
    lay = gpt.shardings(cfg, 1)
    params = (shard_tree(full[0], lay[0], place),)
    pipe = fp.Pipeline(
        gpt.stages(cfg, 1, axis=axis),
        generate("gpipe", ranks=1, microbatches=2),
        loss_fn=gpt.loss_fn(axis=axis),
        transport="dist",
        mesh=mesh,
    )
    try:
        x, y = gpt_batch()
        loss, grads = pipe.step(params, x, y, seed=seed)
    finally:
        pipe.close()
        mesh.close()
    return {"loss": float(loss), "grads": grads[0], "coord": axis.coord}


def gpt_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    t = torch.randint(0, CFG.vocab, (4, CFG.context + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def gpt_reference(cfg: gpt.GPTConfig, seed: int) -> tuple[float, Any]:
    axis = gpt.single_axis()
    full = gpt.split(gpt_params(False), cfg, 1)
    x, y = gpt_batch()
    loss, grads = fp.reference_step(
        gpt.stages(cfg, 1, axis=axis),
        full,
        x,
        gpt.loss_fn(axis=axis),
        targets=y,
        microbatches=2,
        seed=seed,
    )
    return float(loss), grads[0]
