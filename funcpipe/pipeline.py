"""The user-facing step: stages + schedule + loss -> (loss, grads).

:class:`Pipeline` lowers and checks the program once, infers the shapes crossing stages for each
new microbatch shape, and runs the interpreter on every rank: all in this process
(``transport="local"``, the default without a process group) or one rank per process over
``torch.distributed`` (``transport="dist"``). ``step`` is pure: params and batch in, loss and a
fresh gradient pytree out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import torch

from funcpipe.errors import CommunicationError, InvalidArgument
from funcpipe.microbatch import split, split_targets
from funcpipe.runtime.interpreter import RankInputs, RankResult, run_rank
from funcpipe.runtime.plan import Layout, infer_layout, signature
from funcpipe.runtime.reuse import GradMemory
from funcpipe.runtime.transport import DistTransport, Handle, LocalWorld, Transport
from funcpipe.schedule.check import check, in_program
from funcpipe.schedule.ir import Op, Program, reduce
from funcpipe.schedule.passes import add_communication, add_recompute, add_reduce
from funcpipe.stage import Stage, as_inputs
from funcpipe.tree import check_tensor_tree, tree_flatten, tree_unflatten

__all__ = ["Pipeline", "StepResult"]

SCALARS = "<loss>"  # the transport group of the step's loss and metric reduction
LAYOUT_CACHE = 256  # microbatch signatures whose shape inference a Pipeline keeps

Tensor = torch.Tensor
TiePath = tuple[int, Any]  # (stage, key or dotted path or tuple of keys)


class StepResult(tuple[Any, Any]):
    """``(loss, grads)``, with ``.metric`` and ``.outputs`` when they were asked for."""

    loss: Tensor | None
    grads: tuple[Any, ...]
    metric: Tensor | None
    outputs: Any
    peak_activations: dict[int, int]  # program rank -> most activations it kept at once
    timeline: Any  # with trace=True: the executed funcpipe.schedule.Timeline

    def __new__(
        cls,
        loss: Tensor | None,
        grads: tuple[Any, ...],
        metric: Tensor | None = None,
        outputs: Any = None,
    ) -> StepResult:
        self = super().__new__(cls, (loss, grads))
        self.loss, self.grads, self.metric, self.outputs = loss, grads, metric, outputs
        self.peak_activations = {}
        self.timeline = None
        return self

    def __repr__(self) -> str:
        return f"StepResult(loss={self.loss!r}, metric={self.metric!r}, grads=<{len(self.grads)} stages>)"


def _diff(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _drive_local(gens: Mapping[int, Generator[Handle, None, RankResult]]) -> dict[int, RankResult]:
    """Run every rank's generator in this thread, switching ranks whenever one has to wait."""
    waiting: dict[int, Handle | None] = dict.fromkeys(gens)
    results: dict[int, RankResult] = {}
    while len(results) < len(gens):
        progressed = False
        for r, gen in gens.items():
            if r in results:
                continue
            h = waiting[r]
            if h is not None and not h.ready():
                continue
            progressed = True
            try:
                waiting[r] = next(gen)
            except StopIteration as stop:
                results[r] = stop.value
        if not progressed:
            blocked = sorted(r for r in gens if r not in results)
            raise CommunicationError(
                f"ranks {blocked} all wait for data that no rank will send (a deadlock the "
                "checker did not see; please report this with the program)"
            )
    return results


def _drive(gen: Generator[Handle, None, RankResult]) -> RankResult:
    try:
        h = next(gen)
        while True:
            h.wait()
            h = gen.send(None)
    except StopIteration as stop:
        return stop.value


def _resolve(params: Any, path: Any, where: str) -> int:
    """Index among the flattened leaves of ``params`` of the leaf at ``path``."""
    node = params
    keys: Sequence[Any]
    if isinstance(path, tuple):
        keys = path
    elif isinstance(params, Mapping) and path in params:
        keys = (path,)
    elif isinstance(path, str):
        keys = path.split(".")
    else:
        keys = (path,)
    try:
        for k in keys:
            node = node[k] if not isinstance(node, (list, tuple)) else node[int(k)]
    except (KeyError, IndexError, TypeError, ValueError):
        raise InvalidArgument(
            f"{where}: path {path!r} does not name a leaf of that stage's params"
        ) from None
    leaves, _ = tree_flatten(params)
    for i, leaf in enumerate(leaves):
        if leaf is node:
            return i
    raise InvalidArgument(f"{where}: path {path!r} names a subtree, not one tensor")


