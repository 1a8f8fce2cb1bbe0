"""The ``torch.distributed`` transport: one rank per process.

:class:`DistTransport` posts point-to-point groups as ``batch_isend_irecv`` on each pair's
process group (gloo on CPU, NCCL on CUDA), the one message path of every multi-process run, and
reduces over named process groups in buckets
(:mod:`funcpipe.runtime.buckets`). The handles here wrap torch.distributed's works: gloo's sends
are waited for by a thread per peer (``_Waiter``), scatter-gathered receives are all-gathered
once complete, and in strict mode (tests) a handle is done only once its group has completed
under NCCL's rules (:mod:`funcpipe.runtime.nccl_rules`).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from funcpipe.errors import CommunicationError
from funcpipe.runtime import buckets, nccl_rules
from funcpipe.runtime.transport_common import (
    DONE,
    P2P,
    SEND,
    Handle,
    _Counters,
    _Held,
    _nbytes,
    by_peer,
    post_by_peer,
)
from funcpipe.runtime.turns import complete
from funcpipe.schedule.p2p import PAIR

__all__ = ["DistTransport"]

Tensor = torch.Tensor


class _Works:
    """Works of torch.distributed: ``ready()`` polls them without
    blocking, ``wait()`` waits for all; then rebuilds scatter-gathered buffers from their
    slices (a collective over the tensor ranks, so only in ``wait``)."""

    nbytes = 0  # what a send keeps alive (receives: nothing)

    def __init__(
        self,
        works: Sequence[Any],
        what: str,
        on_error: Callable[[BaseException, str], BaseException],
        *,
        gathers: Sequence[tuple[Tensor, Tensor]] = (),
        split: tuple[Any, int, int] | None = None,
        reap: Callable[[], None] | None = None,
    ) -> None:
        self.works, self.what, self.on_error = list(works), what, on_error
        self.gathers, self.split, self.reap = list(gathers), split, reap
        self.done = False

    def ready(self) -> bool:
        if self.reap is not None:
            self.reap()
        if self.done:
            return True
        if self.gathers:
            return False  # the all-gather blocks: wait() does it
        try:
            if not all(_completed(w) for w in self.works):
                return False
        except RuntimeError as e:
            raise self.on_error(e, self.what) from e
        self.wait()  # complete: raises a failure, if any
        return True

    def wait(self) -> None:
        if self.done:
            return
        try:
            for w in self.works:
                w.wait()
        except RuntimeError as e:
            raise self.on_error(e, self.what) from e
        if self.gathers and self.split is not None:
            import torch.distributed as dist

            group, size, _ = self.split
            for part, full in self.gathers:  # (in a pair: in the forward's turn, as a stage's)
                complete(dist.all_gather, list(full.view(-1).chunk(size)), part, group=group)
        self.done = True
        self.works, self.gathers = [], []


def _completed(work: Any) -> bool:
    """A torch.distributed work is complete (never blocks)."""
    return bool(work.is_completed())


class _DistSend(_Works):
    """A send over torch.distributed; keeps its tensors until complete."""

    def __init__(
        self,
        works: Sequence[Any],
        tensors: Sequence[Tensor],
        what: str,
        on_error: Callable[[BaseException, str], BaseException],
    ) -> None:
        super().__init__(works, what, on_error)
        self.tensors: list[Tensor] = list(tensors)
        self.nbytes = _nbytes(self.tensors)
        self.settled: threading.Event | None = None  # set by a _Waiter watching this send
        self.error: BaseException | None = None

    def ready(self) -> bool:
        if self.settled is not None:
            if not self.settled.is_set():
                return False
            self.wait()  # at once: raises the waiter's error, if any
            return True
        done = super().ready()
        if done:
            self.tensors = []
        return done

    def wait(self) -> None:
        if self.settled is not None and not self.done:
            self.settled.wait()
            if self.error is not None:
                raise self.on_error(self.error, self.what) from self.error
            self.done, self.works = True, []
        super().wait()
        self.tensors = []


class _Waiter:
    """Waits for gloo's sends to one peer in a background thread, in posting order.

    gloo's point-to-point works say they are complete only to ``wait()`` (``is_completed()``
    stays False, and they have no future), so polling cannot tell when a send's tensors may be
    released; a thread blocked in ``wait()`` can (it holds no lock while it waits).
    """

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[tuple[_DistSend, threading.Event] | None] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=_wait_loop, args=(self.queue,), daemon=True)
        self.thread.start()
        self._end = weakref.finalize(self, self.queue.put, None)  # it ends with its waiter

    def stop(self) -> None:
        """End the thread now (once the sends it watches are done)."""
        self._end()
        self.thread.join(timeout=1.0)

    def watch(self, send: _DistSend) -> None:
        send.settled = settled = threading.Event()
        self.queue.put((send, settled))


def _wait_loop(jobs: queue.SimpleQueue[tuple[_DistSend, threading.Event] | None]) -> None:
    while (job := jobs.get()) is not None:
        send, settled = job
        try:
            _wait_all(send.works)
        except BaseException as e:  # handed to the rank's thread, which raises it
            send.error = e
        settled.set()
        del send, settled, job  # (a work holds its tensors: none may outlive its job here)


def _wait_all(works: Sequence[Any]) -> None:
    for w in works:
        w.wait()


class DistTransport(_Counters):
    """Point-to-point and collectives over ``torch.distributed``.

    ``ranks[r]`` is the global rank running program rank ``r``; ``groups`` maps a REDUCE group
    name to the process group this rank reduces over (``None``: a group of its own, no-op).
    ``on_error(exc, what)`` turns a communication failure into the error to raise (the pipeline
    uses it to name the rank that failed first).

    ``pairs`` maps a peer's program rank to the process group of this rank and that peer alone
    (:func:`funcpipe.distributed.world.join` creates one per pair of ranks that exchange messages): the
    layout :data:`~funcpipe.schedule.p2p.PAIR`. A group's operations with one peer are posted as
    one ``batch_isend_irecv`` on that pair's process group, even a single one: ProcessGroupNCCL
    runs a batch on the group's own communicator, while a lone ``isend``/``irecv`` may get a
    second, lazily created communicator for the pair, and the two would not match each other.
    A group with several peers is one batch per peer. Without ``pairs`` every peer is reached
    over the default process group (one communicator for all ranks: right in a world of two
    processes, and what tests of hand-posted groups use; ``layout`` is then ``None``).

    ``split=(group, size, coord)`` turns on scatter-gather for tensor-parallel program ranks:
    a message's tensors are the same on every rank of ``group`` (replicated activations and
    their gradients), so each of them sends only its ``1/size`` slice to its peer with the same
    coordinate, and the receivers all-gather the slices. Point-to-point bytes drop by ``size``.
    ``bytes_sent`` counts what this rank handed to point-to-point sends.

    ``all_reduce`` posts one all-reduce per bucket of its tensors (:mod:`funcpipe.runtime.buckets`:
    same dtype and device, up to 25 MiB, in the order given) and copies the sums back into them
    when it completes; a tensor alone is reduced in place.

    ``strict=True`` (for tests) adds NCCL's rules (:mod:`funcpipe.runtime.nccl_rules`) on top: the
    messages still travel over gloo, but a handle is done only once its group has
    completed under the rules, each rank publishing its side of every queue in ``store`` (default:
    the process group's) under ``key`` (default: a fresh key, the same on every process that
    builds its transports in the same order). A deadlock raises :class:`CommunicationError`
    naming the ranks and operations within about a second; ``timeout`` bounds other waits.
    """

    blocking = True  # (each process drives its own rank: a wait blocks its thread)

    def __init__(
        self,
        rank: int,
        ranks: Sequence[int],
        *,
        groups: Mapping[str, Any] | None = None,
        on_error: Callable[[BaseException, str], BaseException] | None = None,
        split: tuple[Any, int, int] | None = None,
        pairs: Mapping[int, Any] | None = None,
        strict: bool = False,
        store: Any = None,
        key: str | None = None,
        timeout: float = 1800.0,
    ) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.pairs = dict(pairs) if pairs is not None else None
        self.layout: str | None = PAIR if pairs is not None else None
        self.rank = rank
        self.ranks = list(ranks)
        self.groups = dict(groups or {})
        self.on_error = on_error or (lambda e, what: CommunicationError(f"{what}: {e}"))
        self.held = _Held()
        self.split = split if split is not None and split[1] > 1 else None
        self.bytes_sent = 0
        # gloo's works say they are complete only to wait(): a thread per peer waits for them
        self.gloo = "gloo" in str(dist.get_backend()) if dist.is_initialized() else False
        self.waiters: dict[int, _Waiter] = {}  # peer -> waiter of gloo sends to it
        self.strict: nccl_rules.Shared | None = None
        if strict:
            if store is None:
                store = dist.distributed_c10d._get_default_store()
            if key is None:
                _STRICT_KEYS[0] += 1
                key = f"funcpipe/strict-transport/{_STRICT_KEYS[0]}"
            keys = [f"{key}/{g}" for g in self.ranks]
            self.strict = nccl_rules.Shared(rank, store, keys, timeout=timeout)

    def _slice(self, t: Tensor) -> Tensor | None:
        """This rank's slice of ``t`` under scatter-gather (None: send it whole)."""
        if self.split is None or t.numel() % self.split[1]:
            return None
        _, size, coord = self.split
        return t.contiguous().view(-1).chunk(size)[coord]

    def post(self, ops: Sequence[P2P]) -> list[Handle]:
        self.held.reap()
        if not ops:
            return []
        parts = by_peer(ops)
        if parts is not None:  # one batch per peer: a batch is one process group's
            return post_by_peer(ops, parts, self._post)
        return self._post(ops)

    def _post(self, ops: Sequence[P2P]) -> list[Handle]:
        """Post ``ops`` (all with one peer) as one batch."""
        dist = self.dist
        group = None
        if self.strict is not None:
            group = self.strict.post([(op.op, op.peer, op.label) for op in ops])
        # per op: (what it moves, works it waits for, scatter-gather pairs)
        plans: list[tuple[list[Tensor], list[Any], list[tuple[Tensor, Tensor]]]] = []
        batch: list[tuple[int, Any, Tensor, int]] = []  # (op index, isend/irecv, tensor, peer)
        for k, op in enumerate(ops):
            other = self.ranks[op.peer]
            moved: list[Tensor] = []
            gathers: list[tuple[Tensor, Tensor]] = []
            for t in op.tensors:
                part = self._slice(t)
                if op.op == SEND:
                    moved.append(t.contiguous() if part is None else part.clone())
                elif part is None:
                    moved.append(t)
                else:
                    moved.append(torch.empty_like(part))
                    gathers.append((moved[-1], t))
            fn = dist.isend if op.op == SEND else dist.irecv
            batch.extend((k, fn, t, other) for t in moved)
            if op.op == SEND:
                self.bytes_sent += _nbytes(moved)
            plans.append((moved, [], gathers))
        if batch:
            # always a batch, on the pair's process group: never split across communicators
            pg = None if self.pairs is None else self.pairs[ops[0].peer]
            got = dist.batch_isend_irecv([dist.P2POp(fn, t, p, pg) for _, fn, t, p in batch])
            if len(got) == len(batch):
                for (k, *_), w in zip(batch, got, strict=True):
                    plans[k][1].append(w)
            else:  # one work for the whole group (NCCL's coalesced batch)
                for k in {k for k, *_ in batch}:
                    plans[k][1].extend(got)
        handles: list[Handle] = []
        for op, (moved, works, gathers) in zip(ops, plans, strict=True):
            what = self._what(op)
            h: _Works | _StrictDist
            if op.op == SEND:
                h = _DistSend(works, moved, what, self.on_error)
                gloo = self.gloo and all(t.device.type == "cpu" for t in moved)
                if works and gloo:
                    waiter = self.waiters.get(op.peer)
                    if waiter is None:
                        waiter = self.waiters[op.peer] = _Waiter()
                    waiter.watch(h)
            else:
                h = _Works(
                    works,
                    what,
                    self.on_error,
                    gathers=gathers,
                    split=self.split,
                    reap=self.held.reap,
                )
            if self.strict is not None and group is not None:
                h = _StrictDist(h, self.strict, group)
            if op.op == SEND:
                self.held.add(h)
            handles.append(h)
        return handles

    def _what(self, op: P2P) -> str:
        way = "send to" if op.op == SEND else "receive from"
        return f"rank {self.rank}: {way} rank {op.peer}" + (f" ({op.label})" if op.label else "")

    def all_reduce(self, tensors: Sequence[Tensor], group: str) -> Handle:
        self.held.reap()
        pg = self.groups.get(group)
        if pg is None:
            return DONE
        # one all-reduce per bucket of same-dtype tensors (funcpipe.runtime.buckets), in the
        # order given: every rank of the group forms the same buckets from the same leaves
        parts = buckets.buckets(tensors)
        works = [self.dist.all_reduce(b.flat, group=pg, async_op=True) for b in parts]
        done: Handle = _Works(
            works, f"rank {self.rank}: REDUCE over group {group!r}", self.on_error
        )
        if self.strict is not None:
            done = _StrictCollective(done, works, self.strict)
        if all(b.flat is b.tensors[0] for b in parts):
            return done  # reduced in place
        return _Unflatten(done, parts)

    def reduce_scatter(
        self, inputs: Sequence[Tensor], outputs: Sequence[Tensor], group: str
    ) -> Handle:
        """One reduce-scatter (sum) per pair: ``outputs[k]`` gets the group's sum of the slice
        of ``inputs[k]`` at this rank's position in the group."""
        return self._pairs("reduce_scatter", inputs, outputs, group)

    def all_gather(self, inputs: Sequence[Tensor], outputs: Sequence[Tensor], group: str) -> Handle:
        """One all-gather per pair: ``outputs[k]`` gets every member's ``inputs[k]`` in group
        order."""
        return self._pairs("all_gather", inputs, outputs, group)

    def _pairs(
        self, kind: str, inputs: Sequence[Tensor], outputs: Sequence[Tensor], group: str
    ) -> Handle:
        self.held.reap()
        pg = self.groups.get(group)
        if pg is None:  # a group of one
            for a, b in zip(inputs, outputs, strict=True):
                b.copy_(a.view(b.shape))
            return DONE
        d = self.dist
        what = f"rank {self.rank}: {'SCATTER' if kind == 'reduce_scatter' else 'GATHER'} over {group!r}"
        if kind == "reduce_scatter" and d.get_backend(pg) == "gloo":
            # gloo's reduce-scatter completes only inside wait() (is_completed() stays False
            # until then, torch 2.13), which polling (the strict transport's) never reaches:
            # an all-reduce of the buffer, keeping this rank's slice, completes on its own
            # (twice the bytes, on the CPU backend)
            sums = [d.all_reduce(a, group=pg, async_op=True) for a in inputs]
            got = self._strict(_Works(sums, what, self.on_error), sums)
            return _Slices(got, inputs, outputs, d.get_rank(pg))
        # (torch 2.13 names them *_single; older ones *_tensor)
        if kind == "reduce_scatter":
            fn = getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor
        else:
            fn = getattr(d, "all_gather_single", None) or d.all_gather_into_tensor
        works = [fn(b, a, group=pg, async_op=True) for a, b in zip(inputs, outputs, strict=True)]
        return self._strict(_Works(works, what, self.on_error), works)

    def _strict(self, done: Handle, works: Sequence[Any]) -> Handle:
        if self.strict is None:
            return done
        return _StrictCollective(done, works, self.strict)

    def finish(self) -> None:
        """Wait for this step's sends (a rank's last sends may still be in flight)."""
        if self.strict is not None:
            self.strict.wait(None, f"rank {self.rank}: the step's last messages")
        for send in self.held.sends:
            send.wait()
        self.held.reap()
        self.held.step_done()

    def close(self) -> None:
        """Stop the waiter threads (after the last step, with nothing in flight). Dropping the
        transport does the same, later."""
        waiters, self.waiters = list(self.waiters.values()), {}
        for w in waiters:
            w.stop()
        # a process group's threads and connections end with its last reference
        self.groups, self.split = {}, None
        if self.pairs is not None:
            self.pairs = {}


