"""Pool jobs: the GPT trained with AdamW at one (pipeline, tensor, data, schedule), saved with
``checkpoint.save_model``, and continued at another layout from the checkpoint."""

from __future__ import annotations

from typing import Any

import torch

from funcpipe import optim
from funcpipe.models import gpt
from funcpipe.train import checkpoint
from funcpipe.train.checkpoint_named import named_pieces
from funcpipe.tree import tree_map
from tests.jobs_gpt import GPTJob, gpt_job

CFG = gpt.GPTConfig(vocab=32, context=8, d_model=16, heads=4, layers=7, mlp=32)
OPT = optim.adamw(1e-2, weight_decay=0.1)


def batch(step: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    tokens = torch.randint(0, CFG.vocab, (rows, CFG.context + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _setup(
    pipeline: int, tensor: int, schedule: str, seed: int, blocks: Any = None, zero: int = 0
) -> tuple[GPTJob, checkpoint.Naming]:
    job = gpt_job(pipeline, tensor, schedule, cfg=CFG, seed=seed, blocks=blocks, zero=zero)
    place = job.mesh.place
    # zero: each optimizer-state leaf is this data copy's flat piece of the param's leaf
    shard = (job.mesh.config.data, place.coords["data"]) if zero else None
    return job, checkpoint.Naming(shardings=job.shardings, place=place, opt_shard=shard)


def _step(job: GPTJob, params: Any, state: Any, step: int, rows: int = 8) -> tuple[float, Any, Any]:
    loss, grads = job.pipe.step(params, *job.rows(*batch(step, rows)))
    params, state = OPT.update(grads, state, params)
    return float(loss), params, state


def run(
    rank: int,
    pipeline: int,
    tensor: int,
    schedule: str,
    path: str,
    save: bool,
    blocks: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """``save``: 2 steps from the init, save at step 2, then step 3; else: load the checkpoint
    at this layout (into params of another seed) and make step 3. Returns step 3's loss and
    this rank's params and optimizer state after it, keyed as save_model keys them.
    ``blocks``: the GPT's blocks per stage (default: as even as possible)."""
    job, naming = _setup(pipeline, tensor, schedule, 0 if save else 1, blocks)
    params = job.params
    state = OPT.init(params)
    losses = []
    if save:
        for step in range(2):
            loss, params, state = _step(job, params, state, step)
            losses.append(loss)
        checkpoint.save_model(path, params, opt_state=state, naming=naming, step=2)
    else:
        loaded = checkpoint.load_model(path, params, opt_state=state, naming=naming)
        assert loaded.step == 2 and loaded.opt_state.step == 2
        params, state = loaded.params, loaded.opt_state
    loss, params, state = _step(job, params, state, 2)
    pieces, table = named_pieces(params, state, naming)
    shapes = {k: tuple(v["shape"]) for k, v in table["tensors"].items()}
    return {"losses": [*losses, loss], "pieces": pieces, "shapes": shapes, "rank": rank}


def run_zero(rank: int, pipeline: int, zero: int, path: str, save: bool) -> dict[str, Any]:
    """As :func:`run` (1F1B, tensor 1, 16 rows a step), with sharded optimizer state at
    ``zero`` 1 or 2 over the data copies the world leaves (``world / pipeline``): the params
    are saved and loaded whole (gathered), the optimizer state as this copy's flat pieces; each
    copy steps on its shards. ``save``: 2 steps, save, step 3; else load at this layout and
    make step 3. Returns as :func:`run`, the params gathered."""
    job, naming = _setup(pipeline, 1, "1f1b", 0 if save else 1, zero=zero)
    pipe, params = job.pipe, job.params
    template = tuple(tree_map(lambda t: t.to("meta"), p) for p in params)

    def whole(values: Any) -> tuple[Any, ...]:  # full params, meta for stages not held
        if not zero:
            return tuple(values)
        got = pipe.gather(values)
        return tuple(m if g is None else g for g, m in zip(got, template, strict=True))

    values = pipe.shard(params) if zero else params
    state = OPT.init(values)
    losses = []
    if save:
        for step in range(2):
            loss, values, state = _step(job, values, state, step, rows=16)
            losses.append(loss)
        checkpoint.save_model(path, whole(values), opt_state=state, naming=naming, step=2)
    else:
        loaded = checkpoint.load_model(path, params, opt_state=state, naming=naming)
        assert loaded.step == 2 and loaded.opt_state.step == 2
        values = pipe.shard(loaded.params) if zero else loaded.params
        state = loaded.opt_state
    loss, values, state = _step(job, values, state, 2, rows=16)
    pieces, table = named_pieces(whole(values), state, naming)
    pipe.close()
    shapes = {k: tuple(v["shape"]) for k, v in table["tensors"].items()}
    return {"losses": [*losses, loss], "pieces": pieces, "shapes": shapes, "rank": rank}


def two_ranks(rank: int, path: str) -> dict[str, Any]:
    """Tensor ranks 0 and 1 each save their half of ``w`` and a copy of ``b``; then rank 0 asks
    for a ``w`` of another full shape (rank 1 for the right one) and both raise, unread."""
    from funcpipe.errors import InvalidArgument
    from funcpipe.parallel import Place, Sharding

    place = Place(rank, {"tensor": rank}, {"tensor": 2})
    naming = checkpoint.Naming(
        shardings=({"w": Sharding.of(None, "tensor"), "b": Sharding.of(None)},), place=place
    )
    w = torch.arange(12.0).reshape(3, 4)
    mine = ({"w": w[:, 2 * rank : 2 * rank + 2].clone(), "b": torch.ones(5)},)
    checkpoint.save_model(path, mine, naming=naming, step=5)
    like = ({"w": torch.zeros(3, 3 if rank == 0 else 2), "b": torch.zeros(5)},)
    try:
        checkpoint.load_model(path, like, naming=naming)
    except InvalidArgument as e:
        return {"error": str(e)}
    return {"error": None}
