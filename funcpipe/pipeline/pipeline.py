"""The user-facing step: stages + schedule + loss -> (loss, grads).

:class:`Pipeline` lowers and checks the program once, infers the shapes crossing stages for each
new microbatch shape, and runs the interpreter on every rank: all in this process
(``transport="local"``, the default without a process group) or one rank per process over
``torch.distributed`` (``transport="dist"``, wired by :mod:`funcpipe.distributed.world`). ``step`` is pure:
params and batch in, loss and a fresh gradient pytree out.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from funcpipe.distributed import world as _world
from funcpipe.errors import InvalidArgument
from funcpipe.pipeline import agreement as _agreement
from funcpipe.pipeline import checks as _validate
from funcpipe.pipeline import experts as _experts
from funcpipe.pipeline import zero as _zero
from funcpipe.pipeline.lowering import local_groups, lower_program, p2p_rules
from funcpipe.pipeline.microbatch import split, split_targets
from funcpipe.pipeline.rank_inputs import param_leaves, place, split_batch, to_device
from funcpipe.pipeline.result import (
    StepResult,
    dist_scalars,
    executed_timeline,
    local_scalars,
    merged_outputs,
    merged_tallies,
    stage_grads,
    traced_timeline,
)
from funcpipe.runtime.drive import drive_local
from funcpipe.runtime.interpreter import RankInputs, run_rank
from funcpipe.runtime.transport import LocalWorld
from funcpipe.schedule.ir import Op, Program
from funcpipe.schedule.p2p import PAIR
from funcpipe.stages.boundaries import BoundarySpecs, infer_boundaries, signature
from funcpipe.stages.stage import Stage
from funcpipe.stages.ties import TiePath, resolve, tie_values
from funcpipe.tree import tree_flatten

__all__ = ["Pipeline", "StepResult"]  # StepResult: defined in funcpipe.pipeline.result


LAYOUT_CACHE = 256  # microbatch signatures whose shape inference a Pipeline keeps

Tensor = torch.Tensor


class Pipeline:
    """Run a schedule over stages: ``step(params, batch, targets) -> (loss, grads)``.

    Args:
        stages: one :class:`~funcpipe.Stage` per model stage (for Chimera, per logical stage).
        schedule: a :class:`~funcpipe.schedule.Program`, compute-only or lowered. It runs as
            written: lowering adds only what it must (communication, recompute, reductions),
            and the trace of a step shows exactly those instructions.
        loss_fn: ``loss_fn(outputs, targets)`` (``loss_fn(outputs)`` without targets), run with
            the last stage: a scalar (the step's loss is its mean over microbatches) or a ``(sum,
            count)`` pair (:func:`funcpipe.token_cross_entropy`: total sum over total count).
        metric_fn: like ``loss_fn``, not differentiated; its mean over microbatches is returned
            as ``result.metric``.
        ties: ``{"name": [(stage, path), (stage, path), ...]}``: parameters that are one and the
            same; their gradients are summed. In one process the first listed value is used for
            all of them; over processes each copy must hold that value (checked at the first
            step: copies that differ are refused, naming them and their processes).
        side_inputs: ``{stage: ["mask", ...]}``: fields of the batch (then a dict, whose field
            ``"inputs"`` is the first stage's input) passed to that stage as keyword arguments,
            split into microbatches like the batch.
        recompute: ``True`` or a list of stages whose activations are recomputed before backward.
        data: in-process data parallelism: the number of pipeline replicas (``transport="local"``).
        dim: the batch dimension (int, or a pytree of ints matching the batch).
        transport: ``"local"`` (every rank in this process) or ``"dist"`` (this process is one
            rank; ``torch.distributed`` must be initialised). Default: ``"dist"`` when a process
            group exists, else ``"local"``. With ``"dist"`` the world holds ``k`` copies of the
            program (data parallelism): world rank ``g`` runs program rank ``g // k`` of copy
            ``g % k``.
        mesh: a :class:`funcpipe.parallel.Mesh` (``"dist"`` only) whose ``pipe`` size equals the
            program's ranks: then each program rank is a tensor-parallel group of processes,
            world rank ``(rank * data + copy) * tensor + coord``; stage functions use the mesh's
            tensor (and expert) axes for their collectives.
        experts: ``[(stage, path), ...]``: the leaves split over the mesh's ``expert`` axis
            (:mod:`funcpipe.pipeline.experts`): summed over the copies holding the same experts.
        scatter_gather: with ``mesh`` (tensor size ``t`` > 1): each tensor-parallel rank sends
            only its ``1/t`` slice of a stage boundary's activation (and gradient) and the
            receivers all-gather it, cutting point-to-point bytes by ``t``. Only valid when what
            crosses stages is replicated over the tensor ranks (true of a Megatron-style
            residual stream).
        check_finite: raise :class:`~funcpipe.errors.NonFiniteError` naming the stage and the
            microbatch where a NaN or an infinity first appears (loss, outputs, gradients).
            Default: on when the environment sets ``FUNCPIPE_DEBUG=1``. Costs one reduction per
            tensor.
        device: where received tensors are placed (default: where the params are).
        zero: ``1`` (ZeRO-1, :mod:`funcpipe.pipeline.zero`): :meth:`shard` params once, then
            ``step`` takes and returns data-parallel shards, :meth:`gather` rebuilds params;
            ``2`` (ZeRO-2) also reduce-scatters each microbatch's gradients at once. Default 0.
        grad_dtype: sum the gradients of lower-precision floating parameters (bf16, float16)
            in this dtype across microbatches and return them in it (``torch.float32``: what
            mixed-precision training wants; see docs/pipeline.md). The stage still computes
            with each parameter in its own dtype (cast once per step, never per microbatch).
            Default: gradients in each parameter's dtype.

    Over ``"dist"``, stages talk over ``torch.distributed`` send/recv on one process group per
    pair of ranks (gloo on CPU, NCCL on CUDA; :mod:`funcpipe.distributed.world`): the same calls
    on a CPU as on GPUs. :meth:`close` (or a ``with`` block) releases what the Pipeline holds: its
    threads, and the process groups no other open Pipeline or mesh uses (every process closes
    its Pipelines in the same order). A Pipeline that is only dropped frees its threads, and
    leaves its process groups to the next Pipeline of the same layout
    (:mod:`funcpipe.distributed.groups`).
    """

    #: The communicator layout of this pipeline's transports, which its program is checked
    #: under: one process group per pair of ranks that exchange messages (both transports,
    #: :class:`~funcpipe.runtime.transport.LocalWorld` and the one :func:`funcpipe.distributed.world.join`
    #: builds, have it; :mod:`funcpipe.schedule.p2p`).
    p2p_layout = PAIR

    def __init__(
        self,
        stages: Sequence[Stage],
        schedule: Program,
        *,
        loss_fn: Callable[..., Tensor] | None = None,
        metric_fn: Callable[..., Tensor] | None = None,
        ties: Mapping[str, Sequence[TiePath]] | None = None,
        side_inputs: Mapping[int, Sequence[str]] | None = None,
        recompute: bool | Sequence[int] = False,
        data: int = 1,
        dim: Any = 0,
        transport: str | None = None,
        mesh: Any = None,
        scatter_gather: bool = False,
        check_finite: bool | None = None,
        device: torch.device | str | None = None,
        grad_dtype: torch.dtype | None = None,
        zero: int = 0,
        experts: Sequence[TiePath] | None = None,
    ) -> None:
        checked = _validate.arguments(
            stages,
            schedule,
            loss_fn=loss_fn,
            metric_fn=metric_fn,
            ties=ties,
            side_inputs=side_inputs,
            data=data,
            transport=transport,
            mesh=mesh,
            scatter_gather=scatter_gather,
            device=device,
            grad_dtype=grad_dtype,
        )
        self.stages, self.ties, self.device = checked.stages, checked.ties, checked.device
        self.transport = transport = checked.transport
        self.loss_fn, self.metric_fn, self.dim = loss_fn, metric_fn, dim
        self.side_inputs = checked.side_inputs
        if schedule.replica_of:  # Chimera: a model stage's side inputs reach all its replicas
            self.side_inputs = {
                slot: self.side_inputs[o]
                for slot, o in enumerate(schedule.replica_of)
                if o in self.side_inputs
            }
        self.data = data
        self._loss_arity = _validate.loss_arity(loss_fn)
        self._checked = False  # the first step's checks (shared storage, inference params)
        self.grad_dtype = grad_dtype
        self.mesh = mesh
        self.scatter_gather = bool(scatter_gather)
        self.check_finite = _validate.finite_default(check_finite)
        copies = _world.sizes(schedule.n_ranks, mesh)[0] if transport == "dist" else data
        self.zero = _zero.check_zero(zero, copies)
        self.experts = _experts.check_experts(
            experts, len(self.stages), mesh=mesh, transport=transport, ties=self.ties
        )
        self._expert_leaves: dict[int, frozenset[int]] | None = None
        self._full: tuple[Any, ...] | None = None  # the full params' shapes (zero: shard())
        self.program = lower_program(
            schedule,
            recompute=recompute,
            ties=self.ties,
            data_parallel=copies > 1,
            p2p=p2p_rules(self.device, self.transport),
            layout=self.p2p_layout,
            zero=self.zero,
        )
        self.recompute = frozenset(i.stage for r in self.program.ranks for i in r if i.op is Op.R)
        # shape inference per microbatch signature, most recently used last (bounded: a batch
        # whose length changes every step must not grow it without end)
        self._layouts: OrderedDict[Any, BoundarySpecs] = OrderedDict()
        # over processes: each cached signature's (given, inferred) fingerprints
        self._prints: dict[Any, tuple[int, int]] = {}
        self._world: _world.DistWorld | None = None
        self.closed = False
        self.data_size, self.tensor_size = 1, 1
        if transport == "dist":
            # before join: ranks holding different programs would create different groups
            _agreement.program_agreement(_agreement.summary(self, mesh))
            self._world = _world.join(self.program, mesh=mesh, scatter_gather=self.scatter_gather)
            self.rank, self.pipe_ranks = self._world.rank, self._world.pipe_ranks
            self.data_size, self.tensor_size = self._world.data, self._world.tensor
            if self._world.transport.layout != self.p2p_layout:
                raise RuntimeError(  # (the program was checked under p2p_layout)
                    f"funcpipe internal error: the transport's communicator layout "
                    f"{self._world.transport.layout!r} is not {self.p2p_layout!r}"
                )

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Release this Pipeline's threads and process groups (``"dist"``; a no-op
        otherwise, and when closed already). Collective: every process closes its Pipelines in
        the same order, after their last step. Stepping a closed Pipeline is an error."""
        if self.closed:
            return
        self.closed = True
        if self._world is not None:
            self._world.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ program
    @property
    def p2p(self) -> str:
        """The point-to-point rules (``"nccl"`` or ``"gloo"``, on the communicators
        :attr:`p2p_layout`) the program is checked and simulated under."""
        return p2p_rules(self.device, self.transport)

    # ------------------------------------------------------------------ step
    def step(
        self,
        params: Sequence[Any],
        batch: Any,
        targets: Any = None,
        *,
        return_outputs: bool = False,
        trace: bool = False,
        loss_scale: float | Tensor | None = None,
        seed: int | None = None,
    ) -> StepResult:
        """One training step (or one evaluation, for an eval program): ``(loss, grads)``.

        ``loss_scale``: multiply the loss's gradient by this (loss scaling for float16, see
        :mod:`funcpipe.train.loss_scale`): the gradients come back scaled by it, the loss does not. A
        one-element tensor (``LossScaleState.scale``) is used where it is, without reading it,
        so the step does not wait for the device.

        ``seed``: a training step's stage calls run under keys of it (docs/concepts.md, "Random
        keys"); ``None``: drawn from torch's CPU generator (over processes: process 0's).

        With ``trace=True`` every rank records when each instruction starts and ends and
        ``result.timeline`` is the executed :class:`funcpipe.schedule.Timeline` (over processes
        it is gathered to every rank; all ranks must pass the same ``trace``). A traced step
        runs exactly the instructions an untraced one runs, in the same order; in one process
        the ranks run one after the other, so its timeline shows the interleaving, not
        parallelism.

        ``params[k]`` is stage k's params pytree; with ``transport="dist"`` the stages this rank
        does not hold may be meta tensors (only their shapes are read). ``grads`` has the same
        structure, with ``None`` for stages this rank does not hold. ``loss`` (and ``metric``) is
        the mean over microbatches, on every rank (over processes it is summed across ranks in
        float64 and returned as float64; in one process it keeps the loss's dtype).
        """
        if self.closed:
            raise InvalidArgument(
                "this Pipeline was closed (close() or the end of its with block); build a new "
                "one to step again"
            )
        training = self.program.training
        _validate.autograd_context(training)
        shards, zin = params, None  # zero: (every copy's full leaves to gather into, pieces)
        if self.zero:
            zin = _zero.pipe_unshard(self, params)
            params = zin[0][0]
        else:
            params = self._check_params(params)
        scale = _validate.step_loss_scale(loss_scale)
        self._check_step(params, batch, targets, shards if self.zero else params)
        explicit, seed = seed is not None, _validate.step_seed(seed, training)
        # like reference_step: a step inside torch.no_grad() still computes true gradients
        with torch.enable_grad() if training else contextlib.nullcontext():
            return self._step(
                params, batch, targets, return_outputs, trace, scale, seed, explicit, zin
            )

    def _check_step(self, params: tuple[Any, ...], batch: Any, targets: Any, held: Any) -> None:
        """Checks of a step's arguments before any work (:mod:`funcpipe.pipeline.checks`); those that
        walk every parameter run on the first step only."""
        training = self.program.training
        if not self._checked:
            tied = {
                (s, resolve(params[s], path, f"ties[{name!r}]")): name
                for name, members in self.ties.items()
                for s, path in members
            }
            _validate.shared_storage(params, tied)
            if self._world is not None:
                # every copy of a tied parameter holds one value (collective); zero: copies
                # hold other pieces, compared within a copy and tensor coordinate
                copies = _agreement.tie_copies(self.program, self.rank, self.ties, held)
                _agreement.tie_agreement(
                    copies, self.tensor_size * (self.data_size if self.zero else 1)
                )
            if training:
                for k, p in enumerate(params):
                    _validate.inference_tensors(p, f"params[{k}]")
            self._checked = True
        if not self._dry:
            _validate.meta_inputs(batch, "batch")
            if targets is not None:
                _validate.meta_inputs(targets, "targets")
        if training:
            _validate.inference_tensors(batch, "batch")
        if self.loss_fn is not None:
            _validate.loss_targets(self._loss_arity, self.loss_fn, targets is not None, training)

    def _step(
        self,
        params: tuple[Any, ...],
        batch: Any,
        targets: Any,
        return_outputs: bool,
        trace: bool,
        scale: float | Tensor,
        seed: int | None = None,
        explicit: bool = False,
        zin: Any = None,
    ) -> StepResult:
        program = self.program
        m = program.microbatches
        if self._world is None:
            return self._step_local(params, batch, targets, return_outputs, trace, scale, seed, zin)
        entry, side, tgt, layouts, seed = self._microbatches(params, batch, targets, seed, explicit)
        x = self._rank_inputs(self.rank, params, entry, side, tgt, layouts, return_outputs)
        if zin is not None:
            x.shards, x.copy = zin[1][0], self._world.copy
        x.data_size, x.tally_group = self.data_size, "data"  # (one copy: no such group, a no-op)
        x.seed, x.microbatch_offset = seed, self._world.copy * m
        x.trace, x.loss_scale = trace, scale
        if self.loss_fn is not None or self.metric_fn is not None:
            x.scalars_group = _world.SCALARS
        result = self._world.drive(run_rank(x, self._world.transport))
        # every data copy adds its loss; every tensor coordinate holds the same loss
        loss, metric, factor = dist_scalars(
            result,
            m,
            self.data_size,
            self.tensor_size,
            has_loss=self.loss_fn is not None,
            has_metric=self.metric_fn is not None,
        )
        grads = stage_grads(self.program, params, [result], factor)
        grads = grads if zin is None else _zero.mark_pieces(grads, self._world.copy, self.data_size)
        outputs = merged_outputs(program, [result]) if return_outputs else None
        step = StepResult(loss, grads, metric, outputs)
        step.peak_activations, step.tallies = {self.rank: result.peak_activations}, result.tallies
        if trace:
            times, spans = _world.gather_times(program, self._world, result.times, result.spans)
            step.timeline = executed_timeline(program, times, spans)
        return step

    def _step_local(
        self,
        params: tuple[Any, ...],
        batch: Any,
        targets: Any,
        return_outputs: bool,
        trace: bool,
        scale: float | Tensor,
        seed: int | None = None,
        zin: Any = None,
    ) -> StepResult:
        program = self.program
        n, m = program.n_ranks, program.microbatches
        per_copy = zin[0] if zin is not None else [params] * self.data
        if self.data > 1:
            _validate.data_shares(batch, self.dim, self.data, m)
        shards = split(batch, self.data, dim=self.dim) if self.data > 1 else [batch]
        tshards = (
            split(targets, self.data, dim=0)
            if (targets is not None and self.data > 1)
            else [targets] * self.data
        )
        groups = local_groups(self.program, self.data)
        scalars = self.loss_fn is not None or self.metric_fn is not None
        if scalars:  # the loss reduction a "dist" step posts, at the same place (see step)
            groups[_world.SCALARS] = [list(range(n * self.data))]
        world = LocalWorld(n * self.data, groups=groups)
        gens = {}
        for d in range(self.data):
            entry, side, tgt, layouts, _ = self._microbatches(params, shards[d], tshards[d])
            ranks = [d * n + k for k in range(n)]
            for r in range(n):
                mine = per_copy[d] if zin is None else _zero.for_rank(self, per_copy[d], r)
                x = self._rank_inputs(r, mine, entry, side, tgt, layouts, return_outputs)
                if zin is not None:
                    x.shards, x.copy = zin[1][d], d
                x.trace, x.loss_scale = trace, scale
                x.seed, x.microbatch_offset = seed, d * m
                if scalars:
                    x.scalars_group = _world.SCALARS
                gens[ranks[r]] = run_rank(x, world.transport(r, ranks))
        results = drive_local(gens, world=world)
        per_rank = [results[r] for r in range(n)]  # replica 0 answers
        loss, metric, factor = local_scalars(list(results.values()), m, self.data)
        grads: Any
        if zin is not None:  # every copy's gradient shards (each scaled once: in place)
            by_copy = [[results[d * n + r] for r in range(n)] for d in range(self.data)]
            grads = [
                _zero.Shards(stage_grads(program, per_copy[d], by_copy[d], factor), d, self.data)
                for d in range(self.data)
            ]
        else:
            grads = stage_grads(program, params, per_rank, factor)
        out = StepResult(
            loss, grads, metric, merged_outputs(program, per_rank) if return_outputs else None
        )
        out.peak_activations = {r: res.peak_activations for r, res in enumerate(per_rank)}
        out.tallies = merged_tallies(results.values())  # (every rank and copy: all of them)
        if trace:
            out.timeline = traced_timeline(program, per_rank)
        return out

    # ------------------------------------------------------------------ sharded (zero=1, 2)
    def shard(self, params: Sequence[Any]) -> Any:
        """``params`` cut into :class:`~funcpipe.pipeline.zero.Shards` for ``zero`` 1 or 2 (no
        communication): over processes this process's copy's (per stage 1-D pieces; meta for
        stages it does not hold), in one process a list of every copy's. Keeps the full shapes."""
        if not self.zero:
            raise InvalidArgument("shard(params) is for Pipeline(zero=1 or 2); pass params to step")
        _zero.check_full(params, self._full)
        params = self._check_params(params)
        self._full = _zero.full_meta(params)
        return _zero.pipe_shard(self, params)

    def gather(self, shards: Any) -> tuple[Any, ...]:
        """Full params from ``zero`` 1 or 2 shards: over processes a collective of every process
        (``None`` for the stages this one does not hold); in one process from every copy's."""
        return _zero.pipe_gather(self, shards)

    def held(self, tree: Sequence[Any]) -> tuple[Any, ...]:
        """``tree`` (one entry per stage, such as params) with meta tensors at the stages this
        process does not hold (none in one process): what each one inits, steps and saves."""
        return _zero.held_only(self, tree)

    @property
    def bytes_sent(self) -> int:
        """Bytes this process handed to point-to-point sends so far (``"dist"`` only)."""
        if self._world is None:
            return 0
        return int(getattr(self._world.transport, "bytes_sent", 0))

    def __call__(
        self, params: Sequence[Any], batch: Any, targets: Any = None, **kw: Any
    ) -> StepResult:
        return self.step(params, batch, targets, **kw)

    # ------------------------------------------------------------------ pieces
    def _check_params(self, params: Sequence[Any]) -> tuple[Any, ...]:
        params = _validate.stage_params(params, len(self.stages))
        if self.ties and self.transport == "local":
            params = tie_values(params, self.ties)
        return params

    def _microbatches(
        self,
        params: tuple[Any, ...],
        batch: Any,
        targets: Any,
        seed: int | None = None,
        explicit: bool = False,
    ) -> tuple[
        list[tuple[Any, ...]],
        list[dict[int, dict[str, Any]]],
        list[Any] | None,
        list[BoundarySpecs],
        int | None,
    ]:
        m = self.program.microbatches
        entry, side, batch = split_batch(batch, self.side_inputs, m, self.dim)
        tgt = None if targets is None else split_targets(targets, m, batch=batch, dim=self.dim)
        layouts = []
        full = self._full_stages()
        fparams = [params[o] for o in (self.program.replica_of or range(self.program.n_stages))]
        psig = signature(fparams)  # a stage's outputs may follow its params' dtypes
        cache, prints = self._layouts, self._prints
        dist = self._world is not None
        error: BaseException | None = None
        mine: list[tuple[int, int]] = []  # each microbatch's fingerprints (what processes compare)
        for k in range(m):
            key = (signature(entry[k]), signature(side[k]), psig)
            layout = cache.get(key)
            if layout is None:
                try:
                    layout = infer_boundaries(
                        self.program, full, fparams, entry[k], side[k], device=self._place(params)
                    )
                except Exception as e:
                    if not dist:
                        raise
                    error, layout = e, {}  # the other processes must not wait for this one
                else:
                    cache[key], prints[key] = layout, _agreement.microbatch_prints(key, layout)
                    while len(cache) > LAYOUT_CACHE:
                        prints.pop(cache.popitem(last=False)[0], None)
            else:
                cache.move_to_end(key)
            mine.append(prints.get(key) or _agreement.microbatch_prints(key, None))
            layouts.append(layout)
        if dist:
            # every process, every step, whatever its batch: one whose batch changed alone
            # must not wait alone in a collective (funcpipe.pipeline.agreement)
            names = [st.name for st in full]
            # the step's seed is process 0's (seeds passed explicitly must agree)
            seed = _agreement.step_agreement(
                mine, error, (batch, params), layouts, names, seed=seed, explicit=explicit
            )
        return entry, side, tgt, layouts, seed

    @property
    def _dry(self) -> bool:
        """``device="meta"``: a step without data (every tensor on meta), to check a setup."""
        return self.device is not None and self.device.type == "meta"

    def _place(self, params: tuple[Any, ...], local: Sequence[int] | None = None) -> torch.device:
        """Where a rank's tensors live (:func:`funcpipe.pipeline.rank_inputs.place`)."""
        return place(self.device, params, local, self._world is not None)

    def _full_stages(self) -> list[Stage]:
        return [self.stages[o] for o in (self.program.replica_of or range(self.program.n_stages))]

    def _rank_inputs(
        self,
        rank: int,
        params: tuple[Any, ...],
        entry: list[tuple[Any, ...]],
        side: list[dict[int, dict[str, Any]]],
        tgt: list[Any] | None,
        layouts: list[BoundarySpecs],
        keep: bool,
    ) -> RankInputs:
        p = self.program
        owners = p.replica_of or tuple(range(p.n_stages))
        local = p.stages_on(rank)
        prm: dict[int, tuple[list[Tensor], Any]] = {}
        casts: dict[int, tuple[torch.dtype | None, ...]] = {}
        for s in local:
            o = owners[s]
            if o not in prm:
                leaves, tree = tree_flatten(params[o])
                if any(t.is_meta for t in leaves) and not self._dry:
                    raise InvalidArgument(
                        f"params[{o}] is on the meta device but rank {rank} runs stage {s}"
                    )
                held, cast = param_leaves(leaves, training=p.training, grad_dtype=self.grad_dtype)
                prm[o] = (held, tree)
                if cast is not None:
                    casts[o] = cast
        device = self._place(params, local=[owners[s] for s in local])
        # this rank's part of the batch goes where its stages run, once per microbatch
        if any(not p.producers(s) for s in local):
            entry = [to_device(e, device) for e in entry]
        side = [{s: to_device(kw, device) for s, kw in sd.items() if s in local} for sd in side]
        if tgt is not None and any(not p.consumers(s) for s in local):
            tgt = [to_device(t, device) for t in tgt]
        ties: dict[str, list[tuple[int, int]]] = {}
        for name, members in self.ties.items():
            ties[name] = [(s, resolve(params[s], path, f"ties[{name!r}]")) for s, path in members]
        if self._expert_leaves is None:
            ep = _experts.expert_size(self.mesh)
            self._expert_leaves = _experts.expert_leaves(params, self.experts, ep)
        return RankInputs(
            program=p,
            rank=rank,
            stages={s: self.stages[owners[s]] for s in local},
            params=prm,
            entry=entry,
            side=side,
            targets=tgt,
            layouts=layouts,
            loss_fn=self.loss_fn,
            metric_fn=self.metric_fn,
            recompute=self.recompute,
            keep_outputs=keep,
            device=device,
            check_finite=self.check_finite,
            ties=ties,
            data_size=self.data,
            casts=casts,
            experts=self._expert_leaves,
            expert_size=_experts.expert_size(self.mesh),
        )