class _Unflatten:
    """A bucketed all-reduce: once it is complete, its buffers are copied back into the
    tensors they were flattened from (once)."""

    def __init__(self, inner: Handle, parts: Sequence[buckets.Bucket]) -> None:
        self.inner, self.parts = inner, list(parts)

    def ready(self) -> bool:
        if not self.inner.ready():
            return False
        self._copy_back()
        return True

    def wait(self) -> None:
        self.inner.wait()
        self._copy_back()

    def _copy_back(self) -> None:
        for b in self.parts:
            b.unflatten()
        self.parts = []  # done; the buffers are freed


class _Slices:
    """A reduce-scatter done as an all-reduce: once it is complete, this rank's slice of each
    summed input is copied into its output (once)."""

    def __init__(
        self, inner: Handle, inputs: Sequence[Tensor], outputs: Sequence[Tensor], me: int
    ) -> None:
        self.inner, self.pairs, self.me = inner, list(zip(inputs, outputs, strict=True)), me

    def ready(self) -> bool:
        if not self.inner.ready():
            return False
        self._copy()
        return True

    def wait(self) -> None:
        self.inner.wait()
        self._copy()

    def _copy(self) -> None:
        for a, b in self.pairs:
            w = b.numel()
            b.copy_(a[self.me * w : (self.me + 1) * w].view(b.shape))
        self.pairs = []


class _StrictCollective:
    """A collective of a strict :class:`DistTransport`: waiting for it keeps this rank's side of
    the point-to-point queues moving (NCCL's streams progress while the host waits; a rank
    blocked in gloo's wait would stall its peers' groups, and so itself)."""

    def __init__(self, inner: Any, works: Sequence[Any], shared: Any) -> None:
        self.inner, self.works, self.shared = inner, list(works), shared

    def ready(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        pause = 0.0005
        while not self.ready():
            self.shared.progress()
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        self.inner.wait()


_STRICT_KEYS = [0]  # strict transports built by this process (their default store keys)


class _StrictDist:
    """A handle of a strict :class:`DistTransport`: done once its group has completed under
    NCCL's rules and its own message has moved."""

    def __init__(
        self,
        inner: _Works,
        shared: nccl_rules.Shared,
        group: nccl_rules.Group,
    ) -> None:
        self.inner, self.shared, self.group = inner, shared, group
        self.nbytes = inner.nbytes

    def ready(self) -> bool:
        if not self.group.complete:
            self.shared.progress()
            if not self.group.complete:
                return False
        return self.inner.ready()

    def wait(self) -> None:
        self.shared.wait(self.group, self.inner.what)
        self.inner.wait()
