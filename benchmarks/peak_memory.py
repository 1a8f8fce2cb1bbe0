"""Peak bytes of live tensor storages in one thread, on any device, CPU included.

:class:`StorageTracker` is a ``TorchDispatchMode``: every ATen op run in its thread while it is
entered passes through it, and each storage an op's outputs hold for the first time (one that
none of the op's inputs hold: ``aten.empty``, a matmul's result, a ``torch.cat``, a gradient
autograd accumulates) is counted once, by its ``nbytes``, until its Python object is finalized
(a weakref callback: the storage is freed when its last tensor or view goes). Views and
in-place results share their input's storage and add nothing. Each counted storage carries a
label (the tracker's current :meth:`labelled` context, or one :meth:`tag` gives it later), and
the tracker keeps the current bytes, the peak, and the bytes per label at the moment of the
peak.

Counted: tensors made by ops in this thread (torch.empty and friends in user or library code
are ``aten.empty*`` ops; backward on the CPU runs in the calling thread, under the mode) and
tensors made before the mode was entered once :meth:`tag` registers them. Not counted:
memory a kernel allocates for itself and frees before it returns (scratch inside one op),
allocations in other threads (gloo's own buffers inside a collective, which runs on gloo's
threads; a CUDA caching allocator's rounding and cache), tensors over memory torch did not
allocate (``torch.frombuffer``, ``from_numpy``) unless tagged, storages resized behind the
dispatcher (``UntypedStorage.resize_``; a tensor's ``resize_`` is an op and is seen), and
whatever Python objects other than tensors hold.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["StorageTracker"]


def _storage(t: Any) -> Any:
    """The untyped storage of tensor ``t`` (None for meta tensors and those without one)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # (no storage: sparse, some subclasses)
        return None


class StorageTracker(TorchDispatchMode):
    """Live bytes of the tensor storages created while it is entered (or :meth:`tag` ged).

    ``current`` / ``peak``: bytes now and at most; ``by_label`` / ``peak_by_label``: the same
    per label (the latter at the moment ``peak`` was reached); ``label``: what a storage created
    now is labelled (``"other"`` outside every :meth:`labelled`)."""

    def __init__(self) -> None:
        super().__init__()
        self.label = "other"
        self.current = 0
        self.peak = 0
        self.by_label: dict[str, int] = {}
        self.peak_by_label: dict[str, int] = {}
        # id(storage) -> [label, nbytes, weakref to the storage (its callback uncounts it)]
        self._live: dict[int, list[Any]] = {}

    # ------------------------------------------------------------------ labels
    @contextlib.contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        """Storages created inside are labelled ``label`` (nested: the innermost wins)."""
        outer, self.label = self.label, label
        try:
            yield
        finally:
            self.label = outer

    def tag(self, tree: Any, label: str) -> int:
        """Label the storages of ``tree``'s tensors ``label``: counted from now if they were
        not (tensors made before the tracker, or in another thread), moved to ``label`` if they
        were. Returns the bytes of those storages (each counted once)."""
        total, seen = 0, set()
        for t in tree_leaves(tree):
            st = _storage(t)
            if st is None or id(st) in seen:
                continue
            seen.add(id(st))
            entry = self._live.get(id(st))
            if entry is None:
                entry = self._add(st, label)
            elif entry[0] != label:
                self._move(entry[0], -entry[1])
                entry[0] = label
                self._move(label, entry[1])
            total += entry[1]
        return total

    def labels_of(self, tree: Any) -> set[str]:
        """The labels of the counted storages of ``tree``'s tensors."""
        got = (self._live.get(id(st)) for st in map(_storage, tree_leaves(tree)) if st is not None)
        return {e[0] for e in got if e is not None}

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = self.current
        self.peak_by_label = {k: v for k, v in self.by_label.items() if v}

    # ------------------------------------------------------------------ counting
    def _move(self, label: str, n: int) -> None:
        self.by_label[label] = self.by_label.get(label, 0) + n
        self.current += n
        if n > 0 and self.current > self.peak:
            self.peak = self.current
            self.peak_by_label = {k: v for k, v in self.by_label.items() if v}

    def _add(self, st: Any, label: str) -> list[Any]:
        key = id(st)

        def freed(_: Any) -> None:
            self._freed(key)

        entry = [label, st.nbytes(), weakref.ref(st, freed)]
        self._live[key] = entry
        self._move(label, entry[1])
        return entry

    def _freed(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._move(entry[0], -entry[1])

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs: set[int] | None = None
        for t in tree_leaves(out):
            st = _storage(t)
            if st is None:
                continue
            entry = self._live.get(id(st))
            if entry is not None:  # seen before: only a resize changes its bytes
                if (n := st.nbytes()) != entry[1]:
                    self._move(entry[0], n - entry[1])
                    entry[1] = n
                continue
            if inputs is None:
                inputs = {
                    id(s) for s in map(_storage, tree_leaves((args, kwargs))) if s is not None
                }
            if id(st) not in inputs:  # (an input's storage from before the tracker: not new)
                self._add(st, self.label)
        return out
