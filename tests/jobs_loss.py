"""Token-weighted losses: a toy token model, its full-batch reference, and pool jobs
(importable by pool workers)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

import funcpipe as fp
from funcpipe.pipeline.pipeline import Pipeline
from funcpipe.schedule.generators import GENERATORS, generate
from funcpipe.stages.stage import Stage
from funcpipe.tree import tree_leaves
from tests.jobs_gpt import rank_params

F64 = torch.float64
D, V, T = 6, 5, 4  # width, classes, tokens per sequence
TRAINING = [name for name in GENERATORS if name != "forward"]


def _embed(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p["W"] + p["b"])


def _head(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ p["W"] + p["b"]) @ p["U"]  # (batch, T, V)


def model(n: int, *, seed: int = 0) -> tuple[list[Stage], list[dict[str, torch.Tensor]]]:
    """``n`` stages over tokens of width D; the last maps to V classes."""
    g = torch.Generator().manual_seed(seed)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=F64) / shape[0] ** 0.5

    stages = [Stage(_embed, name=f"s{k}") for k in range(n - 1)] + [Stage(_head, name="head")]
    params = [{"W": t(D, D), "b": t(D)} for _ in range(n - 1)]
    params.append({"W": t(D, D), "b": t(D), "U": t(D, V)})
    return stages, params


def batch(size: int, *, seed: int = 1, pad: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``(size, T, D)`` and labels ``(size, T)`` with -100 on a random share of the
    tokens, and at least one counted token in all (a different count per sample)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, T, D, generator=g, dtype=F64)
    labels = torch.randint(0, V, (size, T), generator=g)
    labels[torch.rand(size, T, generator=g) < pad] = -100
    labels[0, 0] = 1
    return x, labels


def full_batch(
    stages: Sequence[Stage],
    params: Sequence[dict[str, torch.Tensor]],
    x: torch.Tensor,
    labels: torch.Tensor,
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """The unsplit model on the whole batch: ``F.cross_entropy(..., ignore_index=-100)`` and
    ``loss.backward()``."""
    leaves = [{k: v.detach().clone().requires_grad_(True) for k, v in p.items()} for p in params]
    h = x
    for stage, p in zip(stages, leaves, strict=True):
        h = stage(p, h)
    loss = F.cross_entropy(h.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    return loss.detach(), [{k: v.grad for k, v in p.items()} for p in leaves]


def worst(a: Any, b: Any) -> float:
    """The largest absolute difference between two pytrees of tensors (``None`` skipped)."""
    la, lb = tree_leaves(a), tree_leaves(b)
    return max(float((x - y).abs().max()) for x, y in zip(la, lb, strict=True))


def token_loss_vs_full_batch(rank: int, name: str, ranks: int, microbatches: int) -> float:
    """Over the pool's processes (``world = copies x ranks``): each data copy trains on its
    contiguous share, whose counted tokens differ from the other's; the returned loss and this
    rank's gradients are compared with the full batch's."""
    import torch.distributed as dist

    program = generate(name, ranks=ranks, microbatches=microbatches)
    n = len(set(program.replica_of or ())) or program.n_stages
    stages, params = model(n)
    copies = dist.get_world_size() // ranks
    pipe = Pipeline(stages, program, loss_fn=fp.token_cross_entropy)
    size = 3 * microbatches  # uneven shares when split further
    x, labels = batch(size * copies, seed=7)
    labels[: size // 2] = -100  # copy 0 counts far fewer tokens than copy 1
    labels[0, 0] = 2
    copy = rank % copies
    share = slice(copy * size, (copy + 1) * size)
    loss, grads = pipe.step(params, x[share], labels[share])
    ref_loss, ref_grads = full_batch(stages, params, x, labels)
    held = [(g, r) for g, r in zip(grads, ref_grads, strict=True) if g is not None]
    return max(float((loss - ref_loss).abs()), *(worst(g, r) for g, r in held))


def gpt_tensor_parallel_token_loss(rank: int, pipeline: int, tensor: int) -> float:
    """funcpipe's GPT at pipeline x tensor over the pool, padded targets and
    ``gpt.loss_fn(..., ignore_index=-100)``: the largest difference of the loss and of this
    rank's gradient shards from the whole model's full-batch ``F.cross_entropy``."""
    from funcpipe.models import gpt
    from funcpipe.parallel.mesh import build_mesh
    from funcpipe.parallel.sharding import shard_tree
    from funcpipe.tree import tree_flatten, tree_unflatten

    cfg = gpt.GPTConfig(vocab=16, context=6, d_model=8, heads=2, layers=2, mlp=16)
    mesh = build_mesh({"pipeline": pipeline, "tensor": tensor})
    place, axis = mesh.place, mesh["tensor"]
    program = generate("1f1b", ranks=pipeline, microbatches=3)
    n = program.n_stages
    full = gpt.init(cfg, seed=0, dtype=F64)
    lay = gpt.shardings(cfg, n)
    mine = set(program.stages_on(place.coords["pipe"]))
    split_full = gpt.split(full, cfg, n)
    params = rank_params(split_full, lay, place, mine)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, cfg.vocab, (5, cfg.context + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    y[1:4, 2:] = -100
    pipe = Pipeline(
        gpt.stages(cfg, n, axis=axis), program, transport="dist", mesh=mesh,
        loss_fn=gpt.loss_fn(axis=axis, ignore_index=-100), ties=gpt.tie_spec(n),
    )  # fmt: skip
    loss, grads = pipe.step(params, x, y)

    (whole,) = gpt.split(full, cfg, 1)
    leaves, spec = tree_flatten(whole)
    leaves = [t.clone().requires_grad_(True) for t in leaves]
    logits = gpt.stages(cfg, 1, axis=gpt.single_axis())[0](tree_unflatten(spec, leaves), x)
    ref = F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1), ignore_index=-100)
    ref_grads = tree_unflatten(spec, list(torch.autograd.grad(ref, leaves)))
    blocks = [ref_grads["blocks"][str(i)] for i in range(cfg.layers)]
    want = gpt.split({**ref_grads, "blocks": blocks}, cfg, n)
    diffs = [float((loss - ref.detach()).abs())]
    diffs += [worst(grads[s], shard_tree(want[s], lay[s], place)) for s in sorted(mine)]
    return max(diffs)
