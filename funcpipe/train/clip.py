"""Gradient clipping by the global norm, also when the gradient leaves are spread over ranks.

:func:`global_norm` is the 2-norm of every gradient leaf together, summed over a process group
(with per-leaf weights for copies held by several ranks); :func:`clip_by_global_norm` scales
the gradients so that it is at most ``max_norm``, with ``torch.nn.utils.clip_grad_norm_``'s
rule. Users reach these through :mod:`funcpipe.train.optim` (``funcpipe.optim``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import optree
import torch

from funcpipe.errors import InvalidArgument, check_number
from funcpipe.pipeline.zero import holds_pieces, like
from funcpipe.train.common import all_reduce_sum

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["clip_by_global_norm", "global_norm", "tie_weights"]

Tensor = torch.Tensor


# ------------------------------------------------------------------------------- clipping
def _leaf_weights(grads: Any, weights: Any, leaves: list[Tensor]) -> list[float] | None:
    if weights is None:
        return None
    if callable(weights):
        paths = optree.tree_paths(grads, none_is_leaf=False)
        values = [weights(path, leaf) for path, leaf in zip(paths, leaves, strict=True)]
        where = [f"weights({path!r}, ...)" for path in paths]
    else:
        spec = optree.tree_structure(grads, none_is_leaf=False)
        try:
            values = spec.flatten_up_to(like(weights, grads))
        except (ValueError, TypeError) as e:
            raise InvalidArgument(
                f"weights does not have the structure of grads: {e}. Pass one number per "
                "gradient leaf (None where grads has None), or a function (path, leaf) -> number."
            ) from None
        where = [f"weights{a.codify('')}" for a in optree.tree_accessors(grads, none_is_leaf=False)]
    out = []
    for name, w in zip(where, values, strict=True):
        if isinstance(w, bool):  # a predicate: True counts the leaf, False skips it
            w = float(w)
        out.append(
            check_number(
                name,
                w,
                "a leaf's weight is the fraction of it this rank counts (1 for a leaf it "
                "owns alone, 1/t for a copy held by t ranks of the group, 0 to skip it); "
                "a finite number >= 0",
                ge=0,
            )
        )
    return out


def global_norm(grads: Any, *, group: ProcessGroup | None = None, weights: Any = None) -> Tensor:
    """The 2-norm of all gradient leaves together, summed over the ranks of ``group``.

    ``sqrt(sum over ranks of sum over local leaves of weight * ||leaf||**2)``: a scalar tensor,
    the same on every rank of ``group``. See :func:`clip_by_global_norm` for ``group`` and
    ``weights``.
    """
    leaves = optree.tree_leaves(grads, none_is_leaf=False)
    for path, leaf in zip(optree.tree_paths(grads, none_is_leaf=False), leaves, strict=True):
        if not isinstance(leaf, Tensor) or not (leaf.is_floating_point() or leaf.is_complex()):
            raise InvalidArgument(
                f"grads leaf at {path!r} is {leaf!r}; grads must be a pytree of floating-point "
                "tensors (None for subtrees this rank does not hold)"
            )
    if group is None and holds_pieces(grads):
        raise InvalidArgument(
            "grads are some copies' pieces of a ZeRO step's gradient (Pipeline(zero=1 or 2)) "
            "and group=None counts those alone: every copy would clip by another norm. Over "
            "processes pass group= every pipeline x data rank (dist.group.WORLD with tensor "
            "1); in one process clip the list of every copy's grads at once, as "
            "docs/training.md 'Clipping by the global norm' says"
        )
    w = _leaf_weights(grads, weights, leaves)
    floats = [t.dtype for t in leaves if t.is_floating_point()]
    acc = torch.float64 if torch.float64 in floats else torch.float32
    device = leaves[0].device if leaves else torch.device("cpu")
    total = torch.zeros((), dtype=acc, device=device)
    with torch.no_grad():
        by_key: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, t in enumerate(leaves):
            by_key.setdefault((t.device, t.dtype), []).append(i)
        for idx in by_key.values():
            norms = torch.stack(torch._foreach_norm([leaves[i] for i in idx])).to(acc).square()
            if w is not None:
                norms = norms * torch.tensor([w[i] for i in idx], dtype=acc, device=norms.device)
            total = total + norms.sum().to(device)
        if group is not None:
            total = all_reduce_sum(total, group)
        return total.sqrt()


def clip_by_global_norm(
    grads: Any,
    max_norm: float,
    *,
    group: ProcessGroup | None = None,
    weights: Any = None,
) -> tuple[Any, Tensor]:
    """Scale ``grads`` so that their global 2-norm is at most ``max_norm``: ``(clipped, norm)``.

    The rule is ``torch.nn.utils.clip_grad_norm_``'s: every leaf is multiplied by
    ``min(1, max_norm / (norm + 1e-6))``. ``norm`` is the global norm before clipping, a scalar
    tensor (float64 when any leaf is float64, else float32). New tensors are returned; ``grads``
    is not modified; ``None`` subtrees stay ``None``.

    Across ranks, each rank sums the squares of the leaves it holds, the sums are added over
    ``group`` (an all-reduce) and the square root taken, so every rank of ``group`` gets the same
    norm and the same scale. ``group=None`` means this process alone.

    **Ownership.** The result is the norm of the whole model only if every gradient value is
    counted exactly once over ``group``. Leaves held by one rank of the group (a pipeline stage,
    a tensor-parallel shard) count fully. A leaf of which several ranks of the group hold the
    same copy must be discounted with ``weights``:

    * data-parallel replicas (identical after the gradient reduce): leave the data axis out of
      ``group`` (use the group of one replica: its pipeline x tensor ranks), or weigh every leaf
      ``1 / data_size``;
    * a leaf replicated over ``t`` tensor-parallel ranks (a layer-norm weight, a bias after an
      all-reduce): weight ``1 / t``;
    * tied parameters, whose copies each hold the summed gradient after the tie reduce: weight
      1 on one copy and 0 on the others (or ``1 / copies`` on each).
    * gradient shards (``Pipeline(zero=1)``): the data-parallel copies hold disjoint pieces of
      one averaged gradient, so put the data axis *in* ``group`` (all pipeline x data ranks)
      with weight 1 per piece: the data group's sum of squares is the whole gradient's.

    Args:
        grads: a pytree of floating-point tensors (``None`` for subtrees not held here).
        max_norm: a number > 0 (``inf`` only measures).
        group: a ``torch.distributed`` process group, or ``None`` for this process only.
        weights: ``None`` (every leaf counts 1), a pytree of numbers shaped like ``grads``, or a
            function ``(path, leaf) -> number`` where ``path`` is the leaf's key path tuple in
            ``grads`` (e.g. ``(0, "w")``). ``True``/``False`` count as 1/0, so a predicate
            "this rank owns the leaf" works too.
    """
    check_number(
        "max_norm",
        max_norm,
        "the largest allowed global norm, a number > 0 (float('inf') to measure without clipping)",
        gt=0,
        finite=False,
    )
    total = global_norm(grads, group=group, weights=weights)
    leaves, spec = optree.tree_flatten(grads, none_is_leaf=False)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    out: list[Any] = list(leaves)
    with torch.no_grad():
        by_key: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, t in enumerate(leaves):
            by_key.setdefault((t.device, t.dtype), []).append(i)
        for (device, dtype), idx in by_key.items():
            scaled = torch._foreach_mul([leaves[i] for i in idx], coef.to(device, dtype))
            for i, s in zip(idx, scaled, strict=True):
                out[i] = s
    return optree.tree_unflatten(spec, out), total


def tie_weights(ties: Any, params: Sequence[Any], weights: Any = None) -> Any:
    """``weights`` for :func:`global_norm` and :func:`clip_by_global_norm` that count each tied
    parameter once: 0 on every member of a tie but the first, ``weights(path, leaf)`` (or 1)
    elsewhere.

    ``ties`` is ``{name: [(stage, path), ...]}`` as ``Pipeline(ties=...)`` takes it (any of its
    path forms: a key, a dotted string, a tuple) and :func:`funcpipe.find_ties` returns it;
    ``params`` the per-stage pytrees the paths name (or the gradients: the same structure),
    against which each member is resolved (a path that names no leaf is an error). After a step
    every member holds the tie's total gradient, so a norm over all of them counts it once per
    name: GPT-2's token embedding and LM head twice, in one stage or two. ``weights``
    (optional) is a function ``(path, leaf) -> number`` for the other rules (tensor-parallel
    replicas, data-parallel copies).
    """
    from funcpipe.stages.ties import check_ties, resolve

    if weights is not None and not callable(weights):
        raise InvalidArgument(
            f"tie_weights(weights={weights!r}): a function (path, leaf) -> number, or None"
        )
    if not isinstance(params, tuple | list):
        raise InvalidArgument(
            f"tie_weights(params={type(params).__name__}): the per-stage params (or gradients) "
            "the ties' paths name, one pytree per stage"
        )
    skip = set()
    paths: dict[int, list[Any]] = {}  # stage -> its leaves' paths (walked once per stage)
    for name, members in check_ties(ties, len(params)).items():
        for s, path in list(members)[1:]:
            k = resolve(params[s], path, f"tie_weights: ties[{name!r}]")
            if s not in paths:
                paths[s] = optree.tree_paths(params[s], none_is_leaf=False)
            skip.add((s, *paths[s][k]))

    def weight(path: Any, leaf: Tensor) -> float:
        if tuple(path) in skip:
            return 0.0
        return 1.0 if weights is None else weights(path, leaf)

    return weight
