"""Sharded, atomic checkpoints of pytrees (params, optimizer state, step) with DCP.

:func:`save` flattens a state pytree to a flat dict keyed by each leaf's path
(``"params/0/0.weight"``, ``"opt/mu/1/w"``, ``"step"``) and writes it with
``torch.distributed.checkpoint`` (DCP): in a process group every rank writes the tensors it
holds, and a key held by several ranks (a data-parallel copy) is written once. ``None`` subtrees
and meta tensors (stages this rank does not hold) are skipped. :func:`load` reads a checkpoint
into the layout of a ``like`` pytree, so the number of ranks and which rank holds which key may
differ from the save. :func:`latest` finds the newest complete checkpoint in a directory.

:func:`save_model` / :func:`load_model` key a model's state by its own parameter names and the
region of each full tensor a rank holds (:mod:`funcpipe.train.checkpoint_regions`,
:mod:`funcpipe.train.checkpoint_named`), so it loads at another stage split, tensor layout or
optimizer-state sharding; they share the atomic write, the checks and the checksums below.

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
from collections.abc import Callable, Iterator, Sequence
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
    failures,
    gather_checksums,
    note,
    save_error,
    verify,
)
from funcpipe.train.checkpoint_named import NAMED, Loaded, merge_tables, named_pieces, plan_load
from funcpipe.train.checkpoint_regions import SCALAR_DTYPES, Naming, Region, state_keys

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "Loaded",
    "Naming",
    "Region",
    "by_names",
    "latest",
    "load",
    "load_model",
    "save",
    "save_model",
    "state_keys",
]

Tensor = torch.Tensor
FORMAT = "funcpipe.train.checkpoint"
VERSION = 1
INFO = "funcpipe.json"
_PAUSE_ENV = "FUNCPIPE_TEST_CHECKPOINT_PAUSE"
_SafeReader = SafeReader  # its name here before checkpoint_integrity held it (tests read with it)


# ------------------------------------------------------------------------------ flattening
def _held(leaf: Any) -> bool:
    """Whether this rank holds ``leaf`` (meta tensors are placeholders for other ranks' stages)."""
    return not (isinstance(leaf, Tensor) and leaf.device.type == "meta")


def _to_tensor(key: str, value: Any) -> Tensor:
    if isinstance(value, Tensor):
        return value.detach()
    if type(value) is int and not -(2**63) <= value < 2**63:
        raise InvalidArgument(f"state leaf {key!r}={value!r}: ints must fit in 64 bits")
    return torch.tensor(value, dtype=SCALAR_DTYPES[type(value)])


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
    the state), or be DTensors, which DCP saves and reshards by itself; :func:`save_model`
    keys a model's state by its own names and the region each rank holds instead.

    ``step`` (an int, optional) is recorded in ``funcpipe.json`` and orders :func:`latest`.
    An existing checkpoint at ``path`` is replaced only once the new one is complete; a path
    that exists but is not a funcpipe checkpoint is never replaced. Returns ``path``.
    """

    def prepare() -> tuple[dict[str, Tensor], dict[str, Any] | None]:
        flat = state_keys(state)
        return {k: _to_tensor(k, v) for k, v in flat.items() if _held(v)}, None

    return _save_with(path, prepare, step=step, group=group)


def _save_with(
    path: str | os.PathLike[str],
    prepare: Callable[[], tuple[dict[str, Tensor], dict[str, Any] | None]],
    *,
    step: int | None,
    group: ProcessGroup | None,
) -> str:
    """:func:`save` of the tensors ``prepare()`` returns (it may raise InvalidArgument), with
    its table (merged over the ranks, or None) recorded in ``funcpipe.json``."""
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
    nonce = f"{_agree(group, error, 'checkpoint.save'):016x}"
    on = _dist_on()
    rank = dist.get_rank(group) if on else 0
    if table is not None:  # the same on every rank: a conflict raises on all, before writing
        table = merge_tables(table, group if on else None, on)
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
        if table is not None:
            info["keys"] = NAMED
            info.update(table)
        try:
            _write_info(tmp, info)
        except OSError as e:  # a full disk: the previous checkpoint stays as it was
            shutil.rmtree(tmp, ignore_errors=True)
            note(e, f"funcpipe: rank 0 could not write the checkpoint {target!r}")
            failed = e
        else:
            try:
                _pause("written")
                _commit(tmp, target, nonce)
            except OSError as e:  # tmp is complete: left for latest (an .old- one is found)
                note(e, f"funcpipe: rank 0 could not move the checkpoint {target!r} in place")
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


def load(path: str | os.PathLike[str], like: Any, *, group: ProcessGroup | None = None) -> Any:
    """Read the checkpoint at ``path`` into a new pytree shaped like ``like``.

    ``like`` gives the structure, and per tensor leaf the shape, dtype and device of the result
    (its values are not read and it is not modified). Leaves that are ``None`` subtrees or meta
    tensors are not loaded and are returned as they are: give a rank only what it holds.
    ``int``/``float``/``bool`` leaves come back as Python values of ``like``'s type.

    With ``torch.distributed`` initialised this is a collective over ``group`` (default: the
    world). What may differ from the save: the number of ranks and which rank holds which key
    (e.g. saved by 2 ranks holding one pipeline stage each, loaded by 1 process holding both, or
    the reverse); every requested key must exist with the same shape and dtype. A checkpoint of
    :func:`save_model` (keyed by model names, loadable at any stage split and tensor layout) is
    read with :func:`load_model`.
    """
    error: Exception | None = None
    source = ""
    flat: dict[str, Any] = {}
    wanted: dict[str, Tensor] = {}
    info: dict[str, Any] = {}
    try:
        source, info = _open(path)
        if info.get("keys") == NAMED:
            raise InvalidArgument(
                f"the checkpoint {source!r} was written by checkpoint.save_model: it is keyed "
                "by the model's parameter names and the region of each tensor a rank held, not "
                "by the paths of a pytree; read it with checkpoint.load_model(path, params, "
                "opt_state=..., naming=...)"
            )
        flat = state_keys(like, name="like")
        for k, v in flat.items():
            if isinstance(v, Tensor):
                if _held(v):
                    wanted[k] = torch.empty_like(v)
            else:
                wanted[k] = torch.empty((), dtype=SCALAR_DTYPES[type(v)])
        _check_stored(source, wanted)
    except (InvalidArgument, FuncpipeError) as e:
        error = e
    _read(source, info, wanted, group, error)
    leaves = []
    for k, v in flat.items():
        if k not in wanted:
            leaves.append(v)
        elif isinstance(v, Tensor):
            leaves.append(wanted[k])
        else:
            leaves.append(type(v)(wanted[k].item()))
    return optree.tree_unflatten(optree.tree_structure(like, none_is_leaf=False), leaves)


def _open(path: Any) -> tuple[str, dict[str, Any]]:
    """The checked path of a complete checkpoint of this format version, and its info."""
    source = _check_path(path)
    info, why = _info_or_reason(source)
    if info is None and why:
        raise InvalidArgument(
            f"path={path!r} is not a complete funcpipe checkpoint: {why}. A save writes "
            "both before the checkpoint appears at its path, so it was damaged or written "
            "by something else; load an earlier checkpoint (funcpipe.train.checkpoint.latest("
            "directory) finds the newest complete one, skipping this)."
        )
    if info is None:
        raise InvalidArgument(
            f"path={path!r} is not a complete funcpipe checkpoint (no {INFO} and "
            ".metadata); use funcpipe.train.checkpoint.latest(directory) to find the newest "
            "complete one."
        )
    if info.get("version") != VERSION:
        raise InvalidArgument(
            f"the checkpoint {source!r} has format version {info.get('version')!r}; this "
            f"funcpipe reads version {VERSION}"
        )
    return source, info


def _check_stored(source: str, wanted: dict[str, Tensor], metadata: Any = None) -> None:
    """Every key of ``wanted`` is stored with its shape and dtype, in data files that are whole
    (``metadata``: the checkpoint's, where the caller has read it already)."""
    if metadata is None:
        metadata = SafeReader(source).read_metadata()
    check_against(source, metadata, wanted)
    check_files(source, metadata, wanted)


def _read(
    source: str,
    info: dict[str, Any],
    wanted: dict[str, Tensor],
    group: ProcessGroup | None,
    error: Exception | None,
) -> None:
    """Fill ``wanted`` from the checkpoint and verify the checksums: a collective in which
    every rank learns first whether any rank rejected its arguments (``error``), and after
    whether any rank found corrupt data."""
    _agree(group, error, "checkpoint.load")
    on = _dist_on()
    try:
        with _quiet_single_process():
            dcp.load(wanted, storage_reader=SafeReader(source), process_group=group, no_dist=not on)
    except CheckpointException as e:  # a BaseException: say what failed, as a FuncpipeError
        raise FuncpipeError(
            f"cannot read the tensors of the checkpoint {source!r}: {failures(e)}"
        ) from None
    corrupt: FuncpipeError | None = None
    try:
        verify(source, info, wanted)
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


# ------------------------------------------------------------------ keyed by model names
def save_model(
    path: str | os.PathLike[str],
    params: Sequence[Any],
    *,
    opt_state: Any = None,
    naming: Naming | None = None,
    step: int | None = None,
    group: ProcessGroup | None = None,
) -> str:
    """Write a model's state keyed by its own parameter names, loadable at any layout.

    ``params``: this run's per-stage params (``params[s]`` a pytree; ``None`` or meta tensors
    for stages this rank does not hold). ``opt_state``: the optimizer state of ``init(params)``
    (a NamedTuple such as ``AdamWState``: its int fields are stored as they are, its trees shaped
    like ``params`` leaf by leaf as the params are). ``naming``: how leaves map to the model's
    names and which region of each full tensor this rank holds (:class:`Naming`; default: every
    leaf whole, named by its path inside its stage). A collective over ``group`` like
    :func:`save`, and as atomic; the copies several ranks hold of one region (data-parallel
    copies, tied parameters) are written once and must be equal. Returns ``path``.
    """
    return _save_with(path, lambda: named_pieces(params, opt_state, naming), step=step, group=group)


def load_model(
    path: str | os.PathLike[str],
    params: Sequence[Any],
    *,
    opt_state: Any = None,
    naming: Naming | None = None,
    group: ProcessGroup | None = None,
) -> Loaded:
    """Read a :func:`save_model` checkpoint into this run's layout, whatever the save's was.

    ``params`` (and ``opt_state``, when given) are templates as for :func:`load`: their
    structure, and per tensor leaf the shape, dtype and device of the result; they are not
    modified. ``naming`` says which model tensor and region each leaf is. Each leaf is put
    together from the saved pieces that overlap its region, so the stage split, the tensor and
    data-parallel sizes and the optimizer-state sharding may differ from the save. Every
    mismatch (a name the checkpoint lacks, another full shape or dtype, a region no saved piece
    covers) raises InvalidArgument on every rank before any tensor is read. Returns
    ``Loaded(params, opt_state, step)``.
    """
    error: Exception | None = None
    source, plan = "", None
    info: dict[str, Any] = {}
    try:
        source, info = _open(path)
        if info.get("keys") != NAMED:
            raise InvalidArgument(
                f"the checkpoint {source!r} was written by checkpoint.save (keyed by pytree "
                "paths, for the stage split and tensor layout it was saved at), not by "
                "save_model. It still loads with checkpoint.load(path, like) at that layout; "
                "to convert it, load it there and write it with checkpoint.save_model(new_path, "
                "state['params'], opt_state=state['opt'], naming=...)."
            )
        metadata = SafeReader(source).read_metadata()
        plan = plan_load(source, info, metadata, params, opt_state, naming)
        _check_stored(source, plan.wanted, metadata)
    except (InvalidArgument, FuncpipeError) as e:
        error = e
    _read(source, info, plan.wanted if plan is not None else {}, group, error)
    if plan is None:  # (_read raised the error that left no plan, on every rank)
        raise RuntimeError("funcpipe internal error: load_model has no plan and no error")
    return plan.finish(info.get("step"))


def by_names(path: str | os.PathLike[str]) -> bool:
    """Whether the checkpoint at ``path`` was written by :func:`save_model` (keyed by the model's
    names: :func:`load_model` reads it at any layout) rather than by :func:`save` (keyed by
    pytree paths: :func:`load` reads it at its own layout)."""
    _, info = _open(path)
    return bool(info.get("keys") == NAMED)


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
