"""The demo's training loop: what one rank of the job does, from its shard of the model to the summary.

:func:`train_rank` is the function :func:`funcpipe.launch` runs on every rank: build this
rank's stages, pipelines, optimizer and data (:class:`_Rank`), resume from a checkpoint, train,
evaluate, trace one step against the simulator and, on the first rank, write the summary.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from funcpipe.cli.demo_options import COMPILE_BACKEND, DemoOptions
from funcpipe.cli.demo_report import History, pictures, progress, summary
from funcpipe.errors import InvalidArgument
from funcpipe.runtime.clock import timer
from funcpipe.train.throughput import peak_flops, throughput, warmup_steps

if TYPE_CHECKING:
    from funcpipe.schedule.ir import Program

__all__ = ["train_rank"]


def train_rank(rank: int, o: DemoOptions, program: Program | None = None) -> dict[str, Any] | None:
    """Everything one rank does; returns the summary on the first rank. ``program`` is the one
    :func:`funcpipe.cli.demo_options.validate` built (generated from ``o`` when None)."""

    torch.manual_seed(o.seed)
    r, params, state = _build(o, program)
    params, state, start, history = _resume(r, params, state)
    if r.zero:  # from here on ``params`` is this copy's shards (the full ones are dropped)
        params = r.pipe.shard(params)
    if start == 0:
        history["val"].append([0, _val_loss(r, params)])  # where it starts: about ln 256
    t_start = time.perf_counter()
    end = o.stop_after or o.steps
    saver = _Saver(r, history)
    params, state, step_times, last = _train(r, params, state, history, start, end, saver)
    if end < o.steps:  # interrupted on purpose: keep what a resume needs, nothing else
        saver.final(end, params, state)
        return None
    final_val = _val_loss(r, params)
    history["val"].append([o.steps, final_val])
    traced, simulated = _traced_step(r, params)
    saver.final(o.steps, params, state)
    peak_memory = _peak_memory(r.device)  # every rank takes part (a gather)
    if not r.first:
        return None
    _write_history(o, history)
    files = pictures(o, history, traced)
    return _summarise(
        r,
        start=start,
        history=history,
        step_times=step_times,
        last=last,
        final_val=final_val,
        traced=traced,
        simulated=simulated,
        peak_memory=peak_memory,
        files=files,
        t_start=t_start,
    )


# ------------------------------------------------------------------------------ the rank's job
@dataclass(frozen=True)
class _Rank:
    """What one rank trains with: its device and clock, the model's config and stages, the
    training and evaluation pipelines, the optimizer, the clipping weights and the data. With
    ``zero`` 1 or 2 both pipelines take this data copy's shards of the params."""

    o: DemoOptions
    device: torch.device
    now: Callable[[], float]
    cfg: Any
    stages: list[Any]
    pipe: Any
    evaluate: Any
    opt: Any
    weights: Any
    corpus: Any
    data_rank: int
    tag: str  # this rank's key in a checkpoint.save one (before the demo saved by names)
    naming: Any  # checkpoint.Naming: the model's names and this rank's region of each tensor
    first: bool  # the rank that reports
    zero: int  # 1, 2: params and optimizer state sharded over the data copies (ZeRO-1, -2)
    zero_note: str  # why the default --zero gave way ("" when it did not)
    template: tuple[Any, ...]  # the full params' shapes, as meta tensors (to fill a gather's None)

    @property
    def ckpt_dir(self) -> str:
        return os.path.join(self.o.out, "checkpoint")

    @property
    def tokens_per_step(self) -> int:
        return self.o.batch * self.o.data * self.o.context

    def batch(self, split: str, index: int) -> tuple[Any, Any]:
        """This data rank's ``index``-th batch of ``split`` (``"train"`` or ``"val"``)."""
        o = self.o
        x, y = self.corpus.get_batch(
            split,
            index,
            batch=o.batch,
            context=o.context,
            seed=o.seed,
            data_rank=self.data_rank,
            data_size=o.data,
        )
        return x, y


