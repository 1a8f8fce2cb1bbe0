"""Pool jobs for tests/test_experts.py: residual MoE stages in a Pipeline whose mesh splits the
experts over the data-parallel copies (``ParallelConfig(expert=2)``), against the same stages
with every expert on one device."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from funcpipe.schedule.ir import pairs

F64 = torch.float64


def _config(experts: int, **kw: Any) -> Any:
    from funcpipe.models import moe

    return moe.MoEConfig(
        **{"d_model": 4, "experts": experts, "ffn": 3, "top_k": 2, "shared": 1, **kw}
    )


def _stages(n: int, config: Any, axis: Any, dropout: float = 0.0) -> list[Any]:
    """Residual MoE blocks; with ``dropout``, each block under a (non-reentrant)
    ``torch.utils.checkpoint`` with dropout on its output: its backward recomputes the block,
    all-to-alls and masks included."""
    import funcpipe as fp
    from funcpipe.models import moe

    def plain(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return h + moe.moe(p, h, config, axis=axis)[0]

    def checkpointed(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        def inner(h: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.dropout(plain(p, h), dropout)

        return torch.utils.checkpoint.checkpoint(inner, h, use_reentrant=False)

    return [fp.Stage(checkpointed if dropout else plain, name=f"moe {s}") for s in range(n)]


def _strictly(job: Any) -> Any:
    """``job`` with its Pipelines under the strict transport (NCCL's point-to-point rules)."""

    @functools.wraps(job)
    def run(*args: Any, **kwargs: Any) -> Any:
        os.environ["FUNCPIPE_STRICT_P2P"] = "1"
        try:
            return job(*args, **kwargs)
        finally:
            os.environ.pop("FUNCPIPE_STRICT_P2P", None)

    return run


def _mse(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((o - t) ** 2).mean()


def _batch(seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, 3, 4, dtype=F64, generator=g), torch.randn(
        size, 3, 4, dtype=F64, generator=g
    )


@contextlib.contextmanager
def _pairs_seen() -> Iterator[list[Any]]:
    """The turns of every overlapped pair run inside (funcpipe.runtime.turns.Turns)."""
    from funcpipe.runtime import turns

    seen: list[Any] = []
    made = turns.Turns.__init__

    def init(self: Any, *args: Any) -> None:
        made(self, *args)
        seen.append(self)

    turns.Turns.__init__ = init  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        turns.Turns.__init__ = made  # type: ignore[method-assign]


def expert_pipelines_vs_one_device(
    rank: int,
    names: Sequence[str],
    *,
    expert: int = 2,
    microbatches: int = 4,
    recompute: bool = False,
    strict: bool = True,
    zero: int = 0,
    routing: Sequence[dict[str, Any]] | None = None,
    overlap: bool = False,
    dropout: float = 0.0,
) -> list[dict[str, Any]]:
    """For each schedule of ``names`` (with overlapped pairs: ``overlap``; stages that
    checkpoint their dropout: ``dropout``, a seeded step): one step at
    pipeline 2 with the experts split over ``expert`` copies; returns this process's worst differences from the one-device step
    (loss, dense gradients, its own experts' gradients) and what it held."""
    import funcpipe as fp
    from funcpipe.models import moe
    from funcpipe.schedule import generate
    from tests.jobs_parallel import mesh_for

    mesh = mesh_for({"pipeline": 2, "expert": expert})
    axis, copies = mesh["expert"], mesh.config.data

    copy, coord = mesh.place.coords["data"], axis.coord
    out = []
    handed: dict[str, int] = {}  # schedule -> how often this process's pairs handed the turn
    for k, name in enumerate(names):
        program = generate(name, ranks=2, microbatches=microbatches, overlap=overlap)
        assert not overlap or any(p for p in map(pairs, program.ranks)), f"{name}: no pair"
        n = len(set(program.replica_of or range(program.n_stages)))
        kw = dict(routing[k]) if routing else {}  # (hypothesis: top_k, shared, score, seed)
        seed = kw.pop("seed", 10 * k)
        config = _config(2 * expert, **kw)
        full = tuple(moe.init(config, seed=seed + s, dtype=F64) for s in range(n))
        mine = tuple(moe.expert_shard(p, config, axis) for p in full)
        experts = [(s, leaf) for s in range(n) for leaf in ("w_in", "w_out")]
        if strict:  # NCCL's point-to-point rules enforced by the transport
            os.environ["FUNCPIPE_STRICT_P2P"] = "1"
        try:
            pipe = fp.Pipeline(
                _stages(n, config, axis, dropout), program, loss_fn=_mse, mesh=mesh,
                experts=experts, recompute=recompute, zero=zero,
            )  # fmt: skip
        finally:
            os.environ.pop("FUNCPIPE_STRICT_P2P", None)
        x, y = _batch(seed, microbatches * copies)
        share = slice(microbatches * copy, microbatches * (copy + 1))
        step_seed = 7 if dropout else None
        with pipe, _pairs_seen() as seen:
            if zero:  # each copy's pieces in, pieces out: gathered back to compare
                shards = pipe.shard(mine)
                got = pipe.step(shards, x[share], y[share], seed=step_seed)
                got.grads = _gathered_grads(pipe, got.grads, mine, shards)
            else:
                got = pipe.step(mine, x[share], y[share], seed=step_seed)
        # in a pair, the halves took turns at the stages' all-to-alls (funcpipe.runtime.turns)
        if pairs(program.ranks[mesh.place.coords["pipe"]]):
            handed[name] = sum(t.handovers for t in seen)
        ref_loss, ref_grads = fp.reference_step(
            _stages(n, config, None, dropout), full, x, _mse, targets=y,
            microbatches=microbatches * copies, seed=step_seed,
        )  # fmt: skip
        local = config.experts // expert
        # relative to the largest value compared (residual MoE stages grow their activations)
        worst = {"loss": float((got.loss - ref_loss).abs() / ref_loss.abs().clamp(min=1))}
        worst |= {"dense": 0.0, "experts": 0.0}
        held = []
        for s, g in enumerate(got.grads):
            if g is None:
                continue
            held.append(s)
            for leaf, value in g.items():
                want = ref_grads[s][leaf]
                if leaf in ("w_in", "w_out"):
                    want, kind = want[coord * local : (coord + 1) * local], "experts"
                else:
                    kind = "dense"
                size = want.abs().max().clamp(min=1)
                worst[kind] = max(worst[kind], float((value - want).abs().max() / size))
        out.append({"name": name, "worst": worst, "held": held, "loss": float(ref_loss)})
    # (a pair whose backward calls no collective, the I of the first stage, whose input needs
    # no gradient, hands nothing: the forward then runs alone after it)
    assert not handed or any(handed.values()), f"no pair took turns: {handed}"
    return out


@_strictly
def gpt_with_experts_vs_one_device(
    rank: int,
    names: Sequence[str],
    microbatches: int = 2,
    overlap: bool = False,
    layout: dict[str, int] | None = None,
    model: dict[str, Any] | None = None,
    scatter_gather: bool = False,
) -> list[dict[str, Any]]:
    """The GPT with MoE blocks (aux loss included) at ``layout`` (default pipeline 2 x expert
    2; with ``tensor``, each expert's width split over it): each schedule's step against the
    one-device step over the whole batch; worst relative differences. ``held``: this rank's
    tensor coordinate and the expert width its first MoE block's ``w_out`` holds (with
    ``moe_tensor="tokens"``: the experts it holds). ``model``: GPTConfig fields over the default
    ones (hypothesis: top_k, shared_experts, seed; moe_tensor)."""
    import funcpipe as fp
    from funcpipe.models import gpt
    from funcpipe.parallel.sharding import shard_tree
    from funcpipe.schedule import generate
    from funcpipe.tree import tree_leaves
    from tests.jobs_parallel import mesh_for

    mesh = mesh_for(layout or {"pipeline": 2, "expert": 2})
    copy, copies = mesh.place.coords["data"], mesh.config.data
    fields = {"top_k": 2, "shared_experts": 1, **(model or {})}
    first = fields.pop("seed", 0)
    cfg = gpt.GPTConfig(vocab=32, context=6, d_model=8, heads=2, layers=3, experts=4, **fields)
    one, tensor = gpt.single_axis(), mesh["tensor"]
    expert = mesh["expert"] if mesh.config.expert > 1 else None
    if cfg.moe_tensor == "tokens" and mesh.config.tensor > 1:  # experts over expert x tensor
        expert = mesh["expert_tensor"]
    out = []
    for k, name in enumerate(names, start=first):
        program = generate(
            name, ranks=mesh.config.pipeline, microbatches=microbatches, overlap=overlap
        )
        assert not overlap or any(p for p in map(pairs, program.ranks)), f"{name}: no pair"
        n = len(set(program.replica_of or range(program.n_stages)))
        full = gpt.split(gpt.init(cfg, seed=k, dtype=F64), cfg, n)
        mine = tuple(
            shard_tree(p, lay, mesh.place)
            for p, lay in zip(full, gpt.shardings(cfg, n), strict=True)
        )
        g, mb = torch.Generator().manual_seed(k), microbatches
        x = torch.randint(0, 32, (mb * copies, 6), generator=g)
        y = torch.randint(0, 32, (mb * copies, 6), generator=g)
        share = slice(mb * copy, mb * copy + mb)
        with fp.Pipeline(
            gpt.stages(cfg, n, axis=tensor, expert=expert), program,
            loss_fn=gpt.loss_fn(axis=tensor), ties=gpt.tie_spec(n), mesh=mesh,
            experts=gpt.expert_paths(cfg, n), scatter_gather=scatter_gather,
        ) as pipe:  # fmt: skip
            got = pipe.step(mine, x[share], y[share])
        ref = fp.reference_step(
            gpt.stages(cfg, n, axis=one), full, x, gpt.loss_fn(axis=one), targets=y,
            microbatches=mb * copies, ties=gpt.tie_spec(n),
        )  # fmt: skip
        want = tuple(
            None if gs is None else shard_tree(r, lay, mesh.place)
            for gs, r, lay in zip(got.grads, ref[1], gpt.shardings(cfg, n), strict=True)
        )
        worst = float((got.loss - ref[0]).abs())
        for gs, ws in zip(got.grads, want, strict=True):
            if gs is None:
                continue
            for a, b in zip(tree_leaves(gs), tree_leaves(ws), strict=True):
                worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp(min=1)))
        held: list[int] = [1]
        blocks = [b for part in mine for b in part["blocks"].values() if "moe" in b]
        if blocks:  # the experts held (tokens split) or the width of each held (width split)
            w_out = blocks[0]["moe"]["w_out"]
            held = [tensor.coord, int(w_out.shape[0 if cfg.moe_tensor == "tokens" else 1])]
        out.append({"name": name, "worst": {"all": worst}, "held": held, "loss": float(ref[0])})
    return out


