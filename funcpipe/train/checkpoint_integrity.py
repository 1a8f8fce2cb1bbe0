"""What makes a checkpoint safe to read and its data trustworthy.

**Reading.** DCP's ``.metadata`` file is a pickle (``pickle.dump`` of a ``Metadata``
dataclass, torch 2.13). :class:`SafeReader` is DCP's file reader with that file read by
:class:`MetadataUnpickler`, a restricted unpickler that only builds DCP's metadata classes,
``torch.Size``, dtypes, layouts and paths, and refuses anything else, so no arbitrary object is
ever unpickled; data files outside the checkpoint directory are refused too.
:func:`check_against` checks the stored keys, shapes and dtypes against what a load asks for.

**Data files.** :func:`check_files` finds a data file that is missing or shorter than the
metadata says (emptied, truncated), before torch reads it.

**Checksums.** A save records the CRC-32 of every plain tensor it writes (:func:`checksums`,
agreed over the ranks by :func:`gather_checksums`, which also finds a key that two ranks hold
with different bytes); a load verifies what it read against them (:func:`verify`).

**Failures.** :func:`save_error` and :func:`failures` say what a failed DCP write or read
was (the ``OSError`` itself where there is one); :func:`note` adds a line to an exception.

:mod:`funcpipe.train.checkpoint` (save, load, latest) uses these.
"""

from __future__ import annotations

import io
import os
import pickle
import zlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from funcpipe.errors import FuncpipeError, InvalidArgument

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "MetadataUnpickler",
    "SafeReader",
    "check_against",
    "check_files",
    "check_stored",
    "checksums",
    "crc",
    "failures",
    "gather_checksums",
    "note",
    "save_error",
    "unseen_ranks",
    "verify",
]

Tensor = torch.Tensor


# ------------------------------------------------------------------------------- checksums
def crc(t: Tensor) -> str:
    """CRC-32 of a tensor's bytes (as stored: its dtype, row-major), as ``"crc32:xxxxxxxx"``."""
    data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    buffer: Any = data.numpy()  # no copy: the bytes in place
    return f"crc32:{zlib.crc32(buffer):08x}"


def checksums(tensors: dict[str, Tensor]) -> dict[str, str]:
    """This rank's checksums of the plain tensors it writes (DTensor shards are left out)."""
    return {k: crc(t) for k, t in tensors.items() if type(t) is Tensor}


def gather_checksums(
    mine: dict[str, str], group: ProcessGroup | None, on: bool
) -> tuple[dict[str, str], str]:
    """Every rank's checksums, one per key, and a sentence naming the first key that two ranks
    hold with different bytes ("" if none: DCP writes one rank's copy of a shared key)."""
    if not on:
        return mine, ""
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    out: dict[str, str] = {}
    holder: dict[str, int] = {}
    for rank, part in enumerate(every):
        for k, v in sorted((part or {}).items()):
            if k not in out:
                out[k], holder[k] = v, rank
            elif out[k] != v:
                return out, (
                    f"ranks {holder[k]} and {rank} both hold key {k!r} with different values "
                    f"({out[k]} and {v})."
                )
    return dict(sorted(out.items())), ""


def verify(source: str, info: dict[str, Any], loaded: dict[str, Tensor]) -> None:
    """Every loaded plain tensor matches the checksum its save recorded (checkpoints written
    before checksums were recorded have none and are not checked)."""
    sums = info.get("checksums")
    if not isinstance(sums, dict):
        return
    for k, t in loaded.items():
        want = sums.get(k)
        if want is None or type(t) is not Tensor:
            continue
        got = crc(t)
        if got != want:
            raise FuncpipeError(
                f"the checkpoint {source!r} is corrupt: the data of key {k!r} ({t.dtype}, shape "
                f"{tuple(t.shape)}) has checksum {got}, but {want} was recorded when it was "
                "saved (a flipped bit, a truncated or overwritten file). Load an earlier "
                "checkpoint, or save again from a good state"
            )


