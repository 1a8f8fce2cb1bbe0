"""The interpreter: one rank runs its instructions of a lowered program.

One loop serves every schedule. The rank's work is a generator: it yields a :class:`Handle`
whenever it has to wait (a receive, a collective); the driver decides how to wait. Over
``torch.distributed`` the driver blocks on the handle; in one process the driver switches to
another rank, so all ranks of a program run deterministically in one thread.

Instructions run exactly in program order. A communication group (a SEND or RECV and the ones
``joined`` to it) is posted as one; a RECV only posts, and the compute instruction that reads
the received data waits for it.

State lives only for one step: activations are freed after their last backward use, weight
gradients are returned as a fresh pytree, nothing is kept across steps. Within a step autograd
sums each microbatch's parameter gradients in place into the ``.grad`` of the leaves
:class:`funcpipe.Pipeline` created for this rank and step; the rank hands the sums back.

What a rank's step takes and gives back (:class:`RankInputs`, :class:`RankResult`) is in
:mod:`funcpipe.runtime.rank_io`, the function one forward runs in :mod:`~.stage_call`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from funcpipe.errors import InvalidArgument
from funcpipe.runtime import autodiff
from funcpipe.runtime.clock import step_clock
from funcpipe.runtime.leaves import check_finite, compute_leaves, take_grad
from funcpipe.runtime.pair import run_pair
from funcpipe.runtime.pending import Pending as _Pending
from funcpipe.runtime.pending import wait_for
from funcpipe.runtime.rank_io import EXPERT_DATA, RankInputs, RankResult
from funcpipe.runtime.shards import gather_stage, leaf_layout, own_pieces, scatter_stage
from funcpipe.runtime.spans import traced
from funcpipe.runtime.stage_call import backward_noted, stage_fn
from funcpipe.runtime.tallies import reduce_tallies
from funcpipe.runtime.transport_common import P2P, RECV, SEND, Handle, Transport
from funcpipe.schedule.check import in_program
from funcpipe.schedule.ir import ACT, COMPUTE_OPS, GRAD, Instr, Op, groups, pairs
from funcpipe.stages.boundaries import OutputSpec, rebuild
from funcpipe.stages.tally import collecting
from funcpipe.tree import tree_flatten

__all__ = ["RankInputs", "RankResult", "run_rank"]

Tensor = torch.Tensor


class _Rank:
    def __init__(self, x: RankInputs, transport: Transport) -> None:
        self.x = x
        self.t = transport
        p = x.program
        self.p = p
        self.owner = p.replica_of or tuple(range(p.n_stages))
        self.m = p.microbatches
        scale = x.loss_scale
        self.scale = scale / self.m if isinstance(scale, float) else 1.0 / self.m
        self.scale_by = None if isinstance(scale, float) else scale  # a tensor: on its device
        self.acts: dict[tuple[int, int, int], list[Tensor]] = {}  # (producer, consumer, mb)
        self.to_send: dict[tuple[str, int, int, int], list[Tensor]] = {}  # (kind, p, c, mb)
        self.out_grads: dict[tuple[int, int], list[Tensor | None]] = {}  # (stage, mb)
        self.saved: dict[tuple[int, int], tuple[autodiff.Saved, Callable[..., Any]]] = {}
        self.result = RankResult()
        self.reductions: list[_Pending] = []
        self.tallied: dict[int, dict[str, Tensor]] = {}  # owner -> funcpipe.stages.tally sums
        self.inflight: dict[int, list[_Pending]] = {}
        self.tied = {key for keys in x.ties.values() for key in keys}
        self.live = 0  # activations kept for a backward (as the simulator counts them)
        # owner stage -> this step's parameter leaves; the gradient sums live in their .grad
        # (see the module docstring); a tie reduction hands one total to several leaves: those
        # are ``shared`` and copied before anything adds into them
        self.leaves: dict[int, list[Tensor]] = {}
        for s in p.stages_on(x.rank):
            o = self.owner[s]
            self.leaves.setdefault(o, x.params[o][0])
        # owner stage -> the leaves the stage computes with: the leaves themselves, or, where the
        # pipeline keeps a leaf in a wider dtype (RankInputs.casts), its copy in the compute
        # dtype, made once per step: no weight is cast inside a microbatch, and each
        # microbatch's gradient is added into the wide sum (_fold) without a cast
        self.compute: dict[int, list[Tensor]] = {
            o: leaves if (casts := x.casts.get(o)) is None else compute_leaves(leaves, casts)
            for o, leaves in self.leaves.items()
        }
        self.shared: set[tuple[int, int]] = set()
        # sharded owners (GATHER/SCATTER): the all-gather of each owner's parameters in flight,
        # and this copy's pieces of the averaged gradients once SCATTERed
        self.gathering: dict[int, _Pending] = {}
        self.pieces: dict[int, list[Tensor | None]] = {}
        # owner -> its SCATTERs in flight (adding into the pieces; each holds a packed copy)
        self.scattering: dict[int, list[_Pending]] = {}
        self.nodes: dict[int, dict[Any, int]] = {}  # owner -> autodiff.param_nodes (for I)
        # receives posted and not yet read: message key -> (handle, what to do once in)
        self.incoming: dict[Any, tuple[Handle, Callable[[], None] | None]] = {}

    # ------------------------------------------------------------------ helpers
    def spec(self, s: int, m: int) -> OutputSpec:
        return self.x.layouts[m][s]

    def _inputs(self, s: int, m: int) -> list[Tensor]:
        producers = self.p.producers(s)
        if not producers:
            return tree_flatten(self.x.entry[m])[0]
        leaves: list[Tensor] = []
        for q in producers:
            leaves.extend(self.acts.pop((q, s, m)))
        return leaves

    def _params(self, s: int) -> list[Tensor]:
        """The leaves stage ``s`` computes with (what autograd differentiates)."""
        return self.compute[self.owner[s]]

    def _fold(self, s: int) -> None:
        """Add the gradients autograd left on stage ``s``'s compute copies into the sums of the
        leaves kept in a wider dtype (a mixed-dtype add: the sum stays wide, nothing is cast
        but the first microbatch's gradient)."""
        o = self.owner[s]
        casts = self.x.casts.get(o)
        if casts is None:
            return
        for leaf, copy, c in zip(self.leaves[o], self.compute[o], casts, strict=True):
            g = copy.grad
            if c is None or g is None:
                continue
            copy.grad = None
            leaf.grad = g.to(leaf.dtype) if leaf.grad is None else leaf.grad.add_(g)

    def _route_outputs(self, s: int, m: int, flat: list[Tensor]) -> None:
        x, p = self.x, self.p
        if not p.consumers(s):
            extras = len(flat) - len(self.spec(s, m).leaves)
            if x.loss_fn is not None and extras > 0:
                self.result.add_loss(flat[:extras], self.x.metric_fn is not None, self.x.rank)
                flat = flat[extras:]
            if x.keep_outputs:
                self.result.outputs[m] = rebuild(self.spec(s, m), [t.detach() for t in flat])
            return
        for c in p.consumers(s):
            if p.placement[c] == x.rank:
                self.acts[(s, c, m)] = flat
            else:
                self.to_send[(ACT, s, c, m)] = flat

    def _route_input_grads(self, s: int, m: int, grads: list[Tensor | None]) -> None:
        p = self.p
        k = 0
        for q in p.producers(s):
            spec = self.spec(q, m)
            part = grads[k : k + len(spec.leaves)]
            k += len(spec.leaves)
            if p.placement[q] == self.x.rank:
                self._add_out_grads(q, m, part)
            else:
                dev = self.x.device
                self.to_send[("grad", q, s, m)] = [
                    g if (g := part[i]) is not None else spec.leaves[i].zeros(dev)
                    for i in spec.differentiable
                ]

    def _add_out_grads(self, s: int, m: int, grads: Sequence[Tensor | None]) -> None:
        have = self.out_grads.get((s, m))
        if have is None:
            self.out_grads[(s, m)] = list(grads)
            return
        for i, g in enumerate(grads):
            if g is not None:
                prev = have[i]
                have[i] = g if prev is None else prev + g

    def _grad_outputs(self, s: int, m: int) -> list[Tensor | None]:
        if not self.p.consumers(s):
            n_out = len(self.spec(s, m).leaves)
            if self.x.loss_fn is None:
                raise InvalidArgument(
                    "training needs a loss_fn: the last stage's backward starts at the loss"
                )
            loss = self.saved[(s, m)][0].outputs
            if not loss:
                raise RuntimeError(f"backward of stage {s} microbatch {m} has no graph")
            seed = torch.full_like(loss[0], self.scale)
            if self.scale_by is not None:  # (a 0-dim tensor keeps the seed's dtype)
                seed = seed * self.scale_by.to(seed.device, non_blocking=True)
            extras: list[Tensor | None] = [None] * (len(loss) - n_out - 1)
            return [seed, *extras, *([None] * n_out)]
        return self.out_grads.pop((s, m), [None] * len(self.spec(s, m).leaves))

    def _unshare(self, s: int) -> None:
        """Before autograd adds into stage ``s``'s sums: give shared ones their own copy."""
        o = self.owner[s]
        for key in [key for key in self.shared if key[0] == o]:
            leaf = self.leaves[o][key[1]]
            if leaf.grad is not None:
                leaf.grad = leaf.grad.clone()
            self.shared.discard(key)

    def _param_grads(self, s: int) -> list[Tensor | None]:
        return [t.grad for t in self.leaves[self.owner[s]]]

    def _finite(
        self, s: int, m: int, tensors: Sequence[Tensor | None], names: Sequence[str], where: str
    ) -> None:
        check_finite(self.x, s, m, tensors, names, where)

    def _alive(self, delta: int) -> None:
        self.live += delta
        self.result.peak_activations = max(self.result.peak_activations, self.live)

    # ------------------------------------------------------------------ instructions
    def forward(self, i: Instr) -> None:
        s, m = i.stage, i.microbatch
        fn = stage_fn(self.x, self.owner[s], s, m)
        leaves = self._inputs(s, m)
        if self.p.training:
            needs = bool(self.p.producers(s))  # (the batch needs no gradient)
            keep = s not in self.x.recompute
            with collecting(self.tallied.setdefault(self.owner[s], {})):  # (not an R)
                out, saved = autodiff.forward(
                    fn, self._params(s), leaves, keep=keep, grad_inputs=needs
                )
            if keep:
                self._alive(+1)
            self.saved[(s, m)] = (saved, fn)
        else:
            with torch.no_grad(), collecting(self.tallied.setdefault(self.owner[s], {})):
                out = fn(self._params(s), leaves)
        if self.x.check_finite:
            sink = not self.p.consumers(s) and len(out) > len(self.spec(s, m).leaves)
            extras = len(out) - len(self.spec(s, m).leaves) if sink else 0
            names = ["loss"] + ["loss_fn's count or the metric"] * (extras - 1) if sink else []
            names += [f"output #{k}" for k in range(len(out) - extras)]
            self._finite(s, m, out, names, "forward")
        self._route_outputs(s, m, out)

    def recompute(self, i: Instr) -> None:
        saved, fn = self.saved[(i.stage, i.microbatch)]
        autodiff.recompute(fn, self._params(i.stage), saved)
        self._alive(+1)

    def _param_nodes(self, s: int) -> dict[Any, int]:
        o = self.owner[s]
        nodes = self.nodes.get(o)
        if nodes is None:
            nodes = self.nodes[o] = autodiff.param_nodes(self._params(s))
        return nodes

    def backward(self, i: Instr) -> None:
        """B (input and weight gradients of one (stage, microbatch) in one backward) or I."""
        with backward_noted(self.x, i.op.name, i.stage, i.microbatch):
            gin = self.backward_work(i)()
        self.finish_backward(i, gin)

    backward_input = backward

    def backward_work(self, i: Instr) -> Callable[[], list[Tensor | None]]:
        """The gradient computation of B or I ``i``, with what it reads taken now (an
        overlapped pair runs it on a second thread: :mod:`~funcpipe.runtime.pair`)."""
        s, m = i.stage, i.microbatch
        grad_outputs, params = self._grad_outputs(s, m), self._params(s)
        if i.op is Op.I:
            saved, nodes = self.saved[(s, m)][0], self._param_nodes(s)
            return lambda: autodiff.backward_input(saved, params, grad_outputs, nodes=nodes)
        saved = self.saved.pop((s, m))[0]
        if self.shared:
            self._unshare(s)
        return lambda: autodiff.backward(saved, params, grad_outputs, accumulate=True)[0]

    def finish_backward(self, i: Instr, gin: list[Tensor | None]) -> None:
        s, m = i.stage, i.microbatch
        if i.op is Op.B:
            self._fold(s)
            self._alive(-1)
        if self.x.check_finite:
            where = "backward" if i.op is Op.B else "backward (I)"
            self._finite(s, m, gin, [f"input gradient #{k}" for k in range(len(gin))], where)
            if i.op is Op.B:
                self._check_param_grads(s, m)
        self._route_input_grads(s, m, gin)

    def _check_param_grads(self, s: int, m: int) -> None:
        gp = self._param_grads(s)
        self._finite(s, m, gp, [f"parameter gradient #{k}" for k in range(len(gp))], "backward")

    def backward_weight(self, i: Instr) -> None:
        s, m = i.stage, i.microbatch
        saved, _ = self.saved.pop((s, m))
        if self.shared:
            self._unshare(s)
        with backward_noted(self.x, "W", s, m):
            autodiff.backward_weight(saved, self._params(s), accumulate=True)
        self._fold(s)
        if self.x.check_finite:
            gw = self._param_grads(s)
            self._finite(
                s, m, gw, [f"parameter gradient #{k}" for k in range(len(gw))], "backward (W)"
            )
        self._alive(-1)

    def post(self, group: Sequence[Instr]) -> None:
        """Post one communication group (its SENDs and RECVs together, as the program groups
        them). A SEND's tensors are the transport's from here on (released once sent); a
        RECV's data is waited for by the instruction that reads it (:meth:`inputs_in`)."""
        ops, recvs = [], []
        for i in group:
            a, b = i.edge
            if i.op is Op.SEND:
                data = self.to_send.pop((i.kind, a, b, i.microbatch))
                ops.append(P2P(SEND, tuple(data), i.peer, str(i)))
                continue
            bufs, then = self._buffers(i)
            ops.append(P2P(RECV, tuple(bufs), i.peer, str(i)))
            recvs.append((i.key, then, len(ops) - 1))
        handles = self.t.post(ops)
        for key, then, k in recvs:
            self.incoming[key] = (handles[k], then)

    def _buffers(self, i: Instr) -> tuple[list[Tensor], Callable[[], None] | None]:
        """Receive buffers for RECV ``i`` and what to do once they are filled (gradients)."""
        a, b = i.edge
        m = i.microbatch
        spec = self.spec(a, m)
        dev = self.x.device
        if i.kind == ACT:
            bufs = [torch.empty(t.shape, dtype=t.dtype, device=dev) for t in spec.leaves]
            self.acts[(a, b, m)] = bufs
            return bufs, None
        leaves = spec.leaves
        bufs = [
            torch.empty(leaves[k].shape, dtype=leaves[k].dtype, device=dev)
            for k in spec.differentiable
        ]
        full: list[Tensor | None] = [None] * len(leaves)
        for k, buf in zip(spec.differentiable, bufs, strict=True):
            full[k] = buf
        return bufs, lambda: self._add_out_grads(a, m, full)

    def inputs_in(self, i: Instr) -> Generator[Handle, None, None]:
        """Wait for the received data compute instruction ``i`` reads (posted earlier)."""
        if not self.incoming:
            return
        p, s, m = self.p, i.stage, i.microbatch
        if i.op is Op.F:
            keys = [(ACT, (q, s), m) for q in p.producers(s)]
        elif i.op in (Op.B, Op.I):
            keys = [(GRAD, (s, c), m) for c in p.consumers(s)]
        else:
            return
        for key in keys:
            got = self.incoming.pop(key, None)
            if got is not None:
                h, then = got
                yield from wait_for(h)
                if then is not None:
                    then()

    def reduce(self, i: Instr) -> None:
        """Start REDUCE ``i.group`` over this rank's gradients of ``i.stage`` (asynchronously).

        ``tie:NAME`` sums the tied parameters' gradients of all this rank's stages first, then
        over the tie's ranks, and hands the total to every tied leaf. ``replica:O`` sums the
        replicas of stage O (already summed on this rank, they share one accumulator), minus the
        tied leaves, which their tie reduction completes. Any other group averages over the
        data-parallel copies of the program.
        """
        x = self.x
        group = i.group
        if group.startswith("tie:"):
            local = [(o, k) for o, k in x.ties.get(group[4:], ()) if o in self.leaves]
            total = self._grad_leaf(local[0])
            for key in local[1:]:
                total = total + self._grad_leaf(key)

            # bound as defaults, not through ``self``: the pending reduction that keeps this
            # callback must not point back at the rank (a reference cycle would keep every
            # step's rank, its inputs and gradients alive until a full garbage collection)
            def assign(
                local: list[tuple[int, int]] = local,
                total: Tensor = total,
                leaves: dict[int, list[Tensor]] = self.leaves,
                shared: set[tuple[int, int]] = self.shared,
                pieces: dict[int, list[Tensor | None]] = self.pieces,
            ) -> None:
                for o, k in local:
                    if o in pieces:  # SCATTERed: the tie sums this copy's pieces
                        pieces[o][k] = total
                        continue
                    leaves[o][k].grad = total
                    if len(local) > 1:
                        shared.add((o, k))  # one tensor for the tied leaves now

            self._reduce(self.t.all_reduce([total], group), assign, {o for o, _ in local})
            return
        owner = self.owner[i.stage]
        keys = [
            k
            for k in range(len(self.leaves[owner]))
            if not (group.startswith("replica:") and (owner, k) in self.tied)
        ]
        experts = x.experts.get(owner, frozenset()) if not in_program(group) else frozenset()
        over = [(group, [k for k in keys if k not in experts])]
        if experts:  # mixture-of-experts weights: over the copies holding the same experts
            over.append((EXPERT_DATA, [k for k in keys if k in experts]))
        for name, part in over:
            leaves = [self._grad_leaf((owner, k)) for k in part]
            # last leaf first (the last layer's, as a backward produces them and DDP reduces
            # them): the transport buckets them in this order
            diff = [t for t in reversed(leaves) if t.is_floating_point() or t.is_complex()]
            if in_program(group) or x.data_size == 1:
                self._reduce(self.t.all_reduce(diff, name), lambda: None, {owner})
                continue
            scale = 1.0 / x.data_size  # (experts too: each copy's loss is 1/data of the step's)

            def average(diff: list[Tensor] = diff, scale: float = scale) -> None:
                for t in diff:
                    t.mul_(scale)

            self._reduce(self.t.all_reduce(diff, name), average, {owner})

    def _grad_leaf(self, key: tuple[int, int], full: bool = False) -> Tensor:
        """The gradient sum of leaf ``k`` of ``o``, contiguous and its own (reductions write
        into it); of a SCATTERed owner (unless ``full``), this copy's piece of it."""
        o, k = key
        if o in self.pieces and not full:
            if (piece := self.pieces[o][k]) is None:  # (set once its SCATTER finished)
                raise RuntimeError(f"funcpipe internal error: stage {o}'s piece {k} is unset")
            return piece
        leaf = self.leaves[o][k]
        g = leaf.grad
        if g is None:
            g = leaf.grad = torch.zeros_like(leaf)
        elif key in self.shared or not g.is_contiguous():
            g = leaf.grad = g.contiguous().clone()
            self.shared.discard(key)
        return g

    def gather(self, i: Instr) -> None:
        """Start GATHER ``i`` (pieces to full leaves); the stage's first F or R waits for it."""
        x, o = self.x, self.owner[i.stage]
        ex, (d, c, ep) = x.experts.get(o, frozenset()), x.layout
        h, done = gather_stage(self.t, x.shards[o], self.leaves[o], d, c, i.group, ex, ep)
        pending = _Pending(h, done)
        self.reductions.append(pending)
        self.gathering[o] = pending

    def _gathered(self, s: int) -> Generator[Handle, None, None]:
        o = self.owner[s]
        if (pending := self.gathering.pop(o, None)) is not None:
            yield from pending.finish()
            if (casts := self.x.casts.get(o)) is not None:  # compute copies of gathered values
                self.compute[o] = compute_leaves(self.leaves[o], casts)

    def scatter(self, i: Instr) -> None:
        """Start SCATTER ``i``: reduce-scatter what the stage's gradients gathered since its
        previous SCATTER (all of them, or one microbatch's: ZeRO-2), averaged over the copies;
        this copy adds its pieces into :attr:`pieces` and lets go of the full sums. Nothing
        waits for it but a tie or replica REDUCE (which reads the pieces) and the step's end."""
        x, o = self.x, self.owner[i.stage]
        leaves = self.leaves[o]
        grads = [self._grad_leaf((o, k), full=True) for k in range(len(leaves))]
        into = self.pieces.get(o)
        ex, (d, c, ep) = x.experts.get(o, frozenset()), x.layout
        h, done, self.pieces[o] = scatter_stage(self.t, grads, d, c, i.group, into, ex, ep)
        for t in leaves:
            t.grad = None
        pending = _Pending(h, done)
        self.reductions.append(pending)
        self.scattering.setdefault(o, []).append(pending)

    def _reduce(self, h: Handle, done: Callable[[], None], owners: set[int]) -> None:
        pending = _Pending(h, done)
        self.reductions.append(pending)
        for o in owners:
            self.inflight.setdefault(o, []).append(pending)

    def _scattered(self, owners: Sequence[int]) -> Generator[Handle, None, None]:
        """Finish these owners' SCATTERs in flight (their packed buffers go)."""
        for o in owners:
            for pending in self.scattering.pop(o, ()):
                yield from pending.finish()

    def _settle(self, owners: Sequence[int]) -> Generator[Handle, None, None]:
        """Finish the reductions in flight over these owners' gradients before they change,
        and their SCATTERs (ZeRO-2: the previous microbatch's packed copy goes before the next
        backward makes another full gradient)."""
        for o in owners:
            for pending in self.inflight.pop(o, ()):
                yield from pending.finish()
        yield from self._scattered(owners)

    def ready(self, i: Instr) -> Generator[Handle, None, None]:
        """Wait for what compute instruction ``i`` needs before it starts: its GATHER, its
        inputs, the reductions in flight over the gradients a B or W adds into."""
        if self.scattering:  # (ZeRO-2: the packed gradients of those done go now)
            self.scattering = {
                o: rest
                for o, ps in self.scattering.items()
                if (rest := [q for q in ps if not q.poll()])
            }
        if self.gathering and (i.op is Op.F or i.op is Op.R):  # its GATHER first
            yield from self._gathered(i.stage)
        yield from self.inputs_in(i)
        if (i.op is Op.B or i.op is Op.W) and (self.inflight or self.scattering):
            yield from self._settle([self.owner[i.stage]])  # (and the last SCATTER's copy)

    # ------------------------------------------------------------------ the loop
    def run(self) -> Generator[Handle, None, RankResult]:
        x = self.x
        clock = step_clock(x.device if x.trace else None)  # (CUDA events only when traced)
        stamp = clock.stamp
        trace: list[Any] | None = [] if x.trace else None
        spans: list[tuple[str, Any, Any]] = []  # (traced: the stages' own collectives)
        with traced(spans, stamp) if trace is not None else nullcontext():
            yield from self._instructions(trace, stamp)
        if x.scalars_group is not None:
            # A collective is enqueued only once its data exists on every rank: after the last
            # instruction, where every rank's sums are final. Posted earlier (at the start on a
            # rank without the loss, as it was), its kernel would wait on the device for the last
            # rank's loss, and a device-wide sync meanwhile (autotuning, the allocator's retry,
            # a user's synchronize) would hold this rank's host before the sends it owes: a hang.
            buf = self.result.scalar_buffer(x.device)
            self.result.scalars = (buf, self.t.all_reduce([buf], x.scalars_group))
        for h, then in self.incoming.values():  # (none in a checked program: read by now)
            yield from wait_for(h)
            if then is not None:
                then()
        self.incoming = {}
        for pending in self.reductions:
            yield from pending.finish()
        yield from reduce_tallies(self.t, self.tallied, x, self.result)  # (copies, replicas)
        # their callbacks are done: let them go
        self.reductions, self.inflight, self.scattering = [], {}, {}
        self.t.finish()
        if trace is not None:  # (CUDA: waits for the step's work)
            self.result.times = clock.resolve(trace)
            if spans:  # (resolved apart: the stages' collectives, from either pair thread)
                on = clock.resolve([t for _, a, b in spans for t in (a, b)])
                self.result.spans = [
                    (n, on[2 * k], on[2 * k + 1]) for k, (n, _, _) in enumerate(spans)
                ]
        for o, leaves in self.leaves.items():
            if o in x.shards:  # sharded: this copy's pieces (zeros where none were SCATTERed)
                at = leaf_layout(len(leaves), x.experts.get(o, frozenset()), *x.layout)
                self.result.grads[o] = own_pieces(self.pieces.get(o), leaves, at)
            else:
                self.result.grads[o] = [take_grad(t) for t in leaves]
        return self.result

    def _instructions(
        self, trace: list[Any] | None, stamp: Callable[[], Any]
    ) -> Generator[Handle, None, None]:
        """The rank's instructions, in program order (``trace``: each one's start and end)."""
        instrs = self.p.ranks[self.x.rank]
        group_of = {g[0]: g for g in groups(instrs)}  # first step -> the group's steps
        pair_of = dict(pairs(instrs))  # first half -> second half
        for t, i in enumerate(instrs):
            op = i.op
            if t in pair_of:  # an overlapped pair: both halves' inputs in, then both at once
                yield from run_pair(self, i, instrs[t + 1], trace, stamp)
                continue
            if i.joined and op in COMPUTE_OPS:  # (the second half: run with the first)
                continue
            if op in COMPUTE_OPS:  # (its start is after its inputs are in)
                yield from self.ready(i)
            if trace is not None:
                trace.append(stamp())
            if op is Op.F:
                self.forward(i)
            elif op is Op.B or op is Op.I:
                self.backward(i)
            elif op is Op.W:
                self.backward_weight(i)
            elif t in group_of:  # a SEND or RECV that starts a group (joined ones: posted)
                self.post([instrs[k] for k in group_of[t]])
            elif op is Op.R:
                self.recompute(i)
            elif op is Op.REDUCE:
                if self.inflight:  # a tie or replica sum reads what earlier reductions wrote
                    yield from self._settle(list(self.inflight))
                yield from self._scattered(list(self.scattering))  # ... and the pieces
                self.reduce(i)
            elif op is Op.SCATTER:
                self.scatter(i)
            elif op is Op.GATHER:
                self.gather(i)
            if trace is not None:
                trace.append(stamp())


def run_rank(x: RankInputs, transport: Transport) -> Generator[Handle, None, RankResult]:
    """The rank's work as a generator of waits; its return value is the :class:`RankResult`."""
    return _Rank(x, transport).run()