def reshard_experts(
    rank: int, path: str, save: dict[str, int], loads: Sequence[dict[str, int]]
) -> list[float]:
    """The MoE GPT's params and AdamW state saved by ``save_model`` at the layout ``save``
    (``{"pipeline": p, "expert": e}``), then loaded at each layout of ``loads`` into params of
    another seed: per load, the largest difference from the saved model's block this process
    should hold there (0.0: every expert where it belongs)."""
    from funcpipe import optim
    from funcpipe.models import gpt
    from funcpipe.parallel.sharding import shard_tree
    from funcpipe.train import checkpoint
    from funcpipe.tree import tree_leaves, tree_map
    from tests.jobs_parallel import mesh_for

    cfg = gpt.GPTConfig(vocab=32, context=6, d_model=8, heads=2, layers=3, experts=4)
    opt = optim.adamw(1e-2)

    def held(layout: dict[str, int], seed: int) -> tuple[Any, checkpoint.Naming]:
        mesh = mesh_for(layout)
        n = layout["pipeline"]
        lays = gpt.shardings(cfg, n)
        full = gpt.split(gpt.init(cfg, seed=seed, dtype=F64), cfg, n)
        mine = tuple(shard_tree(p, lay, mesh.place) for p, lay in zip(full, lays, strict=True))
        return mine, checkpoint.Naming(shardings=lays, place=mesh.place)

    params, naming = held(save, 3)
    state = opt.init(params)
    state = state._replace(mu=tree_map(lambda t: t + 1.0, state.mu))  # (a state to find again)
    checkpoint.save_model(path, params, opt_state=state, naming=naming, step=7)
    worst = []
    for layout in loads:
        want, naming = held(layout, 3)
        like, _ = held(layout, 4)
        got = checkpoint.load_model(path, like, opt_state=opt.init(like), naming=naming)
        diff = max(
            float((a - b).abs().max())
            for a, b in zip(tree_leaves(got.params), tree_leaves(want), strict=True)
        )
        mu = max(float((a - 1.0).abs().max()) for a in tree_leaves(got.opt_state.mu))
        worst.append(max(diff, mu, float(got.step != 7)))
    return worst


