"""Process groups shared by the Pipelines and meshes of one process, and released when closed.

Every process group costs every member resources while it lives: gloo starts a TCP event loop
and two worker threads per group (the event loop wakes up about a hundred times a second even
when idle: measured here, 40 idle gloo groups kept a process at 10% of a core), NCCL a
communicator and its GPU memory. A program that builds Pipelines in a loop, or a test session
that builds hundreds, must not pile them up.

So the groups funcpipe creates are kept in one registry per process, keyed by what defines them
(the lists of member ranks, or a mesh's configuration): a second Pipeline or mesh of the same
layout reuses the first one's groups instead of creating new ones. Each owner (a Pipeline's
world, a :class:`funcpipe.parallel.Mesh`) holds a :class:`Claim` on the entries it uses;
``Claim.close()`` gives them back, and an entry no open claim holds is destroyed then, in the
reverse of the order it was created.

Creating and destroying a group are collective: every process of the default group must make
the same calls in the same order (the group names come from a counter every process keeps, and
some NCCL versions wait for every member when a communicator is destroyed). Building the same
Pipelines in the same order on every rank (which funcpipe already requires) makes the registry
identical everywhere. Closing is an explicit call, for the same reason: an owner that is only
dropped (garbage collected, at a different moment on each rank) keeps its claims, and its
groups stay in the registry for the next owner of the same layout, so their number stays bounded
by the number of distinct layouts. :func:`destroy_all` destroys every entry at once, whoever holds
it (for the end of a program or a test; every owner built before then is unusable after).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from funcpipe.distributed.timeouts import job_timeout

__all__ = ["Claim", "destroy_all", "live"]


@dataclass
class _Entry:
    value: Any  # what the owners use (a group, a mesh's pieces)
    groups: list[Any]  # this process's process groups in it, destroyed with it
    forget: Callable[[Any], None] | None = None  # breaks reference cycles in value, if any
    claims: int = 0


@dataclass
class _Registry:
    default: Any  # the default group these entries were created under
    entries: dict[Hashable, _Entry] = field(default_factory=dict)  # in creation order


_REGISTRY: list[_Registry] = []  # at most one: the registry of the current default group


def _registry() -> _Registry:
    """The registry of the current default group (a new one after the default group changed:
    the groups of the old one went with it)."""
    import torch.distributed as dist

    default = dist.group.WORLD
    if not _REGISTRY or _REGISTRY[0].default is not default:
        _REGISTRY[:] = [_Registry(default)]
    return _REGISTRY[0]


class Claim:
    """One owner's claim on shared process groups (a Pipeline's world, a mesh).

    Every call below is collective: every process of the default group makes it, in the same
    order (each builds the same Pipelines and meshes in the same order).
    """

    def __init__(self) -> None:
        self._keys: list[tuple[_Registry, Hashable]] = []  # (registry, key) of each claim
        self.closed = False

    def shared(
        self,
        key: Hashable,
        make: Callable[[], tuple[Any, Sequence[Any]]],
        *,
        forget: Callable[[Any], None] | None = None,
    ) -> Any:
        """The value registered under ``key``, made by ``make()`` the first time: ``make``
        returns ``(value, groups)``, ``groups`` being the process groups it created that this
        process belongs to (destroyed with the entry; never the default group). A gloo group's
        threads and connections end only when its last reference goes: ``forget(value)``, called
        once the groups are destroyed, breaks any reference cycle in ``value`` that would keep
        them until the garbage collector runs."""
        if self.closed:
            raise RuntimeError("internal: a closed Claim was asked for a group")
        reg = _registry()
        entry = reg.entries.get(key)
        if entry is None:
            value, groups = make()
            entry = reg.entries[key] = _Entry(value, _distinct(groups, reg.default), forget)
        entry.claims += 1
        self._keys.append((reg, key))
        return entry.value

    def subgroups(self, lists: Sequence[Sequence[int]]) -> Any:
        """This process's group among groups over each of ``lists`` (disjoint lists of global
        ranks), or ``None`` where it is in none of them."""
        import torch.distributed as dist

        key = ("subgroups", tuple(tuple(int(r) for r in members) for members in lists))

        def make() -> tuple[Any, list[Any]]:
            mine, _ = dist.new_subgroups_by_enumeration(
                [list(m) for m in key[1]], timeout=job_timeout()
            )
            return mine, [mine]

        return self.shared(key, make)

    def group(
        self, ranks: Sequence[int], *, use: str = "", device_id: Any = None, backend: Any = None
    ) -> Any:
        """One group over ``ranks`` (global ranks) for ``use``; a non-member gets torch's
        non-member marker. Groups of different uses are different groups even over the same
        ranks (a pair's messages never share a communicator with the loss sum of a world of
        two). ``device_id`` (a CUDA device, NCCL only) binds the group so its communicator is
        created now rather than by its first operation. ``backend``: the group's (default: the
        world's), e.g. ``"gloo"`` for one that carries CPU tensors in a CUDA job."""
        import torch.distributed as dist

        key = ("group", use, tuple(int(r) for r in ranks), str(device_id), backend)

        def make() -> tuple[Any, list[Any]]:
            g = dist.new_group(
                list(key[2]), device_id=device_id, timeout=job_timeout(), backend=backend
            )
            return g, [g]

        return self.shared(key, make)

    def close(self) -> None:
        """Give back every claim; destroy the entries no open claim holds any more (collective:
        every process closes its owners in the same order)."""
        if self.closed:
            return
        self.closed = True
        if not _REGISTRY:
            return
        reg = _REGISTRY[0]
        # claims on a registry destroy_all has since emptied are gone with it
        for where, key in self._keys:
            entry = reg.entries.get(key) if where is reg else None
            if entry is not None:
                entry.claims -= 1
        self._keys = []
        idle = [k for k, e in reg.entries.items() if e.claims <= 0]
        for key in reversed(idle):
            _destroy(reg.entries.pop(key), reg.default)

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def destroy_all() -> None:
    """Destroy every process group in the registry, claimed or not, newest first (collective:
    every process calls it at the same point). Pipelines and meshes built before cannot
    communicate afterwards; later ones create their groups afresh."""
    if not _REGISTRY:
        return
    import torch.distributed as dist

    reg = _REGISTRY.pop()
    if not dist.is_initialized() or dist.group.WORLD is not reg.default:
        return  # the default group (and every group with it) is gone already
    for entry in reversed(list(reg.entries.values())):
        _destroy(entry, reg.default)


def live() -> int:
    """How many process groups this process holds in the registry (for tests and reports)."""
    return sum(len(e.groups) for e in _REGISTRY[0].entries.values()) if _REGISTRY else 0


def _distinct(groups: Sequence[Any], default: Any) -> list[Any]:
    """The real groups of ``groups``, each once: not ``None``, not a non-member marker, never
    the default group (it is not ours to destroy)."""
    import torch.distributed as dist

    out: list[Any] = []
    for g in groups:
        if g is None or g is default or g is dist.GroupMember.NON_GROUP_MEMBER:
            continue
        if all(g is not o for o in out):
            out.append(g)
    return out


def _destroy(entry: _Entry, default: Any) -> None:
    import torch.distributed as dist

    if not dist.is_initialized() or dist.group.WORLD is not default:
        return
    for g in reversed(entry.groups):
        with contextlib.suppress(ValueError):  # destroyed already (by the user)
            dist.destroy_process_group(g)
    entry.groups = []
    if entry.forget is not None:
        entry.forget(entry.value)
    entry.value = None
