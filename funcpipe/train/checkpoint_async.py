"""Saving off the training loop's critical path: :func:`save_model_async`.

A save in the background is :func:`funcpipe.train.checkpoint.save_model` run by a thread of its
own: what the caller waits for is only the gathering of this rank's pieces (its tensors and the
table of names, no copy); the writing, the checksums, the checks across ranks and the atomic
commit happen while training goes on. The result is the same directory, as atomic.

**No copy, because values do not change.** funcpipe's params, gradients and optimizer states
are values: every step makes new tensors and no funcpipe optimizer writes into the ones it was
given. So the tensors handed to a save are the snapshot: the thread reads them as they were at
the call, while the next steps make new ones. That costs memory, not time: until the save is
written, the state it holds stays allocated (on a GPU, one more copy of this rank's params and
optimizer state on the device; the thread copies each to the host as it writes it). A tensor
modified in place meanwhile (a user's own in-place update) is found by its version counter
after the write, and the save fails on every rank, naming the key, instead of committing a
mixture of two steps.

**Its own process group.** The save's collectives (the nonce, the table, DCP's plans, the
checksums, rank 0's verdict) run on a gloo group over the save's ranks made for it at the first
background save (collective: every process of the world makes that first call, in the same
order, as it builds its Pipelines), with the job's timeout; training's collectives keep their
own groups, so the two threads never interleave operations on one communicator (the NCCL rule
the per-pair groups follow too). One save at a time: :meth:`PendingSave.wait` before the next
one, and before the end of the program.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from funcpipe.errors import FuncpipeError, check_int
from funcpipe.train.checkpoint_dirs import check_path, pause
from funcpipe.train.checkpoint_named import named_pieces
from funcpipe.train.checkpoint_regions import Naming
from funcpipe.train.checkpoint_write import save_with

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["PendingSave", "save_model_async"]

_CLAIMS: dict[Any, Any] = {}  # (default group, ranks): the background group (held to the end)


class PendingSave:
    """A :func:`save_model_async` in progress: :meth:`wait` for its path (or its error)."""

    def __init__(self, path: str, step: int | None) -> None:
        self.path = path
        self.step = step
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def done(self) -> bool:
        """Whether the save has finished (written and committed, or failed)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> str:
        """Block until the save has finished; its path, or the error it failed with (as
        :func:`save_model` would have raised it). Bounded: every wait inside the save is one of
        the group's collectives, under the job's timeout."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self.path

    def __repr__(self) -> str:
        state = "done" if self.done() else "writing"
        return f"PendingSave({self.path!r}, step={self.step}, {state})"


def _background_group(group: ProcessGroup | None) -> Any:
    """The gloo group over ``group``'s ranks that background saves use (made at the first, and again after the
    groups were destroyed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from funcpipe.distributed.groups import Claim

    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    key = (dist.group.WORLD, ranks)
    if key in _CLAIMS:
        try:
            dist.get_process_group_ranks(_CLAIMS[key][1])
            return _CLAIMS[key][1]
        except (
            KeyError,
            ValueError,
            RuntimeError,
        ):  # destroyed since (groups.destroy_all: every rank)
            del _CLAIMS[key]
    for old in [k for k in _CLAIMS if k[0] is not dist.group.WORLD]:
        del _CLAIMS[old]  # of a default group that is gone (with its groups)
    claim = Claim()
    made = claim.group(ranks, use="checkpoint in the background", backend="gloo")
    _CLAIMS[key] = (claim, made)
    return made


def save_model_async(
    path: str | os.PathLike[str],
    params: Sequence[Any],
    *,
    opt_state: Any = None,
    naming: Naming | None = None,
    step: int | None = None,
    group: ProcessGroup | None = None,
) -> PendingSave:
    """:func:`funcpipe.train.checkpoint.save_model` in the background: returns at once with a
    :class:`PendingSave`; the checkpoint at ``path`` appears, complete, when it is written.

    The arguments are those of ``save_model`` and are checked now (a naming that does not fit
    the params raises here). Every rank of ``group`` calls it at the same point of its program;
    the tensors passed must not be modified in place until :meth:`PendingSave.wait` returns
    (funcpipe's optimizers never do; a modification is found and the save refused)."""
    check_path(path)  # (bad arguments raise here, on the caller's thread, not at wait())
    if step is not None:
        check_int("step", step, 0, "the training step, an int >= 0 (or None)")
    tensors, table = named_pieces(params, opt_state, naming)
    versions = {k: t._version for k, t in tensors.items()}
    background = _background_group(group)
    pending = PendingSave(os.fspath(path), step)

    def unchanged() -> FuncpipeError | None:
        moved = sorted(k for k, t in tensors.items() if t._version != versions[k])
        if not moved:
            return None
        return FuncpipeError(
            f"not saved: {len(moved)} tensor(s) were modified in place while the background "
            f"save of {pending.path!r} was writing them (first: {moved[0]!r}); keep what you "
            "pass to save_model_async unchanged until its wait() returns (new tensors per "
            "step, as funcpipe's optimizers make), or use save_model"
        )

    def run() -> None:

        try:
            pause("background")  # (the test hook: a save that has not yet started writing)
            with torch.no_grad():
                save_with(
                    path,
                    lambda: (tensors, table),
                    step=step,
                    group=background,
                    unchanged=unchanged,
                )
        except BaseException as e:  # handed to wait(), on the caller's thread
            pending._error = e

    pending._thread = threading.Thread(target=run, name="funcpipe-checkpoint", daemon=True)
    pending._thread.start()
    return pending