def gpt_tallies_over_processes(rank: int) -> dict[str, list[int]]:
    """The MoE GPT at pipeline 2 x expert 2 with a routing bias: the step's tallies on this
    process (the counts of its stage's blocks, summed over microbatches and both copies)."""
    import funcpipe as fp
    from funcpipe.models import gpt, gpt_balance
    from funcpipe.parallel.sharding import shard_tree
    from funcpipe.schedule import generate
    from tests.jobs_parallel import mesh_for

    mesh = mesh_for({"pipeline": 2, "expert": 2})
    copy = mesh.place.coords["data"]
    cfg, one = TALLY_CFG, gpt.single_axis()
    full = gpt.split(gpt.init(cfg, seed=5, dtype=F64), cfg, 2)
    lays = gpt.shardings(cfg, 2)
    mine = tuple(shard_tree(p, lay, mesh.place) for p, lay in zip(full, lays, strict=True))
    x, y, bias = tally_batch()
    share = slice(4 * copy, 4 * copy + 4)
    with fp.Pipeline(
        gpt.stages(cfg, 2, axis=one, expert=mesh["expert"]), generate("1f1b", ranks=2,
        microbatches=2), loss_fn=gpt.loss_fn(axis=one), ties=gpt.tie_spec(2), mesh=mesh,
        experts=gpt.expert_paths(cfg, 2), side_inputs=gpt_balance.side_inputs(cfg, 2),
        dim={"inputs": 0, "route_bias": "whole"},
    ) as pipe:  # fmt: skip
        got = pipe.step(mine, {"inputs": x[share], "route_bias": bias}, y[share])
    return {k: v.tolist() for k, v in got.tallies.items()}


