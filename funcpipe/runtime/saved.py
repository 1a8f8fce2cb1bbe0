"""Counting activation memory: the bytes autograd saves for backward, live and at peak.

:class:`SavedBytes` is a context manager around forwards. Every tensor autograd packs for
backward that is not a parameter (nor a view of one) is counted once, keyed by its storage,
offset, shape, stride and dtype, from the moment it is saved until no graph node holds it any
more. Tensors kept outside the graph (what an I leaves for its W) can be counted too, with
:meth:`SavedBytes.hold` and :meth:`SavedBytes.release`.

:func:`funcpipe.measure.profile.measure_memory` uses it to give each stage its activation
bytes for :func:`funcpipe.schedule.simulate.peak_memory`; the memory benchmark uses it to
measure a whole step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["Key", "SavedBytes"]

Tensor = torch.Tensor
Key = tuple[Any, ...]


class SavedBytes:
    """Saved-for-backward bytes, live (:attr:`live`) and at their peak (:attr:`peak`).

    ``params``: tensors never to count (the parameters: a Linear saves its weight, which is not
    an activation). Counting is by storage view, so a tensor saved by several nodes counts once.
    """

    def __init__(self, params: Iterable[Tensor] = ()) -> None:
        self.exclude = {t.untyped_storage().data_ptr() for t in params}
        self.refs: dict[Key, int] = {}
        self.live = 0
        self.peak = 0
        self._ctx: Any = None

    def key(self, t: Tensor) -> Key | None:
        """How ``t`` is told apart (``None``: not counted, a parameter or a meta tensor)."""
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.exclude or t.device.type == "meta":
            return None
        return (ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def hold(self, t: Tensor) -> tuple[Key | None, Tensor]:
        """Count ``t`` as live until :meth:`release` is called with what this returns (for
        tensors kept outside autograd's graph). A view already live is not counted twice."""
        key = self.key(t)
        if key is not None:
            n = self.refs.get(key, 0)
            if n == 0:
                self.live += t.numel() * t.element_size()
                self.peak = max(self.peak, self.live)
            self.refs[key] = n + 1
        return key, t

    def release(self, key: Key | None, t: Tensor) -> None:
        if key is None:
            return
        n = self.refs[key] - 1
        if n == 0:
            del self.refs[key]
            self.live -= t.numel() * t.element_size()
        else:
            self.refs[key] = n

    def _pack(self, t: Tensor) -> _Held:
        key, _ = self.hold(t)
        # detached: a node saving its own output would otherwise hold, through the output's
        # grad_fn, itself, a cycle the garbage collector cannot see (the bytes never freed)
        return _Held(self, key, t.detach())

    def __enter__(self) -> SavedBytes:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


class _Held:
    """What the graph stores instead of a saved tensor: released when the graph frees it."""

    __slots__ = ("counter", "key", "t")

    def __init__(self, counter: SavedBytes, key: Key | None, t: Tensor) -> None:
        self.counter, self.key, self.t = counter, key, t

    def __del__(self) -> None:
        self.counter.release(self.key, self.t)


def _unpack(held: _Held) -> Tensor:
    return held.t
