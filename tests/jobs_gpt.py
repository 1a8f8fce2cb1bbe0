"""Pool jobs for the GPT of the demo: one step against the single-device reference."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

import funcpipe as fp
from funcpipe.models import gpt
from funcpipe.parallel.mesh import build_mesh
from funcpipe.parallel.sharding import shard_tree
from funcpipe.schedule import generate
from funcpipe.tree import tree_map

CFG = gpt.GPTConfig(vocab=32, context=8, d_model=16, heads=4, layers=3, mlp=32)


def batch(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CFG.vocab, (rows, CFG.context + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def rank_params(full: Any, shardings: Any, place: Any, mine: Any) -> tuple[Any, ...]:
    """Each stage's params as this rank passes them: its tensor shard of the stages it holds,
    meta tensors of the shard's shapes for the others."""
    return tuple(
        shard_tree(full[s], shardings[s], place)
        if s in mine
        else tree_map(lambda t: t.to("meta"), shard_tree(full[s], shardings[s], place))
        for s in range(len(full))
    )


def reference(steps: int, schedule: str, pipeline: int) -> tuple[list[float], tuple[Any, ...]]:
    """Single device: the same model, microbatches and SGD, losses of ``steps`` steps and the
    first step's full gradients (per pipeline stage, as split for the schedule)."""
    program = generate(schedule, ranks=pipeline, microbatches=4)
    n = program.n_stages
    axis = gpt.single_axis()
    stages, full = (
        gpt.stages(CFG, 1, axis=axis),
        gpt.split(gpt.init(CFG, seed=0, dtype=torch.float64), CFG, 1),
    )
    losses, first = [], None
    params = full
    for step in range(steps):
        x, y = batch(step)
        loss, grads = fp.reference_step(
            stages, params, x, gpt.loss_fn(axis=axis), targets=y, microbatches=4
        )
        if first is None:
            first = grads[0]
        losses.append(float(loss))
        params = tree_map(lambda p, g: p - 0.1 * g, params, grads)
    # the first step's gradients cut like the pipeline's stages (tied wte: summed on both ends)
    per_stage = gpt.split(
        {**first, "blocks": [first["blocks"][str(i)] for i in range(CFG.layers)]}, CFG, n
    )
    return losses, per_stage


class GPTJob(NamedTuple):
    """One rank's GPT over ``pipeline x tensor x data`` processes (:func:`gpt_job`)."""

    mesh: Any
    pipe: fp.Pipeline
    params: tuple[Any, ...]  # this rank's tensor shards of its stages, meta elsewhere
    shardings: Any
    mine: set[int]  # the stages this rank runs

    def rows(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's data copy's share of a batch."""
        data, d = self.mesh.config.data, self.mesh.place.coords["data"]
        n = x.shape[0] // data
        return x[d * n : (d + 1) * n], y[d * n : (d + 1) * n]


def gpt_job(
    pipeline: int,
    tensor: int,
    schedule: str = "1f1b",
    *,
    cfg: gpt.GPTConfig = CFG,
    seed: int = 0,
    blocks: Any = None,
    overlap: bool = False,
    **options: Any,
) -> GPTJob:
    """The float64 GPT (``cfg``, initialised from ``seed``) split for ``schedule`` over
    ``pipeline`` ranks (4 microbatches), ``tensor`` ranks and the data copies the world leaves;
    ``blocks`` as for ``gpt.split``; ``overlap``: the schedule with overlapped pairs;
    ``options`` to the Pipeline (``zero=``, ...)."""
    mesh = build_mesh({"pipeline": pipeline, "tensor": tensor})
    place, axis = mesh.place, mesh["tensor"]
    program = generate(schedule, ranks=pipeline, microbatches=4, overlap=overlap)
    n = program.n_stages
    full = gpt.split(gpt.init(cfg, seed=seed, dtype=torch.float64), cfg, n, blocks=blocks)
    lay = gpt.shardings(cfg, n, blocks=blocks)
    mine = set(program.stages_on(place.coords["pipe"]))
    pipe = fp.Pipeline(
        gpt.stages(cfg, n, axis=axis, blocks=blocks),
        program,
        loss_fn=gpt.loss_fn(axis=axis),
        ties=gpt.tie_spec(n),
        transport="dist",
        mesh=mesh,
        **options,
    )
    return GPTJob(mesh, pipe, rank_params(full, lay, place, mine), lay, mine)


def pipeline_step(
    rank: int,
    pipeline: int,
    tensor: int,
    schedule: str,
    steps: int,
    scatter_gather: bool = False,
    overlap: bool = False,
) -> dict[str, Any]:
    """One rank of pipeline x tensor x data: the losses of ``steps`` SGD steps and this rank's
    first-step gradients (its shards); with ``overlap`` (pairs), how often the pairs' halves
    handed the turn at their tensor-parallel collectives."""
    import torch.distributed as dist

    from tests.jobs_experts import _pairs_seen

    job = gpt_job(pipeline, tensor, schedule, scatter_gather=scatter_gather, overlap=overlap)
    pipe, params, place, mine = job.pipe, job.params, job.mesh.place, job.mine
    losses, first = [], None
    with _pairs_seen() as seen:
        for step in range(steps):
            loss, grads = pipe.step(params, *job.rows(*batch(step)))
            if first is None:
                first = grads
            losses.append(float(loss))
            params = tuple(
                p if g is None else tree_map(lambda a, b: a - 0.1 * b, p, g)
                for p, g in zip(params, grads, strict=True)
            )
    return {
        "handovers": sum(t.handovers for t in seen),
        "bytes_sent": pipe.bytes_sent,
        "rank": dist.get_rank(),
        "place": place,
        "losses": losses,
        "grads": first,
        "stages": sorted(mine),
    }
