"""Sharded data parallelism for a Pipeline (``zero=1`` or ``2``, ZeRO-1 or ZeRO-2): shards in,
shards out (the two differ only inside a step: where the program's SCATTERs stand).

Between steps each data-parallel copy holds its shard of every parameter (the sharding rule
of :mod:`funcpipe.runtime.shards`: ``torch.tensor_split(leaf.flatten(), d)[copy]``), and so
of whatever an elementwise optimizer keeps for it. :meth:`Pipeline.shard` cuts full
parameters into this process's shards (no communication) and learns their full shapes;
:meth:`Pipeline.step` takes shards: its program's GATHERs rebuild the full parameters inside
the step and its SCATTERs return the shards of the averaged gradients; :meth:`Pipeline.gather`
rebuilds full parameters (a collective over processes: for evaluation and saving).

Over processes (``transport="dist"``) ``shards`` is one pytree of pieces per stage, this
process's (its copy ``c`` of ``d``), as ``params`` is; in one process with ``data=d`` copies it
is a list of ``d`` such tuples, one per copy, and the gradients come back the same way.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree

from funcpipe.errors import InvalidArgument
from funcpipe.pipeline import experts as _experts
from funcpipe.runtime.shards import gather_stage, leaf_layout, piece_sizes, shard_leaf
from funcpipe.runtime.transport_common import Transport
from funcpipe.tree import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "Shards",
    "check_copy",
    "check_full",
    "check_zero",
    "copies_differ",
    "for_rank",
    "full_meta",
    "gather_copies",
    "gather_dist",
    "held_only",
    "holds_pieces",
    "like",
    "mark_pieces",
    "pipe_gather",
    "pipe_shard",
    "pipe_unshard",
    "placeholders",
    "shard",
]

Tensor = torch.Tensor
Experts = dict[int, frozenset[int]]  # stage -> its leaves split over the expert axis


class Shards(tuple):
    """One data-parallel copy's shards: per stage a pytree of 1-D pieces, as a tuple, tagged
    with the copy they belong to (``copy`` of ``copies``).

    :meth:`Pipeline.shard` returns them, and a ZeRO step's gradients come back as them. The tag
    is part of the pytree structure (optree's and torch's): an optimizer's ``tree_map`` keeps
    it, a tree of one copy's shards does not line up with another copy's, and a step or gather
    given another copy's shards (swapped in the list of one process's copies, or handed to
    another process) refuses them by name. A plain tuple of pieces is still taken, unchecked.
    """

    copy: int
    copies: int

    def __new__(cls, stages: Iterable[Any], copy: int, copies: int) -> Shards:
        self = super().__new__(cls, stages)
        self.copy, self.copies = copy, copies
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (Shards, (tuple(self), self.copy, self.copies))

    def __repr__(self) -> str:
        return f"Shards(copy={self.copy}, copies={self.copies}, stages={tuple.__repr__(self)})"


def _flatten(s: Any) -> tuple[tuple[Any, ...], tuple[int, int], None]:
    return tuple(s), (s.copy, s.copies), None


def _unflatten(tag: Any, stages: Iterable[Any]) -> Any:
    return Shards(stages, *tag)


def _keys(s: Any) -> tuple[list[tuple[Any, Any]], tuple[int, int]]:
    return [(torch_pytree.SequenceKey(i), c) for i, c in enumerate(s)], (s.copy, s.copies)


# optree's global namespace: funcpipe's optimizers and optree users flatten without one
optree.register_pytree_node(
    Shards,
    _flatten,
    _unflatten,
    path_entry_type=optree.SequenceEntry,
    namespace=getattr(optree.registry, "__GLOBAL_NAMESPACE"),
)
torch_pytree.register_pytree_node(
    Shards,
    lambda s: (list(s), (s.copy, s.copies)),
    lambda stages, tag: Shards(stages, *tag),
    serialized_type_name="funcpipe.Shards",
    flatten_with_keys_fn=_keys,
)


def check_copy(shards: Any, d: int, copy: int, where: str) -> None:
    """Refuse :class:`Shards` tagged with another copy than ``copy`` of ``d``."""
    if not isinstance(shards, Shards) or (shards.copy, shards.copies) == (copy, d):
        return
    if shards.copies != d:
        raise InvalidArgument(
            f"{where} are copy {shards.copy}'s of {shards.copies} data-parallel copies; this "
            f"pipeline has {d}: pass the shards this pipeline's shard(params) returned"
        )
    here = "this process is" if where == "shards" or where.endswith("(shards)") else "it is"
    raise InvalidArgument(
        f"{where} are copy {shards.copy}'s shards and {here} copy {copy} of {d}: each copy "
        "steps on its own shards (in one process the list in copy order, as pipe.shard(params) "
        "returned it; over processes the shards this process's pipe.shard returned)"
    )


def like(tree: Any, ref: Any) -> Any:
    """``tree`` with ``ref``'s tag: a plain tuple or list of stages lines up with :class:`Shards`
    (untagged shards are taken unchecked), and :class:`Shards` with a plain tuple or list."""
    if isinstance(ref, Shards) and type(tree) in (tuple, list) and len(tree) == len(ref):
        return Shards(tree, ref.copy, ref.copies)
    if isinstance(tree, Shards) and type(ref) in (tuple, list) and len(tree) == len(ref):
        return type(ref)(tree)
    return tree


def copies_differ(grads: Any, tree: Any, name: str) -> str | None:
    """Why an optimizer cannot update ``tree`` (``params`` or a state field, named ``name``)
    with ``grads`` when the two are :class:`Shards` of different copies; else None."""
    if not (isinstance(grads, Shards) and isinstance(tree, Shards)):
        return None
    if (grads.copy, grads.copies) == (tree.copy, tree.copies):
        return None
    return (
        f"grads are copy {grads.copy}'s shards (of {grads.copies}) and {name} copy {tree.copy}'s "
        f"(of {tree.copies}): update each copy's shards with its own gradient shards and state "
        "(in one process zip the step's grads, the states and the shards in copy order)"
    )


# the gradient pieces a step over processes returned (id -> tensor, held weakly): a norm over one
# process's pieces alone is not the gradient's (funcpipe.train.clip refuses it)
_PIECES: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()


def mark_pieces(grads: Any, copy: int, d: int) -> Shards:
    """``grads`` (a ZeRO step's over processes: per stage this copy's pieces) as :class:`Shards`,
    each piece noted (a norm over them alone is not the gradient's)."""
    for t in tree_flatten(grads)[0]:
        if isinstance(t, Tensor):
            _PIECES[id(t)] = t
    return Shards(grads, copy, d)


def holds_pieces(tree: Any) -> bool:
    """Whether ``tree`` holds ZeRO gradient pieces without every copy's: pieces
    :func:`mark_pieces` noted (a step's over processes, or part of them), or :class:`Shards` of
    some copies but not all (one copy's of a step in one process)."""
    if any(isinstance(t, Tensor) and _PIECES.get(id(t)) is t for t in tree_flatten(tree)[0]):
        return True
    found = [tree] if isinstance(tree, Shards) else list(tree) if isinstance(tree, list) else []
    tags = {(s.copy, s.copies) for s in found if isinstance(s, Shards)}
    return bool(tags) and tags != {(c, n) for _, n in tags for c in range(n)}


SHARDS = "pass what pipe.shard(params) returned (or an elementwise optimizer's update of it)"


def check_zero(zero: Any, copies: int) -> int:
    """``zero`` checked against the rest of a Pipeline's options (``copies``: its data-parallel
    copies, in this process or over processes)."""
    if isinstance(zero, bool) or zero not in (0, 1, 2):
        raise InvalidArgument(
            f"zero={zero!r}: 0 (every copy holds full parameters), 1 (each copy holds its "
            "shard: ZeRO-1) or 2 (the same, and each microbatch's gradient is reduce-scattered "
            "into the shards at once: ZeRO-2)"
        )
    if zero and copies < 2:
        raise InvalidArgument(
            f"zero={zero} shards over data-parallel copies, and this pipeline has {copies}: "
            "use data > 1 (one process) or a world of several copies of the program, or zero=0"
        )
    return int(zero)


def full_meta(params: Sequence[Any]) -> tuple[Any, ...]:
    """The full parameters' shapes and dtypes, as meta tensors (what a step rebuilds)."""
    return tuple(
        tree_map(lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"), p) for p in params
    )


def shard(
    params: Sequence[Any], d: int, copy: int, experts: Experts | None = None, ep: int = 1
) -> Shards:
    """Copy ``copy``'s shards of ``params``: per stage a pytree of its 1-D pieces (of the
    leaves split over the expert axis, piece ``copy // ep`` of ``d // ep``)."""
    out = []
    for o, p in enumerate(params):
        leaves, tree = tree_flatten(p)
        at = leaf_layout(len(leaves), (experts or {}).get(o, frozenset()), d, copy, ep)
        out.append(
            tree_unflatten(tree, [shard_leaf(t, *dc) for t, dc in zip(leaves, at, strict=True)])
        )
    return Shards(out, copy, d)


def placeholders(
    shards: Any,
    full: tuple[Any, ...],
    held: set[int],
    d: int,
    copy: int,
    where: str,
    experts: Experts | None = None,
    ep: int = 1,
) -> tuple[tuple[Any, ...], dict[int, list[Tensor]]]:
    """Full parameters for a step to gather into (uninitialised, where each held stage's
    pieces are; meta elsewhere) and each held stage's pieces, checked against ``full``."""
    if not isinstance(shards, tuple | list) or len(shards) != len(full):
        raise InvalidArgument(
            f"{where} must be a tuple with one pytree of shards per stage ({len(full)}); got "
            f"{type(shards).__name__}; {SHARDS}"
        )
    check_copy(shards, d, copy, where)
    params: list[Any] = []
    pieces: dict[int, list[Tensor]] = {}
    for o, (mine, whole) in enumerate(zip(shards, full, strict=True)):
        if o not in held:
            params.append(whole)
            continue
        leaves, tree = tree_flatten(mine)
        wholes, want = tree_flatten(whole)
        if tree != want:
            raise InvalidArgument(
                f"{where}[{o}] has the structure {tree}, the parameters {want}; {SHARDS}"
            )
        at = leaf_layout(len(wholes), (experts or {}).get(o, frozenset()), d, copy, ep)
        for k, (t, w) in enumerate(zip(leaves, wholes, strict=True)):
            n = piece_sizes(w.numel(), at[k][0])[at[k][1]]
            if not isinstance(t, Tensor) or t.shape != (n,) or t.dtype != w.dtype:
                got = repr(t) if not isinstance(t, Tensor) else f"{t.dtype}{list(t.shape)}"
                raise InvalidArgument(
                    f"{where}[{o}] leaf #{k} is {got}; copy {copy} of {d} holds {w.dtype}[{n}] "
                    f"of that {w.dtype}{list(w.shape)} parameter; {SHARDS}"
                )  # (an expert leaf: piece copy // ep of data // ep)
        pieces[o] = leaves
        dev = leaves[0].device if leaves else torch.device("cpu")
        params.append(
            tree_unflatten(want, [torch.empty(w.shape, dtype=w.dtype, device=dev) for w in wholes])
        )
    return tuple(params), pieces


def gather_copies(copies: Sequence[Sequence[Any]], full: tuple[Any, ...]) -> tuple[Any, ...]:
    """Full parameters from every copy's shards (one process: no communication)."""
    out = []
    for o, whole in enumerate(full):
        wholes, tree = tree_flatten(whole)
        per_copy = [tree_flatten(c[o])[0] for c in copies]
        leaves = [torch.cat([p[k] for p in per_copy]).view(w.shape) for k, w in enumerate(wholes)]
        out.append(tree_unflatten(tree, leaves))
    return tuple(out)


def gather_dist(
    transport: Transport,
    shards: Sequence[Any],
    full: tuple[Any, ...],
    held: set[int],
    d: int,
    copy: int,
    experts: Experts | None = None,
    ep: int = 1,
) -> tuple[Any, ...]:
    """Full parameters of the stages this process holds (``None`` for the others) from the
    copies' shards: one all-gather per bucket over the data group (the expert leaves' over the
    copies holding the same experts; collective)."""
    params, pieces = placeholders(shards, full, held, d, copy, "gather(shards)", experts, ep)
    out: list[Any] = [None] * len(full)
    posted = []  # every stage's all-gathers at once, in stage order, then the waits
    for o in sorted(held):
        leaves = tree_flatten(params[o])[0]  # (uninitialised: the all-gather fills them)
        ex = (experts or {}).get(o, frozenset())
        posted.append((o, gather_stage(transport, pieces[o], leaves, d, copy, "data", ex, ep)))
    for o, (handle, done) in posted:
        handle.wait()
        done()
        out[o] = params[o]
    return tuple(out)


# ---------------------------------------------------------------- a Pipeline's shards
def pipe_shard(pipe: Any, params: tuple[Any, ...]) -> Any:
    """:meth:`Pipeline.shard` of checked ``params``: this process's shards, or every copy's."""
    if pipe._world is None:
        return [shard(params, pipe.data, c) for c in range(pipe.data)]
    return shard(params, pipe.data_size, pipe._world.copy, *_expert_layout(pipe, params))


def pipe_gather(pipe: Any, shards: Any) -> tuple[Any, ...]:
    """:meth:`Pipeline.gather`."""
    full, held = _need_full(pipe, "gather"), _held(pipe)
    if pipe._world is None:
        copies = _copies(pipe, shards, "gather(shards)")
        for k, c in enumerate(copies):
            check_copy(c, pipe.data, k, f"gather(shards)[{k}]")
        return gather_copies(copies, full)
    t, ex = pipe._world.transport, _expert_layout(pipe, full)
    return gather_dist(t, shards, full, held, pipe.data_size, pipe._world.copy, *ex)


def pipe_unshard(pipe: Any, shards: Any) -> tuple[list[tuple[Any, ...]], list[dict[int, Any]]]:
    """What a step of shards runs on: per copy (one over processes) full params to gather
    into and the pieces (:func:`placeholders`)."""
    full, held = _need_full(pipe, "step"), _held(pipe)
    if pipe._world is None:
        got = [
            placeholders(c, full, held, pipe.data, k, f"shards[{k}]")
            for k, c in enumerate(_copies(pipe, shards, "step(shards)"))
        ]
    else:
        d, c = pipe.data_size, pipe._world.copy
        got = [placeholders(shards, full, held, d, c, "shards", *_expert_layout(pipe, full))]
    return [g[0] for g in got], [g[1] for g in got]


def for_rank(pipe: Any, params: tuple[Any, ...], rank: int) -> tuple[Any, ...]:
    """The full parameters one rank of a copy gathers into (one process): the copy's, except
    that where the program replicates a stage on several ranks (Chimera) each rank gets leaves
    of its own (two GATHERs into one tensor would each bump the version autograd saved)."""
    p = pipe.program
    if not p.replica_of or len(set(p.replica_of)) == p.n_stages:
        return params
    mine = {p.replica_of[s] for s in p.stages_on(rank)}
    return tuple(
        tree_map(torch.empty_like, prm) if o in mine else prm for o, prm in enumerate(params)
    )


def _expert_layout(pipe: Any, params: Sequence[Any]) -> tuple[Experts, int]:
    """The leaves each stage splits over the expert axis, and its size (1: none)."""
    ep = _experts.expert_size(pipe.mesh)
    return _experts.expert_leaves(params, pipe.experts, ep), ep


def _need_full(pipe: Any, what: str) -> tuple[Any, ...]:
    if not pipe.zero or pipe._full is None:
        raise InvalidArgument(
            f"{what} of shards needs Pipeline(zero=1 or 2) and pipe.shard(params) first (it learns "
            "the full shapes there)"
        )
    full: tuple[Any, ...] = pipe._full
    return full


def _copies(pipe: Any, shards: Any, where: str) -> list[Any]:
    if not isinstance(shards, list) or len(shards) != pipe.data:
        raise InvalidArgument(
            f"{where}: in one process, a list of every copy's shards ({pipe.data}), as "
            f"pipe.shard(params) returns it; got {type(shards).__name__}"
        )
    return shards


def held_only(pipe: Any, tree: Sequence[Any]) -> tuple[Any, ...]:
    """:meth:`Pipeline.held`."""
    n = len(pipe.stages)
    if not isinstance(tree, tuple | list) or len(tree) != n:
        raise InvalidArgument(
            f"held(tree): a tuple or list with one entry per stage ({n}), such as params; got "
            f"{type(tree).__name__}"
            + (f" of {len(tree)}" if isinstance(tree, tuple | list) else "")
        )
    mine, meta = _held(pipe), lambda t: t.to("meta") if isinstance(t, Tensor) else t
    out = tuple(t if s in mine else tree_map(meta, t) for s, t in enumerate(tree))
    return Shards(out, tree.copy, tree.copies) if isinstance(tree, Shards) else out


def _held(pipe: Any) -> set[int]:
    p = pipe.program
    owners = p.replica_of or tuple(range(p.n_stages))
    if pipe._world is None:
        return set(owners)
    return {owners[s] for s in p.stages_on(pipe.rank)}


def check_full(params: Any, full: Any) -> None:
    """Refuse ``params`` that are what ``shard()`` returned rather than full params: their
    tensors' shapes are not those ``full`` (the first shard()'s, as meta; None: no shard yet)
    recorded, and every one is a 1-D piece (a process's shards, or every copy's in a list)."""
    if full is None:
        return

    def shapes(tree: Any) -> list[tuple[int, ...]]:
        return [tuple(t.shape) for t in tree_flatten(tree)[0] if isinstance(t, Tensor)]

    mine = shapes(params)
    if mine and mine != shapes(full) and all(len(s) == 1 for s in mine):
        raise InvalidArgument(
            "shard(params) was given what shard() returned (1-D pieces, or a list of every "
            "copy's); shard the full params once, and pass the shards to step and the "
            "optimizer from then on (pipe.gather(shards) gives the full params back)"
        )
