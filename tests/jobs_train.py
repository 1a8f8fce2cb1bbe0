"""A tiny byte-level model, its training loop, and pool jobs for the optimizer and checkpoint tests
(importable by pool workers)."""

from __future__ import annotations

import os
from typing import Any

import optree
import torch
import torch.distributed as dist

import funcpipe as fp
from funcpipe.train import checkpoint, optim
from funcpipe.train.data import Corpus

F64 = torch.float64
WIDTH = 8


# ------------------------------------------------------------------------------ the model
def _embed(params: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    return torch.tanh(params["E"][tokens] + params["b"])


def _head(params: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ params["W"]) @ params["U"]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def byte_model(seed: int = 0) -> tuple[list[fp.Stage], tuple[dict[str, torch.Tensor], ...]]:
    """Two stages: byte embedding, then a small head back to 256 logits (float64)."""
    g = torch.Generator().manual_seed(seed)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=F64) / shape[0] ** 0.5

    stages = [fp.Stage(_embed, name="embed"), fp.Stage(_head, name="head")]
    params = ({"E": t(256, WIDTH), "b": t(WIDTH)}, {"W": t(WIDTH, WIDTH), "U": t(WIDTH, 256)})
    return stages, params


def train(
    corpus: Corpus,
    params: Any,
    opt_state: Any,
    opt: optim.Optimizer,
    *,
    start: int,
    steps: int,
) -> tuple[Any, Any, list[float]]:
    """``steps`` training steps from step ``start``: reference_step + clipping + the optimizer."""
    stages, _ = byte_model()
    losses = []
    for step in range(start, start + steps):
        x, y = corpus.get_batch("train", step, batch=4, context=16, seed=0)
        loss, grads = fp.reference_step(stages, params, x, cross_entropy, targets=y, microbatches=2)
        grads, _ = optim.clip_by_global_norm(grads, 1.0)
        params, opt_state = opt.update(grads, opt_state, params)
        losses.append(loss.item())
    return params, opt_state, losses


# ------------------------------------------------------------------------------ pool jobs
def only(tree: tuple[Any, ...], keep: int) -> tuple[Any, ...]:
    """The per-stage tuple with every stage but ``keep`` replaced by ``None``."""
    return tuple(s if k == keep else None for k, s in enumerate(tree))


def clip_half(
    rank: int, grads: tuple[Any, ...], max_norm: float, shared: torch.Tensor | None = None
) -> tuple[Any, torch.Tensor]:
    """Rank r holds stage r's gradients; ``shared`` (if given) is held by both, weight 1/2."""
    mine: tuple[Any, ...] = only(grads, rank)
    weights = None
    if shared is not None:
        mine = (*mine, shared)
        weights = lambda path, leaf: 0.5 if path == (len(grads),) else 1.0  # noqa: E731
    return optim.clip_by_global_norm(mine, max_norm, group=dist.group.WORLD, weights=weights)


def _view(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s view of a two-stage training state: its stage only."""
    opt_state = state["opt"]
    return {
        "params": only(state["params"], rank),
        "opt": opt_state._replace(mu=only(opt_state.mu, rank), nu=only(opt_state.nu, rank)),
        "step": state["step"],
    }


def save_stage_per_rank(rank: int, path: str, state: dict[str, Any]) -> str:
    """Each rank saves the stage it holds (and the shared step and optimizer count)."""
    return checkpoint.save(path, _view(state, rank), step=state["step"])


def load_stage_per_rank(rank: int, path: str, like: dict[str, Any]) -> dict[str, Any]:
    """Each rank loads its stage; the other stage is given as meta tensors (not loaded)."""
    mine = _view(like, rank)
    other = 1 - rank
    meta = lambda t: t.to("meta")  # noqa: E731
    params = list(mine["params"])
    params[other] = optree.tree_map(meta, like["params"][other])
    mine["params"] = tuple(params)
    out = checkpoint.load(path, mine)
    if out["params"][other]["E" if other == 0 else "W"].device.type != "meta":
        raise AssertionError("a meta leaf was loaded")
    return _view(out, rank)


def one_rank_errs(rank: int, path: str) -> list[str]:
    """Rank 1 passes a bad state to save, then rank 0 a bad ``like`` to load; both ranks must
    raise (rather than one waiting in a collective), and the group stays usable."""
    errors = []
    bad_state = {"w": torch.ones(2), "name": "x"} if rank == 1 else {"w": torch.ones(2)}
    try:
        checkpoint.save(path, bad_state)
    except fp.InvalidArgument as e:
        errors.append(str(e))
    checkpoint.save(path, {"w": torch.ones(2)})
    like = {"v": torch.ones(2)} if rank == 0 else {"w": torch.ones(2)}
    try:
        checkpoint.load(path, like)
    except fp.InvalidArgument as e:
        errors.append(str(e))
    errors.append(str(checkpoint.load(path, {"w": torch.zeros(2)})["w"].tolist()))
    return errors


def _payload(path: str, key: str) -> tuple[str, int, int]:
    """(file, offset, length) of ``key``'s bytes in a saved checkpoint."""
    metadata = checkpoint._SafeReader(path).read_metadata()
    for index, item in metadata.storage_data.items():
        if index.fqn == key:
            return f"{path}/{item.relative_path}", item.offset, item.length
    raise KeyError(key)


def one_rank_finds_corruption(rank: int, path: str) -> tuple[str, float]:
    """Rank 0 holds key 'a', rank 1 key 'b'; a bit of 'b' is flipped on disk between save and
    load. Only rank 1 reads 'b', yet both must raise (rank 0 must not run on into a collective
    rank 1 never joins), and the group stays usable."""
    meta = torch.zeros(4096, device="meta")
    checkpoint.save(path, {"a": torch.arange(4096.0) if rank == 0 else meta,
                           "b": torch.ones(4096) if rank == 1 else meta})  # fmt: skip
    if rank == 0:
        file, offset, length = _payload(path, "b")
        with open(file, "r+b") as f:
            f.seek(offset + length // 2)
            byte = f.read(1)[0]
            f.seek(offset + length // 2)
            f.write(bytes([byte ^ 0x10]))
    dist.barrier()
    error = ""
    try:
        checkpoint.load(path, {"a": torch.zeros(4096) if rank == 0 else meta,
                               "b": torch.zeros(4096) if rank == 1 else meta})  # fmt: skip
    except fp.FuncpipeError as e:
        error = str(e)
    one = torch.ones(1)
    dist.all_reduce(one)
    return error, float(one)


def replicas_that_differ(rank: int, path: str) -> tuple[str, bool]:
    """Both ranks save key 'w', with different values: DCP would write one rank's copy and drop
    the other, so both ranks must raise before anything is committed."""
    error = ""
    try:
        checkpoint.save(path, {"w": torch.full((8,), float(rank)), "same": torch.ones(3)})
    except fp.FuncpipeError as e:
        error = str(e)
    dist.barrier()
    return error, os.path.exists(path)