def _build(o: DemoOptions, program: Program | None) -> tuple[_Rank, tuple[Any, ...], Any]:
    """This rank's :class:`_Rank`, its shard of the model's parameters and the optimizer state."""
    import torch.distributed as dist

    from funcpipe.cli.demo_options import gpt_config, zero_level
    from funcpipe.models import gpt
    from funcpipe.parallel.mesh import build_mesh
    from funcpipe.pipeline.zero import full_meta
    from funcpipe.schedule.generators import generate
    from funcpipe.train import checkpoint, optim
    from funcpipe.train.data import load_corpus

    device = _rank_device(o)
    now = timer(device)
    mesh = build_mesh({"pipeline": o.pipeline, "tensor": o.tensor, "expert": o.expert})
    place = mesh.place
    axis = mesh["tensor"]
    cfg = gpt_config(o)
    if program is None:
        program = generate(o.schedule, ranks=o.pipeline, microbatches=o.microbatches)
    owners = _owners(program)  # Chimera: program stages are replicas of fewer model stages
    n = len(set(owners))  # the model is cut into its model stages, params indexed by them
    # drawn on the CPU (the same values on every rank and device), each shard then moved
    full = gpt.split(gpt.init(cfg, seed=o.seed), cfg, n)
    shardings = gpt.shardings(cfg, n)
    mine = {owners[s] for s in program.stages_on(place.coords["pipe"])}
    low = torch.bfloat16 if o.precision == "bf16" else None  # bf16 params (float32 sums)
    params = tuple(
        _shard(full[s], shardings[s], place, device if s in mine else None, low) for s in range(n)
    )
    del full
    expert = mesh["expert"] if o.expert > 1 else None
    if cfg.experts and o.moe_tensor == "tokens" and o.tensor > 1:  # experts over expert x tensor
        expert = mesh["expert_tensor"]
    stages = _transform(gpt.stages(cfg, n, axis=axis, expert=expert), o)
    zero, note = zero_level(o, program)
    pipe, evaluate = _pipelines(o, cfg, stages, program, mesh, device, low, zero)
    template = full_meta(params)
    if zero:  # each pipeline learns the full shapes its steps rebuild (meta: nothing allocated)
        evaluate.shard(template)
    schedule = optim.warmup_cosine(
        o.lr, warmup=max(1, o.steps // 10), total=o.steps, final=o.lr / 10
    )
    opt = optim.adamw(schedule, weight_decay=0.01, master_weights=low is not None)
    state = opt.init(pipe.shard(params) if zero else params)  # zero: state of the shards only
    data_rank = place.coords["data"]  # the copy index pipe.shard cuts by (the mesh's data axis)
    rank = _Rank(
        o=o,
        device=device,
        now=now,
        cfg=cfg,
        stages=stages,
        pipe=pipe,
        evaluate=evaluate,
        opt=opt,
        weights=_clip_weights(shardings, _holders(program), o, zero),
        corpus=load_corpus(max_bytes=o.corpus_bytes),
        data_rank=data_rank,
        tag=f"tensor{axis.coord}of{o.tensor}",
        # zero: the optimizer state is this copy's flat shard of each leaf (the params are
        # saved and loaded whole, so a run resumes at any --zero and layout)
        naming=checkpoint.Naming(
            shardings=shardings, place=place, opt_shard=(o.data, data_rank) if zero else None
        ),
        first=dist.get_rank() == 0,
        zero=zero,
        zero_note=note,
        template=template,
    )
    return rank, params, state


def _pipelines(
    o: DemoOptions,
    cfg: Any,
    stages: list[Any],
    program: Program,
    mesh: Any,
    device: torch.device,
    low: torch.dtype | None,
    zero: int,
) -> tuple[Any, Any]:
    """The training pipeline and the evaluation one (its program's forwards), both over the
    world's processes, both on shards with ``zero`` 1 or 2."""
    from funcpipe.models import gpt
    from funcpipe.pipeline.pipeline import Pipeline
    from funcpipe.schedule.generators import to_eval

    loss = gpt.loss_fn(axis=mesh["tensor"])  # (with experts: plus 0.01 x the aux losses)
    on_gpu = device if device.type == "cuda" else None  # CPU: where the params are
    experts = gpt.expert_paths(cfg, len(stages))
    pipe = Pipeline(
        stages,
        program,
        loss_fn=loss,
        ties=gpt.tie_spec(len(stages)),  # model stages (Chimera: fewer than the program's)
        transport="dist",
        mesh=mesh,
        scatter_gather=o.tensor > 1,  # each tensor rank sends 1/t of every boundary tensor
        device=on_gpu,
        grad_dtype=torch.float32 if low is not None else None,
        zero=zero,
        experts=experts,
    )
    evaluate = Pipeline(  # the validation loss: the cross-entropy alone
        stages, to_eval(program), loss_fn=gpt.loss_fn(axis=mesh["tensor"], aux_weight=0.0),
        transport="dist", mesh=mesh, device=on_gpu, zero=zero, experts=experts,
    )  # fmt: skip
    return pipe, evaluate


def _resume(r: _Rank, params: Any, state: Any) -> tuple[Any, Any, int, History]:
    """``--resume``: the parameters (full), optimizer state (sharded as ``state``), step and loss
    history of the newest complete checkpoint in ``--out``; otherwise the given ones, step 0 and
    no history."""
    from funcpipe.train import checkpoint

    o = r.o
    start = 0
    history: History = {"train": [], "val": []}
    # the newest complete checkpoint: `checkpoint`, or the `checkpoint.old-*` a save killed
    # between its two renames left behind (never a half-written `.tmp-` one)
    found = checkpoint.latest(o.out) if o.resume else None
    if found is not None and checkpoint.by_names(found):  # any layout: by the model's names
        got = checkpoint.load_model(found, params, opt_state=state, naming=r.naming)
        params, state, start = got.params, got.opt_state, int(got.step or 0)
    elif found is not None and r.zero:
        raise InvalidArgument(
            f"--resume: {found!r} was written before the demo saved by names (unsharded "
            "optimizer state, its own layout only): resume it with --zero 0"
        )
    elif found is not None:  # written before the demo saved by names: its own layout only
        like = {r.tag: {"params": params, "opt": state}, "step": 0}
        loaded = checkpoint.load(found, like)
        params, state, start = loaded[r.tag]["params"], loaded[r.tag]["opt"], int(loaded["step"])
    if r.first and o.resume:
        print(
            f"resumed from step {start} ({found})"
            if found is not None
            else f"no complete checkpoint in {o.out}: starting at step 0",
            flush=True,
        )
    if found is not None:
        hist_file = os.path.join(o.out, "history.json")
        if os.path.exists(hist_file):
            with open(hist_file) as f:
                history = json.load(f)
            history = {k: [row for row in v if row[0] < start] for k, v in history.items()}
    return params, state, start, history


class _Saver:
    """The demo's checkpoints: every ``--checkpoint-every`` steps one written in the background
    (``out/checkpoint-step<N>``; the next save, or the end, waits for it), the last one at the
    end or at ``--stop-after`` (``out/checkpoint``), each with the loss history so far; after
    each, the first rank deletes all but the newest ``--keep`` complete ones."""

    def __init__(self, r: _Rank, history: History) -> None:
        self.r, self.history = r, history
        self.pending: Any = None

    def periodic(self, step: int, params: Any, state: Any) -> None:
        from funcpipe.train import checkpoint

        self._finish()
        r = self.r
        path = os.path.join(r.o.out, f"checkpoint-step{step:06d}")
        full = _full(r, params)  # (a collective with --zero 1 or 2: on this thread)
        self.pending = checkpoint.save_model_async(
            path, full, opt_state=state, naming=r.naming, step=step
        )
        if r.first:
            _write_history(r.o, self.history)

    def final(self, step: int, params: Any, state: Any) -> None:
        from funcpipe.train import checkpoint

        self._finish()
        r = self.r
        full = _full(r, params)
        checkpoint.save_model(r.ckpt_dir, full, opt_state=state, naming=r.naming, step=step)
        self._prune()
        if r.first:
            _write_history(r.o, self.history)

    def _finish(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.wait()
            self._prune()

    def _prune(self) -> None:
        import torch.distributed as dist

        from funcpipe.train import checkpoint

        if dist.get_rank() == 0:
            checkpoint.prune(self.r.o.out, self.r.o.keep)


def _train(
    r: _Rank,
    params: Any,
    state: Any,
    history: History,
    start: int,
    end: int,
    saver: _Saver,
) -> tuple[Any, Any, list[float], float]:
    """Steps ``start`` to ``end``: pipeline step, clipping, AdamW, a validation loss every
    ``--eval-every`` steps (appended to ``history``), a checkpoint every ``--checkpoint-every``
    steps (``saver``); returns the new parameters and state, each step's time and the last loss. With ``zero`` 1 or 2 the parameters, gradients and state are this
    copy's shards: the same updates, on disjoint pieces."""

    o = r.o
    tty = r.first and sys.stdout.isatty()
    step_times: list[float] = []
    last = float("nan")
    for step in range(start, end):
        x, y = r.batch("train", step)
        t0 = r.now()  # on a GPU after its queued work: the step's kernels are timed, not launches
        params, state, loss = _step(r, params, state, x, y)
        step_times.append(r.now() - t0)
        last = float(loss)
        history["train"].append([step, last])
        if o.eval_every and (step + 1) % o.eval_every == 0 and step + 1 < o.steps:
            history["val"].append([step + 1, _val_loss(r, params)])
        if o.checkpoint_every and (step + 1) % o.checkpoint_every == 0 and step + 1 < end:
            saver.periodic(step + 1, params, state)
        if r.first:
            recent = step_times[-10:]
            tps = r.tokens_per_step * len(recent) / sum(recent)
            progress(step + 1, o.steps, last, tps, tty, history["val"])
    return params, state, step_times, last


def _step(r: _Rank, params: Any, state: Any, x: Any, y: Any) -> tuple[Any, Any, Any]:
    """One training step: the pipeline's, clipping by the global norm over every rank, AdamW;
    the new parameters and state, and the step's loss."""
    import torch.distributed as dist

    from funcpipe.train import optim

    result = r.pipe.step(params, x, y)
    held = tuple(w if g is not None else None for w, g in zip(r.weights, result.grads, strict=True))
    grads, _ = optim.clip_by_global_norm(result.grads, 1.0, group=dist.group.WORLD, weights=held)
    params, state = r.opt.update(grads, state, params)
    return params, state, result.loss


def _full(r: _Rank, params: Any) -> tuple[Any, ...]:
    """Full parameters (a collective over the data copies with ``zero`` 1 or 2), meta for the stages
    this rank does not hold."""
    if not r.zero:
        return tuple(params)
    got = r.pipe.gather(params)
    return tuple(m if g is None else g for g, m in zip(got, r.template, strict=True))


def _val_loss(r: _Rank, params: Any) -> float:
    """The mean loss of ``--eval-batches`` validation batches."""
    total = 0.0
    for k in range(r.o.eval_batches):
        x, y = r.batch("val", k)
        total += float(r.evaluate.step(params, x, y).loss)
    return total / r.o.eval_batches


def _traced_step(r: _Rank, params: Any) -> tuple[Any, Any]:
    """One traced step: the executed timeline, and the simulator's fed its measured costs."""
    from funcpipe.schedule.costs import costs_from_timelines
    from funcpipe.schedule.simulate import simulate

    x, y = r.batch("train", r.o.steps)
    traced = r.pipe.step(params, x, y, trace=True).timeline
    costs = costs_from_timelines([traced]) if r.pipe.program.training else _forward_costs(traced)
    simulated = simulate(r.pipe.program, costs, p2p=r.pipe.p2p, layout=r.pipe.p2p_layout)
    return traced, simulated


def _forward_costs(timeline: Any) -> Any:
    """Per-stage median F times of an evaluation run (``--schedule forward``: no backward to
    price, which :func:`~funcpipe.schedule.costs.costs_from_timelines` refuses)."""
    import statistics

    from funcpipe.schedule.ir import Op
    from funcpipe.schedule.simulate import Costs

    n = timeline.program.n_stages
    spans: list[list[float]] = [[] for _ in range(n)]
    for e in (e for rank in timeline.events for e in rank if e.instr.op is Op.F):
        spans[e.instr.stage].append(e.end - e.start)
    return Costs(f=[statistics.median(v) if v else 0.0 for v in spans], b=0.0, w=0.0)


def _write_history(o: DemoOptions, history: History) -> None:
    os.makedirs(o.out, exist_ok=True)
    with open(os.path.join(o.out, "history.json"), "w") as f:
        json.dump(history, f)


def _summarise(
    r: _Rank,
    *,
    start: int,
    history: History,
    step_times: list[float],
    last: float,
    final_val: float,
    traced: Any,
    simulated: Any,
    peak_memory: list[int] | None,
    files: dict[str, str],
    t_start: float,
) -> dict[str, Any]:
    """The first rank's summary (throughput over the steps after the warm-up), written to
    ``summary.json`` under ``--out``."""
    from funcpipe.models import gpt

    o, cfg, device = r.o, r.cfg, r.device
    skipped = warmup_steps(len(step_times), o.compile)
    speed = throughput(
        step_times[skipped:],
        tokens_per_step=r.tokens_per_step,
        flops_per_token=gpt.flops_per_token(cfg),
        peak=peak_flops(device, o.precision.removesuffix("-autocast")),
        devices=o.world,
    )
    result = summary(
        o,
        device=str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        params=gpt.matmul_params(cfg) + cfg.context * cfg.d_model,
        stages=[repr(st) for st in r.stages],
        speed=speed,
        skipped=skipped,
        peak_memory=peak_memory,
        start=start,
        history=history,
        final_val=final_val,
        wall_s=time.perf_counter() - t_start,
        traced=traced,
        simulated=simulated,
        files=files,
        last=last,
        bytes_sent=r.pipe.bytes_sent,
    )
    result["zero"] = r.zero
    if cfg.experts:
        for key, loads in zip(("expert_load", "expert_load_init"), _expert_load(r), strict=True):
            result[key] = {str(b): v for b, v in zip(cfg.moe_blocks, loads, strict=True)}
    if r.zero_note:
        result["zero_note"] = r.zero_note
    with open(os.path.join(o.out, "summary.json"), "w") as f:
        json.dump(result, f, indent=2)
    return result


def _expert_load(r: _Rank) -> tuple[list[list[int]], list[list[int]]]:
    """Per MoE block, each expert's tokens (top-k assignments) on validation batch 0, by the
    final model read whole from its checkpoint, and by the model at initialisation (``--seed``),
    on this process."""
    from funcpipe.models import gpt
    from funcpipe.train import checkpoint
    from funcpipe.train.checkpoint_regions import tree_paths
    from funcpipe.tree import tree_flatten, tree_unflatten

    cfg = r.cfg
    saved = checkpoint.consolidate(r.ckpt_dir, dtype=torch.float32)
    like = gpt.split(gpt.init(cfg, device="meta"), cfg, 1)[0]
    tree = tree_unflatten(tree_flatten(like)[1], [saved[k] for k in tree_paths(like)])
    full = {**tree, "blocks": [tree["blocks"][str(i)] for i in range(cfg.layers)]}
    x, _ = r.batch("val", 0)
    first = gpt.init(cfg, seed=r.o.seed)
    now, then = (gpt.expert_load(p, cfg, x.cpu()).tolist() for p in (full, first))
    return now, then


# ------------------------------------------------------------------------------ pieces
def _shard(
    tree: Any,
    shardings: Any,
    place: Any,
    device: torch.device | None,
    dtype: torch.dtype | None = None,
) -> Any:
    """This rank's shard of ``tree`` on ``device`` (``None``: a stage it does not run, meta), in
    ``dtype`` if given."""
    from funcpipe.parallel.sharding import shard_tree
    from funcpipe.tree import tree_map

    sharded = shard_tree(tree, shardings, place)
    where = torch.device("meta") if device is None else device
    return tree_map(lambda t: t.to(where, dtype), sharded)


def _owners(program: Program) -> tuple[int, ...]:
    """The model stage whose params each program stage runs (itself but for Chimera's
    replicas)."""
    return tuple(program.replica_of or range(program.n_stages))


def _holders(program: Program) -> list[int]:
    """Per model stage, how many pipeline ranks hold it (Chimera: each replica's rank; their
    gradients are summed, so every holder has the same total)."""
    owners = _owners(program)
    held = [{owners[s] for s in program.stages_on(r)} for r in range(program.n_ranks)]
    return [sum(o in h for h in held) for o in range(len(set(owners)))]


def _clip_weights(shardings: Any, holders: list[int], o: DemoOptions, zero: int) -> Any:
    """Each leaf's share of the global norm over the world: 1/tensor for leaves every tensor
    rank holds, 1/data for the data copies (``zero`` 1 or 2: 1, the copies hold disjoint pieces), 1/2
    for the two tied copies of the embedding, 1/k for a model stage ``k`` pipeline ranks hold
    (Chimera's replicas, summed gradients on each). ``holders``: :func:`_holders`."""
    from funcpipe.parallel.sharding import Sharding
    from funcpipe.tree import tree_map

    def weight(lay: Sharding, holders: int) -> float:
        if "expert" in lay.axes:  # held by the data / expert copies holding these experts
            across = 1 if "tensor" in lay.axes else o.tensor  # (split over tensor: no replicas)
            return (1.0 if zero else o.expert / o.data) / across / holders  # (zero: pieces)
        sharded = any(lay.dims)
        return (1.0 if sharded else 1.0 / o.tensor) / (1 if zero else o.data) / holders

    out = []
    for lay, k in zip(shardings, holders, strict=True):
        w = tree_map(partial(weight, holders=k), lay)
        if len(shardings) > 1 and "wte" in w:
            w = {**w, "wte": w["wte"] * 0.5}
        out.append(w)
    return tuple(out)


def _rank_device(o: DemoOptions) -> torch.device:
    """This rank's device: the CPU, or the GPU the launcher (or its torchrun path) made current
    before the process group started (:func:`funcpipe.distributed.launcher.rank_device`)."""
    if o.device != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.reset_peak_memory_stats(device)
    return device


def _transform(stages: list[Any], o: DemoOptions) -> list[Any]:
    """The stages under ``--precision`` and ``--compile``: autocast inside, compile outside (the
    compiled graph then holds the casts)."""
    from funcpipe.stages.compile import compile_stage
    from funcpipe.stages.precision import autocast_stage

    if o.precision == "bf16-autocast":
        stages = [autocast_stage(s, torch.bfloat16) for s in stages]
    if o.compile:
        backend = {} if o.compile_backend == COMPILE_BACKEND else {"backend": o.compile_backend}
        stages = [compile_stage(s, **backend) for s in stages]
    return stages


def _peak_memory(device: torch.device) -> list[int] | None:
    """Every rank's ``torch.cuda.max_memory_allocated`` (bytes) on rank 0; None on the CPU."""
    import torch.distributed as dist

    if device.type != "cuda":
        return None
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, int(torch.cuda.max_memory_allocated(device)))
    return [int(v) for v in out]
