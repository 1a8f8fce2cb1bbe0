"""Sharded data parallelism (ZeRO-1 and ZeRO-2): the runs tests/test_zero.py compares, in one
process (``data`` copies) and as pool jobs (importable by pool workers).

A toy model of width :data:`W` = 5 (odd: every leaf's size, 25 or 5, is uneven over 2 and 4
copies) with the first and last stages' ``E`` tied; AdamW; float64. :func:`train_local` (one
process) and :func:`train_dist` (over the pool) run three optimizer steps unsharded
(``zero=0``) or sharded (``zero=1`` or ``2``) and return the losses and the full parameters
after them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from funcpipe.pipeline.pipeline import Pipeline
from funcpipe.schedule.generators import generate
from funcpipe.stages.stage import Stage
from funcpipe.testing import assert_trees_close
from funcpipe.train.clip import clip_by_global_norm
from funcpipe.train.optimizers import adamw

W = 5
F64 = torch.float64
STEPS = 3
SCHEDULES = {"1f1b": 1, "interleaved": 2, "zbv": 2}  # name -> stages per rank
# name -> model stages at 2 ranks (Chimera: 4 program stages, replicas of 2)
MODEL_STAGES = {
    "chimera": 2,
    "gpipe": 2,
    "zb-h1": 2,
    "zb-h2": 2,
    "looped-bfs": 4,
    "dualpipev": 4,
    **{k: 2 * v for k, v in SCHEDULES.items()},
}


def _first(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p["E"] + p["b"])


def _middle(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ p["W"] + p["b"])


def _last(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return h @ p["E"].T


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def model(n: int, width: int = W) -> tuple[list[Stage], list[dict[str, torch.Tensor]]]:
    """``n`` stages; the first and the last hold an ``E`` (tied)."""
    g = torch.Generator().manual_seed(0)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=F64) / shape[0] ** 0.5

    stages = [Stage(_first, name="first")]
    params = [{"E": t(width, width), "b": t(width)}]
    for k in range(1, n - 1):
        stages.append(Stage(_middle, name=f"mid{k}"))
        params.append({"W": t(width, width), "b": t(width)})
    stages.append(Stage(_last, name="last"))
    params.append({"E": params[0]["E"].clone()})
    return stages, params


def batches(copies: int, width: int = W) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        tuple(torch.randn(4 * copies, width, generator=g, dtype=F64) for _ in range(2))  # type: ignore[misc]
        for _ in range(STEPS)
    ]


def _pipeline(
    name: str,
    zero: int,
    data: int = 1,
    strict: bool = False,
    width: int = W,
    grad_dtype: torch.dtype | None = None,
) -> tuple[Pipeline, Any]:
    program = generate(name, ranks=2, microbatches=4)
    n = MODEL_STAGES[name]  # (Chimera: 4 program stages, replicas of 2)
    stages, params = model(n, width)
    if grad_dtype is not None:  # bf16 parameters, float32 gradient sums
        params = [{k: v.to(torch.bfloat16) for k, v in p.items()} for p in params]
    ties = {"E": [(0, "E"), (n - 1, "E")]}
    if strict:
        os.environ["FUNCPIPE_STRICT_P2P"] = "1"
    try:
        pipe = Pipeline(
            stages, program, loss_fn=mse, ties=ties, data=data, zero=zero, grad_dtype=grad_dtype
        )
        params = tuple(params)
    finally:
        os.environ.pop("FUNCPIPE_STRICT_P2P", None)
    return pipe, params


def train_local(
    name: str, zero: int, data: int, bf16: bool = False
) -> tuple[list[float], tuple[Any, ...]]:
    """One process, ``data`` copies: three AdamW steps; (losses, full params after them).
    ``bf16``: bf16 parameters and batches, float32 gradient sums (``grad_dtype``), AdamW with
    float32 master weights."""
    pipe, params = _pipeline(name, zero, data, grad_dtype=torch.float32 if bf16 else None)
    opt = adamw(1e-2, master_weights=bf16)
    losses = []
    cast = torch.bfloat16 if bf16 else F64
    steps = [(x.to(cast), y.to(cast)) for x, y in batches(data)]
    if not zero:
        state = opt.init(params)
        for x, y in steps:
            loss, grads = pipe.step(params, x, y)
            params, state = opt.update(grads, state, params)
            losses.append(float(loss))
        return losses, tuple(params)
    shards = pipe.shard(params)  # every copy's
    states = [opt.init(s) for s in shards]
    for x, y in steps:
        loss, grads = pipe.step(shards, x, y)
        new = [opt.update(g, st, s) for g, st, s in zip(grads, states, shards, strict=True)]
        shards, states = [n[0] for n in new], [n[1] for n in new]
        losses.append(float(loss))
    return losses, pipe.gather(shards)


# ---------------------------------------------------------------- over processes
def _copy(pipe: Pipeline) -> int:
    assert pipe._world is not None
    return pipe._world.copy


def train_dist(
    rank: int,
    name: str,
    zero: int,
    *,
    clip: float | None = None,
    strict: bool = False,
    width: int = W,
    bf16: bool = False,
) -> tuple[list[float], list[Any], int]:
    """Over the pool (world = 2 program ranks x copies): three AdamW steps, each copy on its
    share of the batch, optionally clipped by the global norm (``clip``). Returns the losses,
    the full params of the stages this process holds (``None`` elsewhere) and the bytes of
    AdamW state (both moments) this process keeps. ``bf16``: as in :func:`train_local`."""
    import torch.distributed as dist

    f32 = torch.float32 if bf16 else None
    pipe, params = _pipeline(name, zero, strict=strict, width=width, grad_dtype=f32)
    copies, copy = pipe.data_size, _copy(pipe)
    opt = adamw(1e-2, master_weights=bf16)
    n = len(params)
    losses: list[float] = []
    values: Any = pipe.shard(params) if zero else params
    prog = pipe.program
    owner = prog.replica_of or tuple(range(prog.n_stages))  # (Chimera: replicas of n stages)
    mine = sorted({owner[s] for s in prog.stages_on(pipe.rank)})
    holders = [
        len({prog.placement[s] for s in range(prog.n_stages) if owner[s] == o}) for o in range(n)
    ]
    states = {o: opt.init(values[o]) for o in mine}
    cast = torch.bfloat16 if bf16 else F64
    for x, y in batches(copies, width):
        share = slice(4 * copy, 4 * (copy + 1))
        loss, grads = pipe.step(values, x[share].to(cast), y[share].to(cast))
        losses.append(float(loss))
        if clip is not None:
            grads = _clipped(grads, mine, holders, clip, copies, zero, dist.group.WORLD)
        values = list(values)
        for o in mine:
            values[o], states[o] = opt.update(grads[o], states[o], values[o])
        values = tuple(values)
    full = (
        pipe.gather(values)
        if zero
        else tuple(v if o in mine else None for o, v in enumerate(values))
    )
    state_bytes = sum(
        t.numel() * t.element_size()
        for o in mine
        for moment in (states[o].mu, states[o].nu)
        for t in torch.utils._pytree.tree_leaves(moment)
    )
    pipe.close()
    return losses, list(full), state_bytes


def _clipped(
    grads: Sequence[Any],
    mine: list[int],
    holders: list[int],
    clip: float,
    copies: int,
    zero: int,
    world: Any,
) -> list[Any]:
    """``grads`` clipped by the norm of the whole model's averaged gradient, over the world.

    Unsharded, every copy holds the whole averaged gradient: each leaf weighs ``1 / copies``.
    Sharded, the copies hold disjoint pieces of it: each weighs 1 (the data group's sum of
    squares). A stage ``holders[o]`` ranks hold (Chimera's replicas) weighs a share of that.
    Either way the tied ``E`` counts once: weight 0 on the last stage's copy."""
    n = len(holders)
    w = 1.0 if zero else 1.0 / copies
    tree = {o: grads[o] for o in mine}
    weights = {
        o: {k: (0.0 if (o == n - 1 and k == "E") else w / holders[o]) for k in grads[o]}
        for o in mine
    }
    clipped, _ = clip_by_global_norm(tree, clip, group=world, weights=weights)
    return [clipped.get(o) for o in range(n)]


def zero_vs_unsharded(
    rank: int, name: str, clip: float | None = None, bf16: bool = False, zero: int = 1
) -> tuple[float, float]:
    """The sharded run (``zero`` 1 or 2) against the unsharded one in the same processes
    (strict transport: NCCL's point-to-point rules): the largest loss and parameter
    differences."""
    ref_losses, ref_full, _ = train_dist(rank, name, 0, clip=clip, strict=True, bf16=bf16)
    losses, full, _ = train_dist(rank, name, zero, clip=clip, strict=True, bf16=bf16)
    held = [(a, b) for a, b in zip(full, ref_full, strict=True) if b is not None]
    assert_trees_close([a for a, _ in held], [b for _, b in held], atol=1e-12, rtol=0)
    dl = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    dp = max(float((a[k] - b[k]).abs().max()) for a, b in held for k in b)
    return dl, dp


def state_bytes(rank: int, zero: int) -> int:
    """Bytes of AdamW state this process keeps after three 1F1B steps of a wide model (width
    63: leaves of 3969 and 63 elements, uneven over 2 copies)."""
    return train_dist(rank, "1f1b", zero, width=63)[2]


def gpt_run(rank: int, pipeline: int, zero: int) -> tuple[list[float], list[Any]]:
    """The demo's GPT (float64, tied embedding) over pipeline x data x tensor 2: three AdamW
    steps, each copy on its rows; the losses and the full (tensor-sharded) params this process
    holds after them."""
    from tests import jobs_gpt

    job = jobs_gpt.gpt_job(pipeline, 2, zero=zero)
    pipe, mine = job.pipe, sorted(job.mine)
    opt = adamw(1e-2)
    values: Any = pipe.shard(job.params) if zero else job.params
    states = {o: opt.init(values[o]) for o in mine}
    losses = []
    for step in range(STEPS):
        loss, grads = pipe.step(values, *job.rows(*jobs_gpt.batch(step)))
        losses.append(float(loss))
        values = list(values)
        for o in mine:
            values[o], states[o] = opt.update(grads[o], states[o], values[o])
        values = tuple(values)
    out = pipe.gather(values) if zero else values
    pipe.close()
    return losses, [out[o] for o in mine]


def gpt_zero_vs_unsharded(rank: int, pipeline: int, zero: int = 1, atol: float = 1e-12) -> float:
    ref_losses, ref = gpt_run(rank, pipeline, 0)
    losses, got = gpt_run(rank, pipeline, zero)
    assert_trees_close(got, ref, atol=atol, rtol=0)
    return max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))


