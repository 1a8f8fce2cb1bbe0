"""The checkpoint directories on disk: which are complete, the atomic commit of a new one, the
newest one (:func:`latest`) and the ones kept (:func:`prune`).

A complete checkpoint is a directory holding DCP's ``.metadata`` and a ``funcpipe.json`` of this
format; a save writes into ``path + ".tmp-<nonce>"`` and :func:`commit` renames it to ``path``
(an existing one moved aside to ``path + ".old-<nonce>"`` first, deleted after), so a directory
is complete from the moment it appears under its own name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from typing import Any

from funcpipe.errors import InvalidArgument, check_int

__all__ = ["FORMAT", "INFO", "VERSION", "commit", "complete", "latest", "open_checkpoint", "prune"]

FORMAT = "funcpipe.train.checkpoint"
VERSION = 1  # of the format: what funcpipe.json says and a load requires
INFO = "funcpipe.json"
_PAUSE_ENV = "FUNCPIPE_TEST_CHECKPOINT_PAUSE"


def check_path(path: Any) -> str:
    """``path`` as a string without a trailing separator (InvalidArgument if it is not one)."""
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgument(f"path={path!r}: a directory path (str or os.PathLike)")
    p = os.fspath(path)
    if not isinstance(p, str) or not p:
        raise InvalidArgument(f"path={path!r}: a non-empty directory path")
    return p.rstrip(os.sep) or p


def read_info(path: str) -> dict[str, Any] | None:
    """The ``funcpipe.json`` of a complete checkpoint directory, else ``None``."""
    return info_or_reason(path)[0]


def info_or_reason(path: str) -> tuple[dict[str, Any] | None, str]:
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


def pause(stage: str) -> None:
    """The test hook ``FUNCPIPE_TEST_CHECKPOINT_PAUSE="<stage>:<seconds>"``: sleep at ``stage``."""
    spec = os.environ.get(_PAUSE_ENV, "")
    name, _, seconds = spec.partition(":")
    if name == stage:
        time.sleep(float(seconds or "3600"))


def fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def commit(tmp: str, path: str, nonce: str) -> None:
    """Rename ``tmp`` to ``path``; an existing ``path`` is moved aside first, deleted after."""
    parent = os.path.dirname(os.path.abspath(path))
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{nonce}"
        os.replace(path, old)
        fsync_dir(parent)
        pause("aside")
    os.replace(tmp, path)
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    # leftovers of earlier interrupted saves of this path
    base = os.path.basename(path)
    for name in os.listdir(parent):
        if name.startswith((f"{base}.tmp-", f"{base}.old-")):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def complete(directory: str | os.PathLike[str]) -> list[str]:
    """The complete checkpoints directly inside ``directory``, oldest first: by the ``step``
    each save recorded (none counts as -1), then by save time. Unfinished saves (``.tmp-``)
    are never listed; a checkpoint moved aside (``.old-``) by a save that crashed before
    renaming its replacement in is listed in place of its missing ``path``."""
    d = check_path(directory)
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return []
    found: list[tuple[int, int, str]] = []
    for name in names:
        if ".tmp-" in name:
            continue
        if ".old-" in name and os.path.lexists(os.path.join(d, name.split(".old-")[0])):
            continue
        full = os.path.join(d, name)
        info = read_info(full)
        if info is None:
            continue
        step, saved = info.get("step"), info.get("saved_ns")
        found.append(
            (step if isinstance(step, int) else -1, saved if isinstance(saved, int) else 0, full)
        )
    return [full for _, _, full in sorted(found)]


def latest(directory: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint directly inside ``directory``, or ``None``.

    Newest means the largest ``step`` given to the save (checkpoints saved without a step
    count as -1), then the latest save time. Directories of unfinished saves (``.tmp-``) are
    never returned; a checkpoint moved aside (``.old-``) by a save that crashed before
    renaming its replacement in is returned in place of its missing ``path``.
    """
    every = complete(directory)
    return every[-1] if every else None


def prune(directory: str | os.PathLike[str], keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints directly inside ``directory``
    (the order of :func:`latest`), and what interrupted saves left there (``.tmp-``
    directories); returns the paths deleted. Call it only while no save into ``directory`` is
    running (its ``.tmp-`` directory would go too): the demo calls it on the first rank right
    after each of its saves. Directories that are not checkpoints are left alone."""
    check_int("keep", keep, 1, "how many complete checkpoints to keep, an int >= 1")
    d = check_path(directory)
    gone = complete(d)[:-keep]
    with contextlib.suppress(OSError):
        gone += [os.path.join(d, n) for n in sorted(os.listdir(d)) if ".tmp-" in n]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def open_checkpoint(path: Any) -> tuple[str, dict[str, Any]]:
    """The checked path of a complete checkpoint of this format version, and its info."""
    source = check_path(path)
    info, why = info_or_reason(source)
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
