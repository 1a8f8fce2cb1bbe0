"""Random keys: the randomness of a stage call comes in as a value.

A stage is a pure function, so a stage that draws random numbers (dropout) must draw the same
ones wherever and whenever it runs: on any rank, in any schedule's order, in a recomputation
and in :func:`funcpipe.reference_step`. Every (stage, microbatch) call of a training step runs
under its own key, :func:`stage_key` ``(seed, stage, microbatch)``: a 63-bit mix of the step's
seed, the stage's index in the model and the microbatch's index in the whole batch (data copy
``c``'s microbatch ``j`` of ``M`` is ``c * M + j``).

:func:`keyed` runs a call under a key: it saves the default generator of the device (and the
CPU's), seeds them from the key, and puts the saved states back afterwards, so a stage call
leaves the user's generators as they were. Code inside reads the key with :func:`current_key`
(``None`` outside a keyed call). :func:`sharded` is for tensor-parallel code: where an
activation is split over a mesh axis, each rank must draw other numbers, so inside it the
generators are seeded from ``mix(key, coordinate)`` (where the activation is replicated, every
rank draws the same numbers under the plain key, as Megatron does).

Seeding and saving a generator is host-side work (no device synchronisation).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

__all__ = ["current_key", "draw_seed", "keyed", "mix", "sharded", "stage_key"]

_MASK = (1 << 64) - 1
_KEY: ContextVar[int | None] = ContextVar("funcpipe_key", default=None)


def _splitmix(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def mix(*values: int) -> int:
    """A 63-bit key from integers (splitmix64 over each in turn; order matters)."""
    h = 0
    for v in values:
        h = _splitmix(h ^ (int(v) & _MASK))
    return h >> 1


def stage_key(seed: int, stage: int, microbatch: int) -> int:
    """The key of ``stage`` (its index in the model) on ``microbatch`` (its index in the whole
    batch) in a step seeded with ``seed``."""
    return mix(seed, stage, microbatch)


def draw_seed() -> int:
    """One 63-bit step seed drawn from torch's default CPU generator (one draw: processes
    seeded alike with ``torch.manual_seed`` draw the same seed)."""
    return int(torch.randint(0, (1 << 63) - 1, (), dtype=torch.int64).item())


def current_key() -> int | None:
    """The key of the stage call running now (``None`` outside one)."""
    return _KEY.get()


def _generators(device: torch.device | None) -> list[torch.Generator]:
    gens = [torch.default_generator]
    if device is None or device.type in ("cpu", "meta"):
        return gens
    mod = getattr(torch, device.type, None)
    defaults = getattr(mod, "default_generators", None)
    if mod is None or defaults is None:
        return gens  # a backend without per-device default generators: the CPU's only
    if not defaults and hasattr(mod, "init"):
        mod.init()  # the generators exist once the backend is initialised
        defaults = mod.default_generators
    index = device.index if device.index is not None else mod.current_device()
    return [*gens, defaults[index]]


@contextmanager
def keyed(key: int, device: torch.device | str | None = None) -> Iterator[int]:
    """Run the block under ``key``: the default generators of ``device`` and of the CPU seeded
    from it, their states restored afterwards; :func:`current_key` is ``key`` inside."""
    dev = torch.device(device) if isinstance(device, str) else device
    gens = _generators(dev)
    states = [g.get_state() for g in gens]
    token = _KEY.set(key)
    try:
        for g in gens:
            g.manual_seed(key)
        yield key
    finally:
        _KEY.reset(token)
        for g, s in zip(gens, states, strict=True):
            g.set_state(s)


@contextmanager
def sharded(coord: int, device: torch.device | str | None = None) -> Iterator[int | None]:
    """Inside a keyed call, run the block under ``mix(current_key(), coord)``: for random
    numbers over an activation split over a mesh axis (``coord``: this rank's coordinate on
    it), different on each rank; the generators are restored afterwards, so what follows draws
    as if the block drew nothing. Outside a keyed call it does nothing (yields ``None``)."""
    key = _KEY.get()
    if key is None:
        yield None
        return
    with keyed(mix(key, coord), device) as k:
        yield k