def clip_pieces_alone(rank: int) -> tuple[str, bool]:
    """Pool job (4 ranks: pipeline 2 x data 2, ZeRO-1): clipping this copy's gradient pieces
    with group=None is refused; with the world group it is the whole gradient's norm."""
    import torch.distributed as dist

    from funcpipe.errors import InvalidArgument
    from funcpipe.train import optim

    pipe, params = _pipeline("1f1b", 1)
    x, y = batches(pipe.data_size)[0]
    share = slice(4 * _copy(pipe), 4 * (_copy(pipe) + 1))
    grads = pipe.step(pipe.shard(params), x[share].to(F64), y[share].to(F64)).grads
    try:
        optim.clip_by_global_norm(grads, 1.0)
        said = "clipped"
    except InvalidArgument as e:
        said = str(e)
    _, norm = optim.clip_by_global_norm(grads, 1.0, group=dist.group.WORLD)
    pipe.close()
    return said, bool(torch.isfinite(norm))


def another_copys_shards(rank: int) -> str:
    """Pool job (4 ranks: pipeline 2 x data 2, ZeRO-1): a process stepping on the other copy's
    shards (as if loaded from its file) is refused, naming both copies."""
    import torch.distributed as dist

    from funcpipe.errors import InvalidArgument

    pipe, params = _pipeline("1f1b", 1)
    x, y = batches(pipe.data_size)[0]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, pipe.shard(params))  # every process's shards
    theirs = next(s for s in every if s.copy != _copy(pipe))
    try:
        pipe.step(theirs, x.to(F64), y.to(F64))
        said = "ran"
    except InvalidArgument as e:
        said = str(e)
    pipe.close()
    return said