def _tally_cfg() -> Any:
    from funcpipe.models import gpt

    return gpt.GPTConfig(vocab=32, context=6, d_model=8, heads=2, layers=3, experts=4)


TALLY_CFG = _tally_cfg()


def tally_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole batch (8 sequences, 4 a copy) and a routing bias favouring expert 3."""
    g = torch.Generator().manual_seed(9)
    x, y = (torch.randint(0, 32, (8, 6), generator=g) for _ in range(2))
    bias = torch.zeros(3, 4, dtype=F64)
    bias[:, 3] = 0.3
    return x, y, bias


@_strictly
def gpt_batch_aux_over_processes(rank: int, names: Sequence[str]) -> list[dict[str, Any]]:
    """The batch's Switch loss at pipeline 2 x expert 2: a counting pass (an evaluation
    Pipeline over the processes: its tallies summed over both copies), then the step with that
    load; against the one-device step on the batch as one piece."""
    import funcpipe as fp
    from funcpipe.models import gpt, gpt_balance
    from funcpipe.parallel.sharding import shard_tree
    from funcpipe.schedule import generate
    from funcpipe.schedule.generators import to_eval
    from funcpipe.tree import tree_leaves
    from tests.jobs_parallel import mesh_for

    mesh = mesh_for({"pipeline": 2, "expert": 2})
    copy, cfg, one = mesh.place.coords["data"], TALLY_CFG, gpt.single_axis()
    out = []
    for k, name in enumerate(names):
        program = generate(name, ranks=2, microbatches=2)
        n = len(set(program.replica_of or range(program.n_stages)))
        full = gpt.split(gpt.init(cfg, seed=k, dtype=F64), cfg, n)
        lays = gpt.shardings(cfg, n)
        mine = tuple(shard_tree(p, lay, mesh.place) for p, lay in zip(full, lays, strict=True))
        x, y, _ = tally_batch()
        share = slice(4 * copy, 4 * copy + 4)
        side = gpt_balance.side_inputs(cfg, n, fields=("route_load",))
        dim = {"inputs": 0, "route_load": "whole"}
        kw = {"loss_fn": gpt.loss_fn(axis=one), "ties": gpt.tie_spec(n), "mesh": mesh,
              "experts": gpt.expert_paths(cfg, n), "side_inputs": side, "dim": dim}  # fmt: skip
        stages = gpt.stages(cfg, n, axis=one, expert=mesh["expert"])
        even = torch.full((3, 4), 0.25, dtype=F64)
        with fp.Pipeline(stages, to_eval(program), **kw) as counting:
            tallies = counting.step(
                mine, {"inputs": x[share], "route_load": even}, y[share]
            ).tallies
        load = gpt_balance.batch_load(tallies, cfg, dtype=F64)
        with fp.Pipeline(stages, program, **kw) as pipe:
            got = pipe.step(mine, {"inputs": x[share], "route_load": load}, y[share])
        ref_load = gpt_balance.batch_load(  # every block's load of the whole batch, one device
            {f"blocks.{i}.moe.counts": c for i, c in zip(cfg.moe_blocks, gpt.expert_load(
                gpt.init(cfg, seed=k, dtype=F64), cfg, x), strict=True)}, cfg, dtype=F64,
        )  # fmt: skip
        ref = fp.reference_step(
            gpt.stages(cfg, n, axis=one), full, {"inputs": x, "route_load": ref_load},
            gpt.loss_fn(axis=one), targets=y, microbatches=1, ties=gpt.tie_spec(n),
            side_inputs=side, dim=dim,
        )  # fmt: skip
        want = [None if g is None else shard_tree(r, lay, mesh.place)
                for g, r, lay in zip(got.grads, ref[1], lays, strict=True)]  # fmt: skip
        worst = float((got.loss - ref[0]).abs())
        for gs, ws in zip(got.grads, want, strict=True):
            for a, b in zip(tree_leaves(gs), tree_leaves(ws), strict=True):
                worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp(min=1)))
        out.append({"name": name, "worst": {"all": worst}, "held": [1]})
    return out


def _gathered_grads(pipe: Any, pieces: Any, params: Any, shards: Any) -> tuple[Any, ...]:
    """A ZeRO step's gradient pieces as full gradients (pipe.gather of the pieces, as the
    params' shards are gathered: the same layout)."""
    from funcpipe.pipeline.zero import Shards

    return pipe.gather(Shards(pieces, shards.copy, shards.copies))