# --------------------------------------------------------------------------- reading safely
class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata only: its dataclasses, torch.Size, dtypes, layouts and paths."""

    _ALLOWED = frozenset(
        {
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("collections", "OrderedDict"),
            ("pathlib", "Path"),
            ("pathlib", "PosixPath"),
            ("pathlib", "WindowsPath"),
            ("pathlib", "PurePosixPath"),
            ("pathlib", "PureWindowsPath"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        # No dotted names: pickle resolves "a.b" attribute by attribute, so a module that merely
        # imports os (as DCP's metadata module does) would hand out os.system.
        ok = "." not in name and (
            (module, name) in self._ALLOWED
            or (module == "torch.distributed.checkpoint.metadata" and self._dcp_class(name))
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not ok:
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {module}.{name}, which is not part of DCP's "
                "metadata; funcpipe does not unpickle it"
            )
        return super().find_class(module, name)

    @staticmethod
    def _dcp_class(name: str) -> bool:
        """A class defined in DCP's metadata module (its dataclasses and enums), nothing it
        merely imports."""
        import torch.distributed.checkpoint.metadata as md

        obj = getattr(md, name, None)
        return isinstance(obj, type) and obj.__module__ == md.__name__


class SafeReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` with :class:`MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        with open(os.path.join(os.fspath(self.path), name), "rb") as f:
            raw = f.read()
        try:
            metadata = MetadataUnpickler(io.BytesIO(raw)).load()
        except Exception as e:  # refused, truncated or corrupt
            raise FuncpipeError(
                f"cannot read the checkpoint metadata {self.path}/{name}: {e}"
            ) from None
        for info in (getattr(metadata, "storage_data", None) or {}).values():
            rel = os.fspath(getattr(info, "relative_path", ""))
            if os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/"):
                raise FuncpipeError(
                    f"the checkpoint metadata {self.path}/{name} names the data file {rel!r}, "
                    "outside the checkpoint directory; funcpipe reads only files inside it"
                )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


def check_files(path: str, metadata: Any, wanted: dict[str, Tensor]) -> None:
    """Every data file holding a key of ``wanted`` exists and is as long as the metadata says:
    else a FuncpipeError naming the file (torch would raise a bare ``EOFError`` or a zip
    error)."""
    need: dict[str, int] = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        if getattr(index, "fqn", None) in wanted:
            rel = os.fspath(info.relative_path)
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(need.items()):
        try:
            size = os.path.getsize(os.path.join(path, rel))
        except OSError:
            raise FuncpipeError(
                f"the checkpoint {path!r} is damaged: its data file {rel!r} is missing (the "
                "metadata lists it). Load an earlier checkpoint (funcpipe.train.checkpoint.latest), "
                "or save again from a good state"
            ) from None
        if size < end:
            raise FuncpipeError(
                f"the checkpoint {path!r} is damaged: its data file {rel!r} is {size:,} bytes, "
                f"but the metadata records data up to byte {end:,}: the file was emptied or "
                "truncated after the save (a disk that filled, a copy that stopped short). Load "
                "an earlier checkpoint (funcpipe.train.checkpoint.latest), or save again from a good "
                "state"
            )


def unseen_ranks(tmp: str) -> list[int]:
    """The ranks whose data files the metadata of the save in ``tmp`` lists but that are not
    there (DCP's file writer names a rank's files ``__<rank>_<n>.distcp``): written by ranks
    whose ``tmp`` is another directory, on a disk of their own node."""
    metadata = SafeReader(tmp).read_metadata()
    missing: set[int] = set()
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        rel = os.fspath(info.relative_path)
        if not os.path.exists(os.path.join(tmp, rel)):
            head = rel.split("_")
            missing.add(int(head[2]) if len(head) > 2 and head[2].isdigit() else -1)
    return sorted(missing)


def check_against(path: str, metadata: Any, wanted: dict[str, Tensor]) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = metadata.state_dict_metadata
    missing = sorted(k for k in wanted if k not in stored)
    if missing:
        have = sorted(stored)
        raise InvalidArgument(
            f"the checkpoint {path!r} has no key(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}"
            f"; it has {have[:8]}{' ...' if len(have) > 8 else ''} ({len(have)} keys). `like` "
            "must have the structure of the saved state (None or meta tensors for the parts "
            "this rank does not load); see funcpipe.train.checkpoint.state_keys."
        )
    for k, t in wanted.items():
        md = stored[k]
        if not isinstance(md, TensorStorageMetadata):
            raise InvalidArgument(f"checkpoint key {k!r} in {path!r} is not a tensor")
        if tuple(md.size) != tuple(t.shape) or md.properties.dtype != t.dtype:
            raise InvalidArgument(
                f"checkpoint key {k!r} in {path!r} is {md.properties.dtype} of shape "
                f"{tuple(md.size)}, but like has {t.dtype} of shape {tuple(t.shape)}; load "
                "with a like of the saved dtype and shape, then convert."
            )


# ------------------------------------------------------------------ what a failure says
def save_error(e: CheckpointException, target: str) -> BaseException:
    """What a failed DCP save raises: the first rank's ``OSError`` itself (read-only, disk
    full, no such directory), with a note naming the checkpoint; else a FuncpipeError saying
    which rank failed how. An ``OSError`` that torch's zip writer hid behind its own error
    (a disk that fills inside ``torch.save`` gives "unexpected pos 704 vs 598", the
    ``OSError`` as its context) is found and raised in its place."""
    for rank, (exc, _) in sorted(e.failures.items()):
        cause = _os_error(exc)
        if cause is not None:
            note(cause, f"funcpipe: rank {rank} could not write the checkpoint {target!r}")
            return cause
    return FuncpipeError(f"cannot write the checkpoint {target!r}: {failures(e)}")


def _os_error(exc: BaseException | None) -> OSError | None:
    """``exc`` or the first ``OSError`` among its causes and contexts."""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, OSError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def note(exc: BaseException, text: str) -> None:
    add = getattr(exc, "add_note", None)  # Python >= 3.11
    if add is not None:
        add(text)


def failures(e: CheckpointException) -> str:
    """One line per failed rank: the error's first line and any line naming a refused global
    (what ``torch.load(weights_only=True)`` says when it refuses a pickled object)."""
    parts = []
    for rank, (exc, _) in sorted(e.failures.items()):
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        keep = lines[:1] + [ln for ln in lines[1:] if "GLOBAL" in ln]
        parts.append(f"rank {rank}: {type(exc).__name__}: {' '.join(keep)}")
    return "; ".join(parts)


def check_stored(source: str, wanted: dict[str, Tensor], metadata: Any = None) -> None:
    """Every key of ``wanted`` is stored with its shape and dtype, in data files that are whole
    (``metadata``: the checkpoint's, where the caller has read it already)."""
    if metadata is None:
        metadata = SafeReader(source).read_metadata()
    check_against(source, metadata, wanted)
    check_files(source, metadata, wanted)
