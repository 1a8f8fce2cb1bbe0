"""Sharded, atomic checkpoints of pytrees (params, optimizer state, step) with DCP.

:func:`save` flattens a state pytree to a flat dict keyed by each leaf's path
(``"params/0/0.weight"``, ``"opt/mu/1/w"``, ``"step"``) and writes it with
``torch.distributed.checkpoint`` (DCP): in a process group every rank writes the tensors it
holds, and a key held by several ranks (a data-parallel copy) is written once. ``None`` subtrees
and meta tensors (stages this rank does not hold) are skipped. :func:`load` reads a checkpoint
into the layout of a ``like`` pytree, so the number of ranks and which rank holds which key may
differ from the save. :func:`latest` finds the newest complete checkpoint in a directory.

**Atomic.** A save writes into ``path + ".tmp-<nonce>"``; after every rank has finished, rank 0
moves a previous checkpoint at ``path`` aside (``path + ".old-<nonce>"``), renames the new
directory to ``path`` and only then deletes the old one. An interrupted save therefore never
leaves a half-written checkpoint at ``path``; :func:`latest` ignores ``.tmp-`` directories and
falls back to the ``.old-`` one if a crash hit between the two renames. ``path`` must be on a
filesystem every rank sees (as DCP's file writer needs anyway), and one save at a time may write
a given ``path``.

**What is pickled.** Tensors are written by DCP and read back with
``torch.load(weights_only=True)``. ``int``, ``float`` and ``bool`` leaves are stored as 0-dim
tensors and returned as Python values of the type ``like`` has. ``funcpipe.json`` (format, step,
save time) is JSON. DCP's own ``.metadata`` file is a pickle (``pickle.dump`` of a ``Metadata``
dataclass, torch 2.13); :func:`load` reads it with a restricted unpickler that only builds DCP's
metadata classes, ``torch.Size``, dtypes, layouts and paths, and refuses anything else, so no
arbitrary object is ever unpickled. That reader, and the CRC-32 checksums a save records and a
load verifies, are in :mod:`funcpipe.train.checkpoint_integrity`.

Test hook: the environment variable ``FUNCPIPE_TEST_CHECKPOINT_PAUSE="<stage>:<seconds>"``
(stage ``written``: all files written, before the rename; ``aside``: the old checkpoint moved
aside, before the new one is renamed in) makes rank 0 sleep there, so tests can kill a save at a
chosen point.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import time
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from funcpipe.errors import FuncpipeError, InvalidArgument, check_int
from funcpipe.train.checkpoint_integrity import (
    SafeReader,
    check_against,
    check_files,
    checksums,
    gather_checksums,
    verify,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["latest", "load", "save", "state_keys"]

Tensor = torch.Tensor
FORMAT = "funcpipe.train.checkpoint"
VERSION = 1
INFO = "funcpipe.json"
_PAUSE_ENV = "FUNCPIPE_TEST_CHECKPOINT_PAUSE"
_SCALARS: dict[type, torch.dtype] = {bool: torch.bool, int: torch.int64, float: torch.float64}
_SafeReader = SafeReader  # its name here before checkpoint_integrity held it (tests read with it)


# ------------------------------------------------------------------------------ flattening
def _key(accessor: Any) -> str:
    parts = []
    for entry in accessor:
        field = getattr(entry, "field", None)  # a NamedTuple field: use its name
        parts.append(str(field if field is not None else entry.entry))
    return "/".join(parts)


def state_keys(state: Any, *, name: str = "state") -> dict[str, Any]:
    """The flat ``{key: leaf}`` view of ``state`` that checkpoints store.

    Keys are the leaves' paths joined with ``/``: dict keys, sequence indices and NamedTuple
    field names (``{"opt": AdamWState(step, mu, nu)}`` gives ``"opt/step"``, ``"opt/mu/..."``).
    ``None`` is an empty subtree and has no key. Leaves must be tensors or ``int``, ``float``,
    ``bool``; two leaves whose paths give the same key (``{"a/b": x}`` and ``{"a": {"b": y}}``)
    are an error.
    """
    out: dict[str, Any] = {}
    accessors = optree.tree_accessors(state, none_is_leaf=False)
    leaves = optree.tree_leaves(state, none_is_leaf=False)
    for acc, leaf in zip(accessors, leaves, strict=True):
        key = _key(acc)
        if not isinstance(leaf, Tensor) and type(leaf) not in _SCALARS:
            raise InvalidArgument(
                f"{acc.codify(name)}={leaf!r} is a {type(leaf).__name__}; a checkpoint holds "
                "tensors and int, float or bool values. Convert it (torch.as_tensor) or keep it "
                "out of the checkpointed state."
            )
        if key in out:
            raise InvalidArgument(
                f"{acc.codify(name)} has the checkpoint key {key!r}, which another leaf of "
                f"{name} has too (keys join the path with '/'); rename the dict keys so that "
                "paths stay distinct."
            )
        out[key] = leaf
    return out


def _held(leaf: Any) -> bool:
    """Whether this rank holds ``leaf`` (meta tensors are placeholders for other ranks' stages)."""
    return not (isinstance(leaf, Tensor) and leaf.device.type == "meta")


def _to_tensor(key: str, value: Any) -> Tensor:
    if isinstance(value, Tensor):
        return value.detach()
    if type(value) is int and not -(2**63) <= value < 2**63:
        raise InvalidArgument(f"state leaf {key!r}={value!r}: ints must fit in 64 bits")
    return torch.tensor(value, dtype=_SCALARS[type(value)])


# ----------------------------------------------------------------------- process groups
def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _comm_device(group: ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _agree(
    group: ProcessGroup | None, error: Exception | None, what: str, elsewhere: str | None = None
) -> int:
    """Every rank learns whether any rank of ``group`` rejected its arguments (then all raise,
    instead of the others waiting in a collective forever); returns a random nonce drawn by the
    group's first rank, the same on every rank. Single process: raise ``error``, draw a nonce.
    ``elsewhere``: what the ranks without an error raise (``{n}`` the count of those with one).
    """
    if not _dist_on():
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
def _quiet_single_process() -> Iterator[None]:
    """DCP warns when it runs without a process group; that is the intended single-process use."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# -------------------------------------------------------------------------------- saving
def _check_path(path: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgument(f"path={path!r}: a directory path (str or os.PathLike)")
    p = os.fspath(path)
    if not isinstance(p, str) or not p:
        raise InvalidArgument(f"path={path!r}: a non-empty directory path")
    return p.rstrip(os.sep) or p


def _read_info(path: str) -> dict[str, Any] | None:
    """The ``funcpipe.json`` of a complete checkpoint directory, else ``None``."""
    return _info_or_reason(path)[0]


def _info_or_reason(path: str) -> tuple[dict[str, Any] | None, str]:
    """(the ``funcpipe.json`` of a complete checkpoint, "") or (None, why it is not one: "" when
    neither file is there, or no directory)."""
    if not os.path.isdir(path):
        return None, ""
    has_metadata = os.path.isfile(os.path.join(path, ".metadata"))
    try:
        with open(os.path.join(path, INFO)) as f:
            info = json.load(f)
    except FileNotFoundError:
        return None, "it has a .metadata but no funcpipe.json" if has_metadata else ""
    except ValueError as e:  # not JSON, or not UTF-8
        return None, f"its funcpipe.json is corrupt ({e})"
    except OSError as e:
        return None, f"its funcpipe.json cannot be read ({e})"
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        got = info.get("format") if isinstance(info, dict) else type(info).__name__
        return None, f"its funcpipe.json was not written by {FORMAT} (format {got!r})"
    if not has_metadata:
        return None, "it has a funcpipe.json but no .metadata (DCP's index of the tensors)"
    return info, ""


def _pause(stage: str) -> None:
    spec = os.environ.get(_PAUSE_ENV, "")
    name, _, seconds = spec.partition(":")
    if name == stage:
        time.sleep(float(seconds or "3600"))


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _commit(tmp: str, path: str, nonce: str) -> None:
    """Rename ``tmp`` to ``path``; an existing ``path`` is moved aside first, deleted after."""
    parent = os.path.dirname(os.path.abspath(path))
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{nonce}"
        os.replace(path, old)
        _fsync_dir(parent)
        _pause("aside")
    os.replace(tmp, path)
    _fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    # leftovers of earlier interrupted saves of this path
    base = os.path.basename(path)
    for name in os.listdir(parent):
        if name.startswith((f"{base}.tmp-", f"{base}.old-")):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def save(
    path: str | os.PathLike[str],
    state: Any,
    *,
    step: int | None = None,
    group: ProcessGroup | None = None,
) -> str:
    """Write ``state`` (a pytree) to the checkpoint directory ``path``, atomically.

    With ``torch.distributed`` initialised this is a collective over ``group`` (default: the
    world): every rank of it must call ``save`` with the same ``path``, each with the part of
    the state it holds (``None`` or meta tensors for the rest). A key held by several ranks is
    written once (their values must then be equal, as data-parallel copies are). Tensor-parallel
    shards of one tensor must therefore have distinct keys (e.g. a ``tensor_rank`` level in
    the state), or be DTensors, which DCP saves and reshards by itself.

    ``step`` (an int, optional) is recorded in ``funcpipe.json`` and orders :func:`latest`.
    An existing checkpoint at ``path`` is replaced only once the new one is complete; a path
    that exists but is not a funcpipe checkpoint is never replaced. Returns ``path``.
    """
    error: Exception | None = None
    target = ""
    tensors: dict[str, Tensor] = {}
    try:
        target = _check_path(path)
        if step is not None:
            check_int("step", step, 0, "the training step, an int >= 0 (or None)")
        if os.path.lexists(target) and _read_info(target) is None:
            raise InvalidArgument(
                f"path={path!r} exists and is not a complete funcpipe checkpoint; refusing to "
                "replace it. Choose another path or remove it."
            )
        flat = state_keys(state)
        tensors = {k: _to_tensor(k, v) for k, v in flat.items() if _held(v)}
    except InvalidArgument as e:
        error = e
    nonce = f"{_agree(group, error, 'checkpoint.save'):016x}"
    on = _dist_on()
    rank = dist.get_rank(group) if on else 0
    tmp = f"{target}.tmp-{nonce}"
    try:
        with _quiet_single_process():
            dcp.save(
                tensors,
                storage_writer=FileSystemWriter(tmp),
                process_group=group,
                no_dist=not on,
            )
    except CheckpointException as e:  # a BaseException holding each rank's error
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _save_error(e, target) from None
    sums, clash = gather_checksums(checksums(tensors), group, on)
    if clash:  # every rank gathered the same table, so every rank raises here
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise FuncpipeError(
            f"not saved: {clash} A key held by several ranks is written once, so their values "
            "must be equal (data-parallel or tied copies that have drifted apart are a bug to "
            f"find); give per-rank values distinct keys. {target!r} was left as it was"
        )
    failed: OSError | None = None
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
        try:
            _write_info(tmp, info)
        except OSError as e:  # a full disk: the previous checkpoint stays as it was
            shutil.rmtree(tmp, ignore_errors=True)
            _note(e, f"funcpipe: rank 0 could not write the checkpoint {target!r}")
            failed = e
        else:
            try:
                _pause("written")
                _commit(tmp, target, nonce)
            except OSError as e:  # tmp is complete: left for latest (an .old- one is found)
                _note(e, f"funcpipe: rank 0 could not move the checkpoint {target!r} in place")
                failed = e
    if on:  # every rank learns whether rank 0 wrote it (a barrier that cannot hang on a failure)
        _agree(
            group,
            failed,
            "checkpoint.save",
            elsewhere=f"rank 0 could not finish the checkpoint {target!r} (writing {INFO} or "
            "moving it in place; its error names the cause); the previous checkpoint there, if "
            "any, was kept",
        )
    elif failed is not None:
        raise failed
    return target


def _write_info(tmp: str, info: dict[str, Any]) -> None:
    with open(os.path.join(tmp, INFO), "w") as f:
        json.dump(info, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)


def _save_error(e: CheckpointException, target: str) -> BaseException:
    """What a failed DCP save raises: the first rank's ``OSError`` itself (read-only, disk
    full, no such directory), with a note naming the checkpoint; else a FuncpipeError saying
    which rank failed how. An ``OSError`` that torch's zip writer hid behind its own error
    (a disk that fills inside ``torch.save`` gives "unexpected pos 704 vs 598", the
    ``OSError`` as its context) is found and raised in its place."""
    for rank, (exc, _) in sorted(e.failures.items()):
        cause = _os_error(exc)
        if cause is not None:
            _note(cause, f"funcpipe: rank {rank} could not write the checkpoint {target!r}")
            return cause
    return FuncpipeError(f"cannot write the checkpoint {target!r}: {_failures(e)}")


def _os_error(exc: BaseException | None) -> OSError | None:
    """``exc`` or the first ``OSError`` among its causes and contexts."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, OSError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _note(exc: BaseException, text: str) -> None:
    note = getattr(exc, "add_note", None)  # Python >= 3.11
    if note is not None:
        note(text)


def load(path: str | os.PathLike[str], like: Any, *, group: ProcessGroup | None = None) -> Any:
    """Read the checkpoint at ``path`` into a new pytree shaped like ``like``.

    ``like`` gives the structure, and per tensor leaf the shape, dtype and device of the result
    (its values are not read and it is not modified). Leaves that are ``None`` subtrees or meta
    tensors are not loaded and are returned as they are: give a rank only what it holds.
    ``int``/``float``/``bool`` leaves come back as Python values of ``like``'s type.

    With ``torch.distributed`` initialised this is a collective over ``group`` (default: the
    world). What may differ from the save: the number of ranks and which rank holds which key
    (e.g. saved by 2 ranks holding one pipeline stage each, loaded by 1 process holding both, or
    the reverse); every requested key must exist with the same shape and dtype. Re-partitioning
    the model into different stages changes the keys and is not supported; DTensor leaves are
    resharded by DCP.
    """
    error: Exception | None = None
    source = ""
    flat: dict[str, Any] = {}
    wanted: dict[str, Tensor] = {}
    info: dict[str, Any] | None = None
    try:
        source = _check_path(path)
        info, why = _info_or_reason(source)
        if info is None and why:
            raise InvalidArgument(
                f"path={path!r} is not a complete funcpipe checkpoint: {why}. A save writes "
                "both before the checkpoint appears at its path, so it was damaged or written "
                "by something else; load an earlier checkpoint (funcpipe.checkpoint.latest("
                "directory) finds the newest complete one, skipping this)."
            )
        if info is None:
            raise InvalidArgument(
                f"path={path!r} is not a complete funcpipe checkpoint (no {INFO} and "
                ".metadata); use funcpipe.checkpoint.latest(directory) to find the newest "
                "complete one."
            )
        if info.get("version") != VERSION:
            raise InvalidArgument(
                f"the checkpoint {source!r} has format version {info.get('version')!r}; this "
                f"funcpipe reads version {VERSION}"
            )
        flat = state_keys(like, name="like")
        for k, v in flat.items():
            if isinstance(v, Tensor):
                if _held(v):
                    wanted[k] = torch.empty_like(v)
            else:
                wanted[k] = torch.empty((), dtype=_SCALARS[type(v)])
        metadata = SafeReader(source).read_metadata()
        check_against(source, metadata, wanted)
        check_files(source, metadata, wanted)
    except (InvalidArgument, FuncpipeError) as e:
        error = e
    _agree(group, error, "checkpoint.load")
    on = _dist_on()
    try:
        with _quiet_single_process():
            dcp.load(wanted, storage_reader=SafeReader(source), process_group=group, no_dist=not on)
    except CheckpointException as e:  # a BaseException: say what failed, as a FuncpipeError
        raise FuncpipeError(
            f"cannot read the tensors of the checkpoint {source!r}: {_failures(e)}"
        ) from None
    corrupt: FuncpipeError | None = None
    try:
        verify(source, info or {}, wanted)
    except FuncpipeError as e:
        corrupt = e
    if on:  # a rank that found corruption must not leave the others running on
        _agree(
            group,
            corrupt,
            "checkpoint.load",
            elsewhere=f"the checkpoint {source!r} is corrupt: "
            "{n} other rank(s) found data "
            "that does not match the checksum recorded when it was saved (their errors name "
            "the key). Load an earlier checkpoint, or save again from a good state",
        )
    elif corrupt is not None:
        raise corrupt
    leaves = []
    for k, v in flat.items():
        if k not in wanted:
            leaves.append(v)
        elif isinstance(v, Tensor):
            leaves.append(wanted[k])
        else:
            leaves.append(type(v)(wanted[k].item()))
    return optree.tree_unflatten(optree.tree_structure(like, none_is_leaf=False), leaves)


def _failures(e: CheckpointException) -> str:
    """One line per failed rank: the error's first line and any line naming a refused global
    (what ``torch.load(weights_only=True)`` says when it refuses a pickled object)."""
    parts = []
    for rank, (exc, _) in sorted(e.failures.items()):
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        keep = lines[:1] + [ln for ln in lines[1:] if "GLOBAL" in ln]
        parts.append(f"rank {rank}: {type(exc).__name__}: {' '.join(keep)}")
    return "; ".join(parts)


def latest(directory: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint directly inside ``directory``, or ``None``.

    Newest means the largest ``step`` given to :func:`save` (checkpoints saved without a step
    count as -1), then the latest save time. Directories of unfinished saves (``.tmp-``) are
    never returned; a checkpoint moved aside (``.old-``) by a save that crashed before
    renaming its replacement in is returned in place of its missing ``path``.
    """
    d = _check_path(directory)
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return None
    best: tuple[int, int, str] | None = None
    for name in names:
        if ".tmp-" in name:
            continue
        if ".old-" in name and os.path.lexists(os.path.join(d, name.split(".old-")[0])):
            continue
        full = os.path.join(d, name)
        info = _read_info(full)
        if info is None:
            continue
        step = info.get("step")
        saved = info.get("saved_ns")
        rank = (
            step if isinstance(step, int) else -1,
            saved if isinstance(saved, int) else 0,
            full,
        )
        if best is None or rank > best:
            best = rank
    return None if best is None else best[2]
