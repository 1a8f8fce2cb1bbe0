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

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import optree
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from funcpipe.errors import FuncpipeError, InvalidArgument
from funcpipe.train.checkpoint_async import PendingSave, save_model_async
from funcpipe.train.checkpoint_dirs import INFO as INFO  # (tests read the name here)
from funcpipe.train.checkpoint_dirs import latest, prune
from funcpipe.train.checkpoint_dirs import open_checkpoint as _open
from funcpipe.train.checkpoint_export import consolidate, export, load_safetensors
from funcpipe.train.checkpoint_integrity import (
    SafeReader,
    failures,
    verify,
)
from funcpipe.train.checkpoint_integrity import check_stored as _check_stored
from funcpipe.train.checkpoint_named import NAMED, Loaded, named_pieces, plan_load
from funcpipe.train.checkpoint_regions import SCALAR_DTYPES, Naming, Region, state_keys
from funcpipe.train.checkpoint_write import agree as _agree
from funcpipe.train.checkpoint_write import dist_on as _dist_on
from funcpipe.train.checkpoint_write import quiet_single_process as _quiet_single_process
from funcpipe.train.checkpoint_write import save_with as _save_with

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "Loaded",
    "Naming",
    "PendingSave",
    "Region",
    "by_names",
    "consolidate",
    "export",
    "latest",
    "load",
    "load_model",
    "load_safetensors",
    "prune",
    "save",
    "save_model",
    "save_model_async",
    "state_keys",
]

Tensor = torch.Tensor
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
# -------------------------------------------------------------------------------- saving
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