def _rows_tallied(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    from funcpipe.stages.tally import tally

    tally("rows", torch.tensor([x.shape[0], 1]))  # rows, and calls
    tally("sum", x.detach().sum().reshape(1))
    return torch.tanh(x @ p["w"])


def tallies_of_programs(rank: int, names: Sequence[str]) -> list[dict[str, list[float]]]:
    """Each program's step (and its evaluation's) over the pool's processes: this process's
    tallies (every stage a toy that tallies its rows, calls and input sum)."""
    import funcpipe as fp
    from funcpipe.schedule import generate
    from funcpipe.schedule.generators import to_eval

    out = []
    for name in names:
        program = generate(name, ranks=2, microbatches=4)
        n = len(set(program.replica_of or range(program.n_stages)))
        stages = [fp.Stage(_rows_tallied) for _ in range(n)]
        params = tuple({"w": torch.eye(3, dtype=F64) * (1 + s)} for s in range(n))
        x = torch.randn(16, 3, dtype=F64, generator=torch.Generator().manual_seed(3))
        import torch.distributed as dist

        copies = dist.get_world_size() // 2
        share = x[8 * (rank % copies) : 8 * (rank % copies) + 8] if copies > 1 else x
        for prog in (program, to_eval(program)):
            with fp.Pipeline(stages, prog, loss_fn=lambda o: o.sum()) as pipe:
                got = pipe.step(params, share)
            out.append({k: v.tolist() for k, v in got.tallies.items()})
    return out


def traced_pairs(rank: int) -> dict[str, Any]:
    """A traced step of DualPipeV with pairs at pipeline 2 x expert 2: its collectives' spans,
    and the pairs during which one half's all-to-all ran inside the other half's span."""
    import funcpipe as fp
    from funcpipe.models import moe
    from funcpipe.schedule import generate
    from funcpipe.schedule.ir import Op
    from tests.jobs_parallel import mesh_for

    mesh = mesh_for({"pipeline": 2, "expert": 2})
    axis = mesh["expert"]
    program = generate("dualpipev", ranks=2, microbatches=8, overlap=True)
    config = _config(4)
    full = tuple(moe.init(config, seed=s, dtype=F64) for s in range(4))
    mine = tuple(moe.expert_shard(p, config, axis) for p in full)
    experts = [(s, leaf) for s in range(4) for leaf in ("w_in", "w_out")]
    x, y = _batch(0, 8)
    with fp.Pipeline(
        _stages(4, config, axis), program, loss_fn=_mse, mesh=mesh, experts=experts
    ) as pipe:
        tl = pipe.step(mine, x, y, trace=True).timeline
    me = mesh.place.coords["pipe"]
    events, calls = tl.events[me], tl.spans[me]
    ran = tl.program.ranks[me]  # (the program as run: its messages placed, its steps the events')
    inside = {"forward": 0, "backward": 0}  # pairs where a half's all-to-all ran under the other
    for a, b in pairs(ran):
        fwd, bwd = (events[a], events[b]) if events[a].instr.op is Op.F else (events[b], events[a])
        for phase, mine, other in (("forward", fwd, bwd), ("backward", bwd, fwd)):
            inside[phase] += any(
                c.name.startswith("all_to_all") and c.name.endswith(f"({phase})")
                and mine.start <= c.start and c.end <= mine.end
                and min(c.end, other.end) > max(c.start, other.start)
                for c in calls
            )  # fmt: skip
    names = sorted({c.name for c in calls})
    return {"pairs": len(pairs(ran)), "inside": inside, "names": names}
