"""An overlapped pair (``F s0 m5`` then ``& B s3 m2``): one microbatch's forward while another's
backward computes.

The rank's thread runs the forward; a second thread, started for the pair and joined at its
end, runs the backward's gradient computation (``autodiff.backward`` or ``backward_input``).
Everything else, the bookkeeping before and after each half (which buffers, which sums, the
checks, where the gradients go), stays on the rank's thread, so the interpreter's state is
touched by one thread only.

**Waiting points.** A stage exposes where it waits by calling funcpipe's collectives (the
expert all-to-all, tensor-parallel reductions, :mod:`funcpipe.parallel.collectives`); nothing in
the stage changes and it stays a pure function. The two halves take turns
(:mod:`funcpipe.runtime.turns`): one runs at a time, and at each collective the running half
issues it asynchronously and lets the other run until that one issues its own or ends, then
waits for its own. So one half's all-to-all is in flight while the other computes; on CUDA it
runs on its process group's NCCL stream while the other half's kernels queue on the compute
stream (``async_op=True``; ``ProcessGroupNCCL::collective``), and on a CPU on gloo's threads.
A stage that calls no collective runs its pair in sequence, the backward then the forward,
with the same result.

**RECVs.** The backward starts once its own inputs are in; over processes the forward's may
still be arriving (their RECVs are posted before the pair), and the forward waits for them in
its first turn, after the backward's first piece ran (on CUDA the wait is the compute stream's,
queued after that piece's kernels). Waiting for a scatter-gathered message all-gathers it over
the tensor ranks (``Pipeline(scatter_gather=True)``): that call, too, takes its place in the
turns. In one process (every rank on the rank's thread, the driver switching ranks at each
wait) both halves' inputs are in before the pair starts.

**One order per communicator.** The turns fix the order of the two halves' calls (the
backward's first, the forward's first, the backward's second, ...), and every rank of an
in-stage communicator is a copy of one pipeline rank running the same pairs: each process
group sees its calls in one order on every rank of it, whatever the threads' timing.

**Random numbers.** Each half keeps its own generator state across the other's turns
(:mod:`funcpipe.runtime.turns`): the forward draws under its key as alone, and a backward that
draws (``torch.utils.checkpoint`` recomputing dropout inside the stage) draws the masks it
draws alone.

**Faults.** An exception in either half ends that half; the other stops at its next collective
without issuing it (:class:`~funcpipe.runtime.turns.OtherHalfFailed`), and the first error is
raised on the rank's thread once both are done. A half blocked in a collective whose peer died
ends at the process group's timeout, so the join is bounded as every wait is.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

from funcpipe.runtime.stage_call import backward_noted
from funcpipe.runtime.transport_common import Handle
from funcpipe.runtime.turns import together
from funcpipe.schedule.ir import Instr, Op

__all__ = ["run_pair"]


def run_pair(
    rank: Any, first: Instr, second: Instr, trace: list[Any] | None, stamp: Callable[[], Any]
) -> Generator[Handle, None, None]:
    """Run the pair ``first`` & ``second`` on interpreter rank ``rank`` (its ``_Rank``): the
    backward on a second thread once its inputs are in, the forward here, taking turns at
    their collectives; ``trace`` gets each half's start and end (the first half's first). Over
    processes the forward waits for its inputs in its first turn; in one process (every rank
    on this thread, switched at each wait) both halves' inputs are in before either starts."""
    fwd, bwd = (first, second) if first.op is Op.F else (second, first)
    yield from rank.ready(bwd)
    blocking = rank.t.blocking
    if not blocking:
        yield from rank.ready(fwd)
    work = rank.backward_work(bwd)
    spans: dict[Instr, tuple[Any, Any]] = {}

    def forward() -> None:
        if blocking:  # (over processes: each wait blocks this thread, in the forward's turn)
            for handle in rank.ready(fwd):
                handle.wait()
        start = stamp() if trace is not None else None
        try:
            rank.forward(fwd)
        finally:
            spans[fwd] = (start, stamp() if trace is not None else None)

    def backward() -> list[Any]:
        start = stamp() if trace is not None else None
        try:
            with backward_noted(rank.x, bwd.op.name, bwd.stage, bwd.microbatch):
                return work()
        except Exception as e:
            if hasattr(e, "add_note"):
                e.add_note(f"funcpipe: on the pair's second thread, overlapped with '{fwd}'")
            raise
        finally:
            spans[bwd] = (start, stamp() if trace is not None else None)

    grads = together(forward, backward, rank.x.device)
    rank.finish_backward(bwd, grads)
    if trace is not None:
        for i in (first, second):
            trace.extend(spans[i])