class Pipeline:
    """Run a schedule over stages: ``step(params, batch, targets) -> (loss, grads)``.

    Args:
        stages: one :class:`~funcpipe.Stage` per model stage (for Chimera, per logical stage).
        schedule: a :class:`~funcpipe.schedule.Program`, compute-only or lowered.
        loss_fn: ``loss_fn(outputs, targets) -> scalar`` (or ``loss_fn(outputs)`` when no targets
            are passed), run where the last stage runs. The step's loss is the mean over
            microbatches of this value.
        metric_fn: like ``loss_fn``, not differentiated; its mean over microbatches is returned
            as ``result.metric``.
        ties: ``{"name": [(stage, path), (stage, path), ...]}``: parameters that are one and the
            same. The first listed value is used for all of them and their gradients are summed.
        side_inputs: ``{stage: ["mask", ...]}``: fields of the batch (then a dict) passed to that
            stage as keyword arguments, split into microbatches like the batch.
        inputs: with ``side_inputs``, the batch key fed to the first stage (default ``"inputs"``).
        recompute: ``True`` or a list of stages whose activations are recomputed before backward.
        data: in-process data parallelism: the number of pipeline replicas (``transport="local"``).
        dim: the batch dimension (int, or a pytree of ints matching the batch).
        transport: ``"local"`` (every rank in this process) or ``"dist"`` (this process is one
            rank; ``torch.distributed`` must be initialised). Default: ``"dist"`` when a process
            group exists and has as many ranks as the program, else ``"local"``.
            With ``"dist"`` the world holds ``k`` copies of the program (data parallelism):
            world rank ``g`` runs program rank ``g // k`` of copy ``g % k``.
        mesh: a :class:`funcpipe.parallel.Mesh` (``"dist"`` only) whose ``pipe`` size equals the
            program's ranks: then each program rank is a tensor-parallel group of processes,
            world rank ``(rank * data + copy) * tensor + coord``; stage functions use the mesh's
            tensor axes for their collectives.
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
        p2p: how ``"dist"`` moves activations and gradients between ranks. ``"auto"`` (default):
            CPU tensors between processes of one host go over Unix-domain sockets
            (:mod:`funcpipe.runtime.sockets`; 7-18 us per message against gloo's 0.13-2 ms), anything
            else over ``torch.distributed`` send/recv. ``"torch"``: always
            ``torch.distributed``. Every process must pass the same value.
        batch_weights: where a program's whole backwards (B) would leave the weight gradients
            of ``nn.Linear``-shaped products for several microbatches in a row without the rank
            keeping more activations than the program's own peak (all of GPipe's, the drain of
            1F1B), compute each such weight gradient once over all those microbatches' rows
            instead of once per microbatch (:mod:`funcpipe.runtime.linear`). Same gradients
            up to rounding (the sum is ordered differently). ``False``: one per microbatch.
            ``check_finite`` turns the batching off (a NaN is reported with its microbatch).
        batch_weights_extra: with ``batch_weights``, let each rank keep up to this many
            activations more than the program's peak waiting for a batched weight-gradient sum
            (default 0: never above the program's peak). A waiting B keeps each Linear's input
            and incoming gradient, about one activation of an MLP stage; in exchange 1F1B's
            steady state sums its weight gradients over up to ``batch_weights_extra + 1``
            microbatches at once instead of one by one. ``step(...).peak_activations`` reports
            what was kept. Where ``stage_weights`` applies it already sums once per step, at no
            memory cost: this then matters only for products whose rows do not fit.
        stage_weights: with ``batch_weights``, sum each such weight gradient once per step:
            each B or W only copies its rows (the Linear's input and incoming gradient) into
            the gradient's own memory, which holds nothing else until that sum is computed in
            place, when the gradient is first read (a REDUCE, the end of the step)
            (:mod:`funcpipe.runtime.staging`). No activation is kept longer and nothing
            weight-sized is allocated. It applies while a rank's rows for that weight in one
            step fit in half the gradient's memory (``rows * (in + out) <= in * out / 2``,
            e.g. 128 rows for a 512 x 512 Linear); the rest is summed as without it. On CPU
            8-row products are bound by memory traffic: the small benchmark's steps took
            0.83-0.87x the time on 2 ranks for the non-GPipe schedules, the large one's
            0.97-1.03x (docs/benchmarks.md). ``False``: B and W compute their products where
            the schedule placed them. Off in a traced step and with ``check_finite``, as the
            batching is.
        idle_weights: with ``stage_weights``, a rank waiting for a message computes the
            staged sums of the stages it has at most one B or W left of, one Linear at a time,
            checking for the message between them, instead of leaving all of them for the end
            of the step, where the last rank to finish pays for them (that last B or W then
            adds its rows to the sum in place). ``None`` (default): on, except for CPU
            processes when this host's processes of the group times their threads
            (``torch.get_num_threads()``) outnumber the cores this process may use: a waiting
            rank's core then runs another rank, and its wait is not idle time. Measured on 2
            cores (docs/benchmarks.md): 1F1B and ZB-H1 on 2 ranks 0.952x the step time without
            it (small model) and 0.962-0.963x (large), other schedules within noise; on 4 ranks
            (2 per core) no gain. ``True`` / ``False``: always / never.
        chains: run a module stage that is an ``nn.Sequential`` of ``nn.Linear`` and
            elementwise activations (GELU, ReLU, Tanh, Sigmoid, SiLU, Identity; no hooks) as
            one autograd node that calls the same kernels and their derivatives written out
            (:mod:`funcpipe.runtime.chain`): the same outputs and gradients without autograd
            recording and walking each op (a chain stage's backward is called by the runtime
            directly, with no engine call), and exact GELU on at most 65,536 elements computed
            by ATen's own kernel rather than oneDNN's, whose fixed cost per call dominates
            small CPU inputs (results agree to float32 rounding). Measured on 2 cores
            (docs/benchmarks.md): small model 0.896-0.944x the step time on 2 ranks,
            0.920-0.967x on 4, large 0.968-1.006x. Other stages, and calls it cannot take
            (side inputs, other dtypes, autocast), run as before. ``False``: every stage
            through autograd op by op.
        reuse_grads: write a step's gradient sums into the memory of gradients this pipeline
            returned in its last two steps, where nothing outside funcpipe refers to that
            memory any more (no reference to the tensor, no view, storage handle or NumPy
            array of it; :mod:`funcpipe.runtime.reuse`). On CPU a fresh weight-sized
            gradient page-faults on its first write, inside each stage's first backward. What
            the caller holds is never written. Between steps the pipeline keeps up to two
            steps' gradients alive (usually one the caller has dropped). ``False``: always
            fresh memory.
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        schedule: Program,
        *,
        loss_fn: Callable[..., Tensor] | None = None,
        metric_fn: Callable[..., Tensor] | None = None,
        ties: Mapping[str, Sequence[TiePath]] | None = None,
        side_inputs: Mapping[int, Sequence[str]] | None = None,
        inputs: str = "inputs",
        recompute: bool | Sequence[int] = False,
        data: int = 1,
        dim: Any = 0,
        transport: str | None = None,
        mesh: Any = None,
        scatter_gather: bool = False,
        check_finite: bool | None = None,
        device: torch.device | str | None = None,
        p2p: str = "auto",
        batch_weights: bool = True,
        reuse_grads: bool = True,
        batch_weights_extra: int = 0,
        stage_weights: bool = True,
        idle_weights: bool | None = None,
        chains: bool = True,
    ) -> None:
        if p2p not in ("auto", "torch"):
            raise InvalidArgument(
                f"p2p={p2p!r}: use 'auto' (sockets between CPU processes of one host, else "
                "torch.distributed) or 'torch' (always torch.distributed send/recv)"
            )
        self.p2p = p2p
        self.stages = tuple(stages)
        for k, s in enumerate(self.stages):
            if not isinstance(s, Stage):
                raise InvalidArgument(
                    f"stages[{k}]={s!r}: pass funcpipe.Stage objects (see from_module)"
                )
        if not isinstance(schedule, Program):
            raise InvalidArgument(
                f"schedule={schedule!r}: pass a funcpipe.schedule.Program, e.g. "
                "generate('1f1b', ranks=2, microbatches=4)"
            )
        owners = schedule.replica_of or tuple(range(schedule.n_stages))
        if sorted(set(owners)) != list(range(len(self.stages))):
            raise InvalidArgument(
                f"the schedule has {len(set(owners))} model stage(s) but {len(self.stages)} stage(s) "
                "were given; partition the model into as many stages as the schedule places"
            )
        for name, fn in (("loss_fn", loss_fn), ("metric_fn", metric_fn)):
            if fn is not None and not callable(fn):
                raise InvalidArgument(f"{name}={fn!r} must be callable")
        if schedule.training and loss_fn is None:
            raise InvalidArgument(
                "a training schedule needs loss_fn (the backward starts at the loss); pass "
                "loss_fn=..., or use an eval schedule (to_eval(program)) for forward only"
            )
        if not isinstance(data, int) or data < 1:
            raise InvalidArgument(
                f"data={data!r}: the number of data-parallel replicas, an int >= 1"
            )
        self.loss_fn, self.metric_fn, self.dim, self.inputs = loss_fn, metric_fn, dim, inputs
        self.side_inputs = {int(s): tuple(v) for s, v in (side_inputs or {}).items()}
        for k in self.side_inputs:
            if not 0 <= k < schedule.n_stages:
                raise InvalidArgument(
                    f"side_inputs names stage {k}; the program has stages 0..{schedule.n_stages - 1}"
                )
        self.ties = {str(k): list(v) for k, v in (ties or {}).items()}
        for name, members in self.ties.items():
            if len(members) < 2 or any(not (isinstance(m, tuple) and len(m) == 2) for m in members):
                raise InvalidArgument(
                    f"ties[{name!r}]={members!r}: list at least two (stage, path) pairs"
                )
            for st, _ in members:
                if not (isinstance(st, int) and 0 <= st < len(self.stages)):
                    raise InvalidArgument(
                        f"ties[{name!r}] names stage {st!r}; stages are 0..{len(self.stages) - 1}"
                    )
        self.data = data
        self.device = torch.device(device) if device is not None else None
        if transport is None:
            import torch.distributed as dist

            on = dist.is_available() and dist.is_initialized()
            transport = "dist" if on else "local"
        if transport not in ("local", "dist"):
            raise InvalidArgument(f"transport={transport!r}: use 'local' or 'dist'")
        if transport == "dist":
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise InvalidArgument(
                    "transport='dist' needs torch.distributed initialised (use funcpipe.launch, "
                    "or torchrun and dist.init_process_group); without a process group use "
                    "transport='local' (every rank in this process)"
                )
        self.transport = transport
        self._n_ranks = schedule.n_ranks
        self.mesh = mesh
        self.scatter_gather = bool(scatter_gather)
        if scatter_gather and mesh is None:
            raise InvalidArgument(
                "scatter_gather=True splits messages over the tensor ranks of mesh=; pass the mesh"
            )
        if check_finite is None:
            import os

            check_finite = os.environ.get("FUNCPIPE_DEBUG", "") not in ("", "0")
        self.check_finite = bool(check_finite)
        if not isinstance(batch_weights, bool):
            raise InvalidArgument(f"batch_weights={batch_weights!r}: pass True or False")
        self.batch_weights = batch_weights
        if (
            isinstance(batch_weights_extra, bool)
            or not isinstance(batch_weights_extra, int)
            or batch_weights_extra < 0
        ):
            raise InvalidArgument(
                f"batch_weights_extra={batch_weights_extra!r}: pass a whole number >= 0 (how "
                "many activations above the program's peak a rank may keep for batched weight "
                "gradients)"
            )
        if batch_weights_extra and not batch_weights:
            raise InvalidArgument(
                f"batch_weights_extra={batch_weights_extra} needs batch_weights=True (it allows "
                "more weight products to wait for a batched sum)"
            )
        self.batch_weights_extra = batch_weights_extra
        if not isinstance(stage_weights, bool):
            raise InvalidArgument(f"stage_weights={stage_weights!r}: pass True or False")
        self.stage_weights = stage_weights
        if idle_weights is not None and not isinstance(idle_weights, bool):
            raise InvalidArgument(
                f"idle_weights={idle_weights!r}: pass True, False or None (on unless the "
                "host's ranks outnumber its cores)"
            )
        self.idle_weights = True if idle_weights is None else idle_weights
        if not isinstance(chains, bool):
            raise InvalidArgument(f"chains={chains!r}: pass True or False")
        self.chains = chains
        if not isinstance(reuse_grads, bool):
            raise InvalidArgument(f"reuse_grads={reuse_grads!r}: pass True or False")
        self.grad_memory = GradMemory() if reuse_grads else None
        if mesh is not None and transport != "dist":
            raise InvalidArgument("mesh= describes processes: it needs transport='dist'")
        if transport == "dist" and data != 1:
            raise InvalidArgument(
                "data= is for transport='local'; with 'dist' the data-parallel size is the world "
                "size divided by the program's ranks"
            )
        self.program = self._lower(
            schedule, recompute, data_parallel=data > 1 or self._dist_sizes()[0] > 1
        )
        self.recompute = frozenset(i.stage for r in self.program.ranks for i in r if i.op is Op.R)
        # shape inference per microbatch signature, most recently used last (bounded: a batch
        # whose length changes every step must not grow it without end)
        self._layouts: OrderedDict[Any, Layout] = OrderedDict()
        self._memo: dict[int, dict[Any, Any]] = {}  # per rank: plans kept across steps
        if transport == "dist":
            self._setup_dist()
            if idle_weights is None:
                self.idle_weights = self._cores_to_spare()

    # ------------------------------------------------------------------ program
    def _lower(
        self, schedule: Program, recompute: bool | Sequence[int], *, data_parallel: bool
    ) -> Program:
        p = schedule
        if p.lowered:
            check(p)
            return p
        if recompute and p.training:
            stages = range(p.n_stages) if recompute is True else recompute
            p = add_recompute(p, stages=stages)
        # ties first: their sums complete the tied leaves, which the replica sums then skip
        if p.training and self.ties:
            p = _add_tie_reduce(p, self.ties)
        if p.training and (data_parallel or len(set(p.replica_of or ())) < p.n_stages):
            p = add_reduce(p, group="data")  # also adds the replica sums (Chimera)
        p = add_communication(p)
        check(p)
        return p

    def _dist_sizes(self) -> tuple[int, int]:
        """(data-parallel copies, tensor-parallel size) of the world this pipeline runs in."""
        if self.transport != "dist":
            return 1, 1
        if self.mesh is not None:
            config = self.mesh.config
            return config.data, config.tensor
        import torch.distributed as dist

        return max(1, dist.get_world_size() // self._n_ranks), 1

    def _cores_to_spare(self) -> bool:
        """Whether a waiting rank's core would otherwise idle: not CPU, or this host's
        processes of the group, times their threads, fit in the cores this process may use
        (every process calls this: it counts the processes on its host)."""
        if self.device is not None and self.device.type != "cpu":
            return True
        return _fits_cores(_processes_here(), torch.get_num_threads(), _cores())

    def _setup_dist(self) -> None:
        """Process groups for this program on a world of ``ranks x data x tensor`` processes.

        World rank ``g = (r * data + d) * tensor + c`` runs program rank ``r`` in data-parallel
        copy ``d`` with tensor-parallel coordinate ``c`` (the layout of
        :class:`funcpipe.parallel.ParallelConfig`: pipe outermost, tensor innermost). Messages go
        between equal ``(d, c)``; ``data`` reductions between equal ``(r, c)``. Every process
        creates every group (torch requires it), so all of them must build the same Pipeline.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidArgument(
                "transport='dist' needs torch.distributed initialised (use funcpipe.launch, "
                "or torchrun and dist.init_process_group)"
            )
        world, me = dist.get_world_size(), dist.get_rank()
        n = self.program.n_ranks
        if self.mesh is not None and self.mesh.config.pipeline != n:
            raise InvalidArgument(
                f"mesh has pipeline={self.mesh.config.pipeline} but the program has {n} ranks; "
                "generate the schedule with ranks equal to the mesh's pipeline size"
            )
        if world % n:
            raise InvalidArgument(
                f"the world has {world} processes but the program has {n} ranks; the world size "
                f"must be a multiple of {n} (ranks x data x tensor)"
            )
        copies, tp = self._dist_sizes()
        if n * copies * tp != world:
            raise InvalidArgument(
                f"ranks ({n}) x data ({copies}) x tensor ({tp}) != world size {world}"
            )

        def g(r: int, d: int, c: int) -> int:
            return (r * copies + d) * tp + c

        self.rank, rest = divmod(me, copies * tp)
        copy, coord = divmod(rest, tp)
        self.pipe_ranks = [g(r, copy, coord) for r in range(n)]
        everywhere = [(d, c) for d in range(copies) for c in range(tp)]

        def subgroups(lists: list[list[int]]) -> Any:
            mine, _ = dist.new_subgroups_by_enumeration(lists)
            return mine

        # the loss and metric sums: every process of the world, a group of their own so the
        # ranks can start it mid-step (as soon as their loss is final) whatever else is in flight
        groups: dict[str, Any] = {SCALARS: _scalars_group()}
        names = sorted({i.group for r in self.program.ranks for i in r if i.op is Op.REDUCE})
        for name in names:
            if not in_program(name):  # over the data-parallel copies of this rank and coord
                lists = [[g(r, d, c) for d in range(copies)] for r in range(n) for c in range(tp)]
                groups[name] = subgroups(lists)
                continue
            members = sorted(
                {
                    r
                    for r, instrs in enumerate(self.program.ranks)
                    for i in instrs
                    if i.group == name
                }
            )
            pg = subgroups([[g(r, d, c) for r in members] for d, c in everywhere])
            if self.rank in members and len(members) > 1:
                groups[name] = pg
        self.data_size, self.tensor_size = copies, tp
        from funcpipe.launcher import failure_handler

        split = None
        if self.scatter_gather and tp > 1 and self.mesh is not None:
            tensor_axis = self.mesh["tensor"]
            split = (tensor_axis.group, tp, tensor_axis.coord)
        channels = self._channels(me, failure_handler())
        self._transport: Transport = DistTransport(
            self.rank,
            self.pipe_ranks,
            groups=groups,
            on_error=failure_handler(),
            split=split,
            channels=channels,
        )

    def _channels(self, me: int, on_error: Callable[[BaseException, str], BaseException]) -> Any:
        """Sockets to this rank's same-host message peers (every process calls this)."""
        import torch.distributed as dist

        from funcpipe.runtime import sockets

        if self.p2p != "auto" or not sockets.supported():
            return None
        device = self.device
        if device is not None and device.type != "cpu":
            return None
        if dist.get_backend() != "gloo":
            return None
        store, key, host = _publish_host("p2p", me)
        peers = {
            self.pipe_ranks[i.peer]
            for i in self.program.ranks[self.rank]
            if i.op in (Op.SEND, Op.RECV) and i.peer is not None
        }
        near = [p for p in peers if store.get(f"{key}/host/{p}").decode() == host]
        return sockets.Channels(me, near, store, key=key, timeout=_pg_timeout(), on_error=on_error)

    # ------------------------------------------------------------------ step
    def step(
        self,
        params: Sequence[Any],
        batch: Any,
        targets: Any = None,
        *,
        return_outputs: bool = False,
        trace: bool = False,
    ) -> StepResult:
        """One training step (or one evaluation, for an eval program): ``(loss, grads)``.

        With ``trace=True`` every rank records when each instruction starts and ends and
        ``result.timeline`` is the executed :class:`funcpipe.schedule.Timeline` (over processes
        it is gathered to every rank; all ranks must pass the same ``trace``). In one process the
        ranks run one after the other, so its timeline shows the interleaving, not parallelism.
        A traced step keeps each B's Linear weight products inside the B (an untraced one sums
        them after the sends that follow it, so the gradient leaves first, or, where memory
        allows, leaves them waiting to be summed with later microbatches' in one product, or
        stages their rows to be summed once per step; ``batch_weights_extra`` and
        ``stage_weights`` have no effect on a traced step): each B's event is then the whole
        backward, as the simulator and ``costs_from_timelines`` expect.

        ``params[k]`` is stage k's params pytree; with ``transport="dist"`` the stages this rank
        does not hold may be meta tensors (only their shapes are read). ``grads`` has the same
        structure, with ``None`` for stages this rank does not hold. ``loss`` (and ``metric``) is
        the mean over microbatches, on every rank.
        """
        params = self._check_params(params)
        program = self.program
        m = program.microbatches
        if self.transport == "local":
            shards = split(batch, self.data, dim=self.dim) if self.data > 1 else [batch]
            tshards = (
                split(targets, self.data, dim=0)
                if (targets is not None and self.data > 1)
                else [targets] * self.data
            )
            world = LocalWorld(program.n_ranks * self.data, groups=self._local_groups())
            gens = {}
            for d in range(self.data):
                entry, side, tgt, layouts = self._microbatches(params, shards[d], tshards[d])
                for r in range(program.n_ranks):
                    x = self._rank_inputs(r, params, entry, side, tgt, layouts, return_outputs)
                    x.trace = trace
                    if d == 0:  # replica 0's gradients are the ones returned
                        self._offer(x)
                    ranks = [d * program.n_ranks + k for k in range(program.n_ranks)]
                    gens[ranks[r]] = run_rank(x, world.transport(r, ranks))
            results = _drive_local(gens)
            per_rank = [results[r] for r in range(program.n_ranks)]  # replica 0 answers
            loss = self._sum(
                [
                    r.loss_sum
                    for d in range(self.data)
                    for r in [results[d * program.n_ranks + k] for k in range(program.n_ranks)]
                ]
            )
            metric = self._sum([r.metric_sum for r in results.values()])
            scale = 1.0 / (m * self.data)
            grads = self._grads(params, per_rank)
            outputs = self._outputs(per_rank) if return_outputs else None
            local = StepResult(
                None if loss is None else loss * scale,
                grads,
                None if metric is None else metric * scale,
                outputs,
            )
            local.peak_activations = {r: res.peak_activations for r, res in enumerate(per_rank)}
            if trace:
                local.timeline = _timeline(program, [res.times for res in per_rank])
            return local
        entry, side, tgt, layouts = self._microbatches(params, batch, targets)
        x = self._rank_inputs(self.rank, params, entry, side, tgt, layouts, return_outputs)
        self._offer(x)
        x.data_size = self.data_size
        x.trace = trace
        if self.loss_fn is not None or self.metric_fn is not None:
            x.scalars_group = SCALARS
        result = _drive(run_rank(x, self._transport))
        loss, metric = self._dist_scalars(result)
        grads = self._grads(params, [result])
        outputs = self._outputs([result]) if return_outputs else None
        step = StepResult(loss, grads, metric, outputs)
        step.peak_activations = {self.rank: result.peak_activations}
        if trace:
            step.timeline = _timeline(self.program, self._gather_times(result.times))
        return step

    @property
    def bytes_sent(self) -> int:
        """Bytes this process handed to point-to-point sends so far (``"dist"`` only)."""
        return int(getattr(self._transport, "bytes_sent", 0)) if self.transport == "dist" else 0

    def _gather_times(self, times: list[float]) -> list[list[float]]:
        """Every program rank's instruction times (of this rank's copy and coordinate)."""
        import torch.distributed as dist

        longest = 2 * max(len(r) for r in self.program.ranks)
        mine = torch.full((longest,), float("nan"), dtype=torch.float64)
        mine[: len(times)] = torch.tensor(times, dtype=torch.float64)
        dev = self._transport_device()
        everyone = [torch.empty_like(mine, device=dev) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine.to(dev))
        return [
            everyone[g].cpu()[: 2 * len(self.program.ranks[r])].tolist()
            for r, g in enumerate(self.pipe_ranks)
        ]

    def __call__(
        self, params: Sequence[Any], batch: Any, targets: Any = None, **kw: Any
    ) -> StepResult:
        return self.step(params, batch, targets, **kw)

    # ------------------------------------------------------------------ pieces
    def _check_params(self, params: Sequence[Any]) -> tuple[Any, ...]:
        if not isinstance(params, (tuple, list)) or len(params) != len(self.stages):
            raise InvalidArgument(
                f"params must be a tuple with one pytree per stage ({len(self.stages)}); got "
                f"{type(params).__name__}"
                + (f" of length {len(params)}" if isinstance(params, (tuple, list)) else "")
            )
        for k, p in enumerate(params):
            check_tensor_tree(p, name=f"params[{k}]")
        params = tuple(params)
        if self.ties and self.transport == "local":
            params = self._tie_values(params)
        return params

    def _tie_values(self, params: tuple[Any, ...]) -> tuple[Any, ...]:
        out = list(params)
        for name, members in self.ties.items():
            (s0, path0), rest = members[0], members[1:]
            leaves0, _ = tree_flatten(out[s0])
            value = leaves0[_resolve(out[s0], path0, f"ties[{name!r}]")]
            for s, path in rest:
                leaves, tree = tree_flatten(out[s])
                k = _resolve(out[s], path, f"ties[{name!r}]")
                if leaves[k].shape != value.shape or leaves[k].dtype != value.dtype:
                    raise InvalidArgument(
                        f"ties[{name!r}]: stage {s} {path!r} is {leaves[k].dtype}{list(leaves[k].shape)} "
                        f"but stage {s0} {path0!r} is {value.dtype}{list(value.shape)}; tied "
                        "parameters must have one shape and dtype"
                    )
                leaves[k] = value
                out[s] = tree_unflatten(tree, leaves)
        return tuple(out)

    def _local_groups(self) -> dict[str, list[list[int]]]:
        p, n = self.program, self.program.n_ranks
        groups: dict[str, list[list[int]]] = {}
        names = {i.group for r in p.ranks for i in r if i.op is Op.REDUCE}
        for name in names:
            if name == "data":
                groups[name] = [[d * n + r for d in range(self.data)] for r in range(n)]
            else:
                members = sorted(
                    {r for r, instrs in enumerate(p.ranks) for i in instrs if i.group == name}
                )
                groups[name] = [[d * n + r for r in members] for d in range(self.data)]
        return groups

    def _microbatches(
        self, params: tuple[Any, ...], batch: Any, targets: Any
    ) -> tuple[
        list[tuple[Any, ...]], list[dict[int, dict[str, Any]]], list[Any] | None, list[Layout]
    ]:
        m = self.program.microbatches
        if self.side_inputs:
            if not isinstance(batch, Mapping) or self.inputs not in batch:
                raise InvalidArgument(
                    f"with side_inputs the batch must be a dict holding the first stage's input "
                    f"under {self.inputs!r}; got {type(batch).__name__}"
                    + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
                )
            needed = {k for names in self.side_inputs.values() for k in names}
            missing = sorted(needed - set(batch))
            if missing:
                raise InvalidArgument(
                    f"side_inputs need batch keys {missing} that the batch lacks (it has {sorted(batch)})"
                )
            batch = {k: batch[k] for k in (needed | {self.inputs})}
            pieces = split(batch, m, dim=self.dim)
            entry = [as_inputs(pc[self.inputs]) for pc in pieces]
            side = [
                {s: {k: pc[k] for k in names} for s, names in self.side_inputs.items()}
                for pc in pieces
            ]
        else:
            entry = [as_inputs(pc) for pc in split(batch, m, dim=self.dim)]
            side = [{} for _ in range(m)]
        tgt = None if targets is None else split_targets(targets, m, batch=batch, dim=self.dim)
        layouts = []
        full = self._full_stages()
        fparams = [params[o] for o in (self.program.replica_of or range(self.program.n_stages))]
        psig = signature(fparams)  # a stage's outputs may follow its params' dtypes
        cache = self._layouts
        for k in range(m):
            key = (signature(entry[k]), signature(side[k]), psig)
            layout = cache.get(key)
            if layout is None:
                layout = cache[key] = infer_layout(self.program, full, fparams, entry[k], side[k])
                while len(cache) > LAYOUT_CACHE:
                    cache.popitem(last=False)
            else:
                cache.move_to_end(key)
            layouts.append(layout)
        return entry, side, tgt, layouts

    def _full_stages(self) -> list[Stage]:
        return [self.stages[o] for o in (self.program.replica_of or range(self.program.n_stages))]

    def _rank_inputs(
        self,
        rank: int,
        params: tuple[Any, ...],
        entry: list[tuple[Any, ...]],
        side: list[dict[int, dict[str, Any]]],
        tgt: list[Any] | None,
        layouts: list[Layout],
        keep: bool,
    ) -> RankInputs:
        p = self.program
        owners = p.replica_of or tuple(range(p.n_stages))
        local = p.stages_on(rank)
        prm: dict[int, tuple[list[Tensor], Any]] = {}
        for s in local:
            o = owners[s]
            if o not in prm:
                leaves, tree = tree_flatten(params[o])
                if any(t.is_meta for t in leaves):
                    raise InvalidArgument(
                        f"params[{o}] is on the meta device but rank {rank} runs stage {s}"
                    )
                prm[o] = (
                    [t.detach().requires_grad_(_diff(t) and p.training) for t in leaves],
                    tree,
                )
        device = self.device
        if device is None:
            first = next((ls[0] for ls, _ in prm.values() if ls), None)
            device = first.device if first is not None else torch.device("cpu")
        ties: dict[str, list[tuple[int, int]]] = {}
        for name, members in self.ties.items():
            ties[name] = [(s, _resolve(params[s], path, f"ties[{name!r}]")) for s, path in members]
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
            prefetch=device.type == "cpu",  # NCCL: receives stay where the program puts them
            check_finite=self.check_finite,
            batch_weights=self.batch_weights,
            batch_weights_extra=self.batch_weights_extra,
            stage_weights=self.stage_weights,
            idle_weights=self.idle_weights,
            chains=self.chains,
            ties=ties,
            data_size=self.data,
            memo=self._memo.setdefault(rank, {}),  # the rank's plans, made once
        )

    def _offer(self, x: RankInputs) -> None:
        """Let this step's gradient sums reuse the memory of earlier steps' (``reuse_grads``)."""
        if self.grad_memory is not None and self.program.training:
            self.grad_memory.offer({o: leaves for o, (leaves, _) in x.params.items()})

    @staticmethod
    def _sum(values: Sequence[Tensor | None]) -> Tensor | None:
        got = [v for v in values if v is not None]
        if not got:
            return None
        total = got[0]
        for v in got[1:]:
            total = total + v
        return total

    def _grads(self, params: tuple[Any, ...], results: Sequence[RankResult]) -> tuple[Any, ...]:
        if not self.program.training:
            return tuple(None for _ in params)
        found: dict[int, list[Tensor]] = {}
        for res in results:
            for o, g in res.grads.items():
                found.setdefault(o, g)
        if self.grad_memory is not None:
            self.grad_memory.remember(found)
        out = []
        for o, prm in enumerate(params):
            if o in found:
                _, tree = tree_flatten(prm)
                out.append(tree_unflatten(tree, found[o]))
            else:
                out.append(None)
        return tuple(out)

    def _outputs(self, results: Sequence[RankResult]) -> Any:
        from funcpipe.microbatch import merge

        by_mb: dict[int, Any] = {}
        for res in results:
            by_mb.update(res.outputs)
        if len(by_mb) < self.program.microbatches:
            return None
        return merge([by_mb[k] for k in range(self.program.microbatches)], dim=0)

    def _dist_scalars(self, result: RankResult) -> tuple[Tensor | None, Tensor | None]:
        has_loss = self.loss_fn is not None
        has_metric = self.metric_fn is not None
        if not (has_loss or has_metric):
            return None, None
        if result.scalars is None:  # every rank posts it once per step (interpreter.run)
            raise RuntimeError("funcpipe internal error: the step's loss reduction was not posted")
        buf, handle = result.scalars
        handle.wait()  # over every rank of every copy: the loss of the whole batch
        # every data copy adds its loss; every tensor coordinate holds the same loss
        m = self.program.microbatches * self.data_size * self.tensor_size
        loss = buf[0] / m if (has_loss and buf[2] > 0) else None
        metric = buf[1] / m if (has_metric and buf[2] > 0) else None
        return loss, metric

    def _transport_device(self) -> torch.device:
        import torch.distributed as dist

        if self.device is not None:
            return self.device
        backend = dist.get_backend()
        return (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )


_EXCHANGES: dict[str, int] = {}  # host exchanges by this process, per kind (their store keys)


def _publish_host(kind: str, me: int) -> tuple[Any, str, str]:
    """Publish this process's host id under a fresh store key of ``kind``; every process of the
    default group calls this at the same point, so the keys agree. Returns the group's store,
    the key (rank ``r``'s id is at ``{key}/host/{r}``) and this host's id."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    n = _EXCHANGES[kind] = _EXCHANGES.get(kind, 0) + 1
    key = f"funcpipe/{kind}/{n}"
    host = _host_id()
    store.set(f"{key}/host/{me}", host)
    return store, key, host


def _processes_here() -> int:
    """The default group's processes on this host, this one included (every process of the
    group calls this at the same point: they exchange host ids through the group's store)."""
    import torch.distributed as dist

    store, key, host = _publish_host("hosts", dist.get_rank())
    world = range(dist.get_world_size())
    return sum(store.get(f"{key}/host/{r}").decode() == host for r in world)


def _cores() -> int:
    """The cores this process may run on."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _fits_cores(processes: int, threads: int, cores: int) -> bool:
    """``processes`` of ``threads`` each have a core to every thread."""
    return processes * threads <= cores


def _host_id() -> str:
    """This machine (and boot): ranks with equal ids can talk over Unix-domain sockets."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _pg_timeout() -> float:
    """The default process group's timeout in seconds (socket waits give up after it too)."""
    import torch.distributed as dist

    try:
        opts = dist.group.WORLD._get_backend(torch.device("cpu")).options  # type: ignore[union-attr]
        return float(opts._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        return 1800.0


_SCALAR_GROUPS: dict[int, tuple[Any, Any]] = {}  # id(default group) -> (it, loss group)


def _scalars_group() -> Any:
    """One process group over the whole world for every Pipeline's loss reduction (steps run
    one after another, so they can share it; a group per Pipeline would open new connections
    for each). Every process creates it with its first Pipeline, in the same order."""
    import torch.distributed as dist

    default = dist.group.WORLD
    found = _SCALAR_GROUPS.get(id(default))
    if found is None or found[0] is not default:
        found = _SCALAR_GROUPS[id(default)] = (
            default,
            dist.new_group(list(range(dist.get_world_size()))),
        )
    return found[1]


def _timeline(program: Program, times: Sequence[Sequence[float]]) -> Any:
    """A :class:`Timeline` from each rank's flat (start, end, start, end, ...) times, in
    seconds from the earliest start."""
    from funcpipe.schedule.simulate import Event, Timeline

    t0 = min((t[0] for t in times if t), default=0.0)
    events = tuple(
        tuple(
            Event(r, k, instr, ts[2 * k] - t0, ts[2 * k + 1] - t0)
            for k, instr in enumerate(program.ranks[r])
        )
        for r, ts in enumerate(times)
    )
    return Timeline(program=program, events=events)


def _add_tie_reduce(program: Program, ties: Mapping[str, Sequence[TiePath]]) -> Program:
    """One ``REDUCE s tie:name`` per rank holding a tied stage, at the end of that rank, in name
    order (every rank meets its tie groups in the same order). The interpreter sums the tied
    gradients of all the rank's stages in the tie before the collective."""
    owners = program.replica_of or tuple(range(program.n_stages))
    ranks = [list(r) for r in program.ranks]
    for name in sorted(ties):
        stages = {s for s, _ in ties[name]}
        held: dict[int, int] = {}
        for slot, o in enumerate(owners):
            if o in stages:
                r = program.placement[slot]
                held[r] = max(held.get(r, slot), slot)
        for r, slot in sorted(held.items()):
            ranks[r].append(reduce(slot, f"tie:{name}"))
    return program.replace(ranks=tuple(tuple(r) for r in ranks))
