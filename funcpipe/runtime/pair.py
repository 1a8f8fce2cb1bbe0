"""An overlapped pair (``F s0 m5`` then ``& B s3 m2``): one microbatch's forward while another's
backward computes.

The rank's thread runs the forward; a second thread, started for the pair and joined at its
end, runs the backward's gradient computation (``autodiff.backward`` or ``backward_input``).
Everything else, the bookkeeping before and after each half (which buffers, which sums, the
checks, where the gradients go), stays on the rank's thread, so the interpreter's state is
touched by one thread only.

**Waiting points.** A stage exposes where it waits by calling funcpipe's collectives (the
expert all-to-all, tensor-parallel reductions): while one half blocks in one, the other half
runs. Nothing in the stage changes and it stays a pure function; a stage that calls none runs
its halves side by side all the same (on a CPU, on two cores when there are two), with the
same result as run one after the other: the two read nothing the other writes (different
microbatches; the backward adds into the gradient sums, which no forward reads).

**One order per communicator.** The forward's collectives and the backward's run on two
process groups of the same ranks (``Axis.group`` and ``Axis.back``,
:func:`funcpipe.parallel.collectives.group_of`), so however the two threads interleave, each
group sees the calls in the program's order of its forwards (resp. backwards) on every rank of
it: NCCL's rule holds without a fixed interleaving.

**Random numbers.** The forward draws from its own key as alone, and funcpipe's backward draws
none (its recomputation is an ``R`` of its own, never in a pair). A stage that recomputes inside
its own backward with ``torch.utils.checkpoint`` around dropout does draw there: it would
restore and draw from torch's one generator per process while the forward draws from it on the
other thread, and the masks could differ from the halves' alone. So the first paired backward
of each stage in a step runs under a dispatch mode that refuses any random operation
(``torch.Tag.nondeterministic_seeded``): such a stage fails there with an error that says to use
``Pipeline(recompute=...)`` (an ``R``) for it, or no pairs; a stage whose backward drew nothing
is not watched again in that step.

**On CUDA the halves run one after the other** (:func:`on_two_threads`), on the rank's
thread. What torch would do with two threads there, read in its source
(``torch/csrc/autograd/engine.cpp``; not run, no GPU was at hand): the backward's CUDA nodes
run on autograd's own thread for the device, each on the stream its forward ran on
(``Node::stream()``, guarded in ``Engine::evaluate_function``), with the graph task set
(``GraphTaskGuard``), so :func:`~funcpipe.parallel.collectives.group_of` would hold there; both
halves' kernels and collectives then queue on the rank's one stream. A stream runs in order:
the all-to-alls could not run under the other half's kernels, and since a collective starts
only after what its stream ran before it, two ranks whose threads issued the halves'
collectives in different orders would wait for each other for ever. What two threads could
still hide on a GPU is host time (one thread launching while the other waits in the split
sizes' device-to-host copy), not worth a hang. Overlap on a GPU needs the halves on two
streams, each with its own order of collectives: autograd puts a backward on its forward's
stream, so a paired forward would go to the stream its partner's forward did not, with
``record_stream`` for every tensor that crosses. Not built: no GPU was here to test or
measure it.

**Faults.** An exception in either half is raised on the rank's thread once both halves are
done (the backward's after the forward's finished); a half blocked in a collective whose peer
died ends at the process group's timeout, so the join is bounded as every wait is.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Generator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from funcpipe.errors import InvalidArgument
from funcpipe.runtime.stage_call import backward_noted
from funcpipe.runtime.transport_common import Handle
from funcpipe.schedule.ir import Instr, Op

__all__ = ["on_two_threads", "run_pair"]


def on_two_threads(device: torch.device) -> bool:
    """Whether a pair's halves run on two threads on ``device``: on a CPU (gloo), where each
    collective blocks only the thread that called it. Elsewhere they run one after the other
    on the rank's thread, the same result: on a GPU both halves' kernels and collectives queue
    on the rank's one stream (module docstring), so two threads would hide no communication,
    and the order in which they issue the two halves' collectives, which timing decides, could
    differ between two ranks: each collective starts only after what its stream ran before it,
    so rank A's forward all-to-all, queued before its backward one, would wait for rank B's,
    queued after B's backward one, which waits for A's: a hang, although the two halves'
    collectives are on two process groups."""
    return device.type == "cpu"


def run_pair(
    rank: Any, first: Instr, second: Instr, trace: list[Any] | None, stamp: Callable[[], Any]
) -> Generator[Handle, None, None]:
    """Run the pair ``first`` & ``second`` on interpreter rank ``rank`` (its ``_Rank``): wait for
    both halves' inputs, then the forward here and the backward on a second thread (on a CPU;
    elsewhere one after the other: :func:`on_two_threads`); ``trace`` gets each half's start and
    end (the first half's first)."""
    for i in (first, second):
        yield from rank.ready(i)
    device = rank.x.device
    if not on_two_threads(device):
        for i in (first, second):
            start = stamp() if trace is not None else None
            if i.op is Op.F:
                rank.forward(i)
            else:
                rank.backward(i)
            if trace is not None:
                trace.extend((start, stamp()))
        return
    fwd, bwd = (first, second) if first.op is Op.F else (second, first)
    work = rank.backward_work(bwd)
    out: dict[str, Any] = {}
    quiet: set[int] = rank.drawless  # (this step's)
    watch = bwd.stage not in quiet

    def backward() -> None:
        try:
            out["start"] = stamp() if trace is not None else None
            with (
                backward_noted(rank.x, bwd.op.name, bwd.stage, bwd.microbatch),
                _NoDraws(bwd, fwd) if watch else contextlib.nullcontext(),
            ):
                out["grads"] = work()
            out["end"] = stamp() if trace is not None else None
        except BaseException as e:  # (raised on the rank's thread, after the forward)
            out["error"] = e

    helper = threading.Thread(target=backward, name=f"funcpipe-pair-{bwd}", daemon=True)
    f_start = stamp() if trace is not None else None
    helper.start()
    try:
        rank.forward(fwd)
    finally:
        f_end = stamp() if trace is not None else None
        helper.join()
    if "error" in out:
        error = out["error"]
        if hasattr(error, "add_note"):
            error.add_note(f"funcpipe: on the pair's second thread, overlapped with '{fwd}'")
        raise error
    quiet.add(bwd.stage)
    rank.finish_backward(bwd, out["grads"])
    if trace is not None:
        spans = {fwd: (f_start, f_end), bwd: (out["start"], out["end"])}
        for i in (first, second):
            trace.extend(spans[i])


class _NoDraws(TorchDispatchMode):
    """Refuses a random operation in a paired backward (module docstring, "Random numbers")."""

    def __init__(self, bwd: Instr, fwd: Instr) -> None:
        super().__init__()
        self.bwd, self.fwd = bwd, fwd

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            raise InvalidArgument(
                f"the backward of stage {self.bwd.stage} (microbatch {self.bwd.microbatch}), "
                f"overlapped with '{self.fwd}', draws random numbers ({func}): a stage that "
                "recomputes inside its backward (torch.utils.checkpoint around dropout) would "
                "share torch's one generator with the forward running on the other thread, and "
                "the masks would not be the ones drawn alone. Recompute it with "
                "Pipeline(recompute=...) instead (an R of its own, never in a pair), or run the "
                "program without pairs (generate(..., overlap=False))"
            )
        return func(*args, **(kwargs or {}))
