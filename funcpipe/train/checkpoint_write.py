"""Writing a checkpoint: the collective, atomic save that :func:`funcpipe.train.checkpoint.save`,
``save_model`` and ``save_model_async`` share (:func:`save_with`), and the agreement between
ranks that keeps a rank's bad argument or failed write from leaving the others waiting.

Every rank writes its tensors with DCP into ``path + ".tmp-<nonce>"``; the checksums of the
copies several ranks hold are compared; rank 0 checks that it sees every rank's files (one
filesystem all ranks see), writes ``funcpipe.json`` and commits; every rank learns rank 0's
verdict.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from funcpipe.errors import FuncpipeError, InvalidArgument, check_int
from funcpipe.train.checkpoint_dirs import FORMAT, INFO, VERSION
from funcpipe.train.checkpoint_dirs import check_path as _check_path
from funcpipe.train.checkpoint_dirs import commit as _commit
from funcpipe.train.checkpoint_dirs import fsync_dir as _fsync_dir
from funcpipe.train.checkpoint_dirs import pause as _pause
from funcpipe.train.checkpoint_dirs import read_info as _read_info
from funcpipe.train.checkpoint_integrity import (
    checksums,
    gather_checksums,
    note,
    save_error,
    unseen_ranks,
)
from funcpipe.train.checkpoint_named import NAMED, merge_tables

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["agree", "dist_on", "quiet_single_process", "save_with"]

Tensor = torch.Tensor


def dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _comm_device(group: ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(
    group: ProcessGroup | None, error: Exception | None, what: str, elsewhere: str | None = None
) -> int:
    """Every rank learns whether any rank of ``group`` rejected its arguments (then all raise,
    instead of the others waiting in a collective forever); returns a random nonce drawn by the
    group's first rank, the same on every rank. Single process: raise ``error``, draw a nonce.
    ``elsewhere``: what the ranks without an error raise (``{n}`` the count of those with one).
    """
    if not dist_on():
        if error is not None:
            raise error
        return secrets.randbits(62)
    first = dist.get_rank(group) == 0
    flags = torch.tensor(
        [0 if error is None else 1, secrets.randbits(62) if first else 0],
        dtype=torch.int64,
        device=_comm_device(group),
    )
    dist.all_reduce(flags, op=dist.ReduceOp.SUM, group=group)
    if error is not None:
        raise error
    if int(flags[0]) > 0:
        if elsewhere is not None:
            raise FuncpipeError(elsewhere.replace("{n}", str(int(flags[0]))))
        raise InvalidArgument(
            f"{int(flags[0])} other rank(s) of the group rejected their arguments to {what} "
            "(their errors name the problem); no rank wrote or read anything"
        )
    return int(flags[1])


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns when it runs without a process group; that is the intended single-process use."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_with(
    path: str | os.PathLike[str],
    prepare: Callable[[], tuple[dict[str, Tensor], dict[str, Any] | None]],
    *,
    step: int | None,
    group: ProcessGroup | None,
    unchanged: Callable[[], FuncpipeError | None] | None = None,
) -> str:
    """:func:`save` of the tensors ``prepare()`` returns (it may raise InvalidArgument), with
    its table (merged over the ranks, or None) recorded in ``funcpipe.json``. ``unchanged``
    (a save in the background): once written, whether a tensor was modified meanwhile (an
    error that stops the save on every rank, or None)."""
    error: Exception | None = None
    target = ""
    tensors: dict[str, Tensor] = {}
    table: dict[str, Any] | None = None
    try:
        target = _check_path(path)
        if step is not None:
            check_int("step", step, 0, "the training step, an int >= 0 (or None)")
        if os.path.lexists(target) and _read_info(target) is None:
            raise InvalidArgument(
                f"path={path!r} exists and is not a complete funcpipe checkpoint; refusing to "
                "replace it. Choose another path or remove it."
            )
        tensors, table = prepare()
    except InvalidArgument as e:
        error = e
    nonce = f"{agree(group, error, 'checkpoint.save'):016x}"
    on = dist_on()
    rank = dist.get_rank(group) if on else 0
    if table is not None:  # the same on every rank: a conflict raises on all, before writing
        table = merge_tables(table, group if on else None, on)
    tmp = f"{target}.tmp-{nonce}"
    try:
        with quiet_single_process():
            dcp.save(
                tensors,
                storage_writer=FileSystemWriter(tmp),
                process_group=group,
                no_dist=not on,
            )
    except CheckpointException as e:  # a BaseException holding each rank's error
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise save_error(e, target) from None
    sums, clash = gather_checksums(checksums(tensors), group, on)
    if clash:  # every rank gathered the same table, so every rank raises here
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise FuncpipeError(
            f"not saved: {clash} A key held by several ranks is written once, so their values "
            "must be equal (data-parallel or tied copies that have drifted apart are a bug to "
            f"find); give per-rank values distinct keys. {target!r} was left as it was"
        )
    if unchanged is not None:
        try:
            agree(
                group,
                unchanged(),
                "checkpoint.save",
                elsewhere="not saved: {n} rank(s) modified a tensor in place while it was being "
                f"saved in the background (their errors name it); {target!r} was left as it was",
            )
        except FuncpipeError:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    failed: Exception | None = None
    others: str | None = None  # what the other ranks raise when rank 0 failed
    if rank == 0:
        info = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "saved_ns": time.time_ns(),
            "world_size": dist.get_world_size(group) if on else 1,
            "torch": torch.__version__,
            "checksums": sums,
        }
        if table is not None:
            info["keys"] = NAMED
            info.update(table)
        failed, others = _finish(tmp, target, nonce, info, on)
    if on:  # every rank learns whether rank 0 wrote it (a barrier that cannot hang on a failure)
        said = [others]
        dist.broadcast_object_list(
            said, src=dist.get_global_rank(group, 0) if group else 0, group=group
        )
        if failed is not None:
            raise failed
        if said[0] is not None:
            if said[0].startswith("not saved: rank 0 cannot see"):  # this node's copy goes too
                shutil.rmtree(tmp, ignore_errors=True)
            raise FuncpipeError(said[0])
    elif failed is not None:
        raise failed
    return target


def _finish(
    tmp: str, target: str, nonce: str, info: dict[str, Any], on: bool
) -> tuple[Exception | None, str | None]:
    """Rank 0: check that every rank's files are in ``tmp``, write ``funcpipe.json``, commit.
    Returns (the error it failed with, what the other ranks raise), or (None, None)."""
    unseen = unseen_ranks(tmp) if on else []
    if unseen:  # written where rank 0 cannot see: each node wrote to a disk of its own
        shutil.rmtree(tmp, ignore_errors=True)
        why = (
            f"not saved: rank 0 cannot see the files of rank(s) {', '.join(map(str, unseen))} "
            f"in {tmp!r}: every rank must save to one filesystem they all see (a shared disk: "
            f"NFS, Lustre, a bucket mount), not each node's own disk; {target!r} was left as "
            "it was"
        )
        return FuncpipeError(why), why
    kept = (
        f"rank 0 could not finish the checkpoint {target!r} (writing {INFO} or moving it in "
        "place; its error names the cause); the previous checkpoint there, if any, was kept"
    )
    try:
        _write_info(tmp, info)
    except OSError as e:  # a full disk: the previous checkpoint stays as it was
        shutil.rmtree(tmp, ignore_errors=True)
        note(e, f"funcpipe: rank 0 could not write the checkpoint {target!r}")
        return e, kept
    try:
        _pause("written")
        _commit(tmp, target, nonce)
    except OSError as e:  # tmp is complete: left for latest (an .old- one is found)
        note(e, f"funcpipe: rank 0 could not move the checkpoint {target!r} in place")
        return e, kept
    return None, None


def _write_info(tmp: str, info: dict[str, Any]) -> None:
    with open(os.path.join(tmp, INFO), "w") as f:
        json.dump(info, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
