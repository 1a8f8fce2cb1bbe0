"""Split a batch pytree into microbatches and merge them back.

Sizes follow ``torch.tensor_split``: a batch of B samples split into m microbatches gives
``B % m`` microbatches of ``B // m + 1`` samples first, then the rest of ``B // m``
(``microbatch_sizes(10, 4) == [3, 3, 2, 2]``). Splitting returns views, never copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from funcpipe.errors import InvalidArgument
from funcpipe.tree import (
    PyTreeSpec,
    check_tensor_tree,
    leaf_paths,
    tree_flatten,
    tree_structure,
    tree_unflatten,
)

__all__ = ["WHOLE", "merge", "microbatch_sizes", "split"]

# ``dim`` is an int for every leaf, or a pytree of ints with the batch's structure.
Dim = Any
# a leaf's dim that says "not split: every microbatch (and data copy) gets all of it", for a
# value the whole step shares (a routing bias, a temperature) passed beside the batch
WHOLE = "whole"


def _check_count(microbatches: Any) -> int:
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise InvalidArgument(
            f"microbatches must be an int >= 1; got microbatches={microbatches!r}."
        )
    return microbatches


def _leaf_dims(
    spec: PyTreeSpec, tensors: list[torch.Tensor], paths: list[str], dim: Dim, *, dim_name: str
) -> list[int]:
    """One normalised (non-negative) dim per leaf, checked against the leaf's ndim."""
    if isinstance(dim, int) and not isinstance(dim, bool):
        dims: list[Any] = [dim] * len(tensors)
    else:
        try:
            dims = list(spec.flatten_up_to(dim))
        except (ValueError, TypeError) as e:
            raise InvalidArgument(
                f"{dim_name} must be an int or a pytree of ints with the same structure as the "
                f"batch {spec}; got {dim_name}={dim!r} ({e})."
            ) from None
        for path, d in zip(paths, dims, strict=True):
            if d != WHOLE and (isinstance(d, bool) or not isinstance(d, int)):
                raise InvalidArgument(
                    f"{dim_name} leaves must be ints (or {WHOLE!r}: not split); got {d!r} for "
                    f"{path} in {dim_name}={dim!r}."
                )
    out: list[Any] = []
    for path, t, d in zip(paths, tensors, dims, strict=True):
        if d == WHOLE:
            out.append(None)
            continue
        if not -t.ndim <= d < t.ndim:
            raise InvalidArgument(
                f"{dim_name}={d} is out of range for {path} with shape {tuple(t.shape)} "
                f"(ndim={t.ndim}); use a dim in [{-t.ndim}, {t.ndim - 1}]"
                + (
                    " (a 0-dim tensor has no batch dim; add one with .unsqueeze(0))"
                    if t.ndim == 0
                    else ""
                )
                + "."
            )
        out.append(d % t.ndim)
    return out


def _batch_size(batch: Any, *, dim: Dim = 0, name: str = "batch") -> int:
    """The common size of ``batch``'s leaves along their batch ``dim`` (checked to agree)."""
    tensors, _, paths, dims = _flatten_batch(batch, dim, name=name)
    return _common_size(tensors, paths, dims, name=name)


def _flatten_batch(
    batch: Any, dim: Dim, *, name: str
) -> tuple[list[torch.Tensor], PyTreeSpec, list[str], list[int]]:
    check_tensor_tree(batch, name=name)
    tensors, spec = tree_flatten(batch)
    if not tensors:
        raise InvalidArgument(
            f"{name} has no tensor leaves (got {name}={batch!r}); there is nothing to split."
        )
    paths = leaf_paths(batch, name=name)
    dims = _leaf_dims(spec, tensors, paths, dim, dim_name="dim")
    return tensors, spec, paths, dims


def _common_size(
    tensors: list[torch.Tensor], paths: list[str], dims: list[Any], *, name: str
) -> int:
    split = [(t, p, d) for t, p, d in zip(tensors, paths, dims, strict=True) if d is not None]
    if not split:
        raise InvalidArgument(
            f"every leaf of {name} has dim {WHOLE!r} (not split): at least one leaf must carry "
            "the batch (an int dim) for it to be cut into microbatches."
        )
    sizes = [t.shape[d] for t, _, d in split]
    if len(set(sizes)) > 1:
        listing = ", ".join(
            f"{p}: {s} (dim {d})" for (_, p, d), s in zip(split, sizes, strict=True)
        )
        raise InvalidArgument(
            f"the leaves of {name} disagree on the batch size: {listing}. Every leaf must have "
            "the same size along its batch dim; pass dim as a pytree to choose a dim per leaf."
        )
    return sizes[0]


def microbatch_sizes(batch_size: int, m: int) -> list[int]:
    """Sizes of the ``m`` microbatches of a batch of ``batch_size`` samples (larger ones first)."""
    m = _check_count(m)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
        raise InvalidArgument(f"batch_size must be an int >= 0; got batch_size={batch_size!r}.")
    if batch_size == 0:
        raise InvalidArgument("batch_size=0: an empty batch cannot be split into microbatches.")
    if batch_size < m:
        raise InvalidArgument(
            f"batch has {batch_size} samples but microbatches={m}; use microbatches <= "
            f"{batch_size} (every microbatch needs at least one sample)."
        )
    q, r = divmod(batch_size, m)
    return [q + 1] * r + [q] * (m - r)


def _split_named(batch: Any, microbatches: int, *, dim: Dim = 0, name: str = "batch") -> list[Any]:
    """:func:`split` with ``name`` used for the batch in error messages."""
    m = _check_count(microbatches)
    tensors, spec, paths, dims = _flatten_batch(batch, dim, name=name)
    size = _common_size(tensors, paths, dims, name=name)
    if size == 0:
        raise InvalidArgument(
            f"{name} is empty (0 samples along its batch dim); it cannot be split into "
            "microbatches. Pass at least one sample."
        )
    if size < m:
        dim_text = f"dim {dims[0]}" if len(set(dims)) == 1 else "its batch dims"
        raise InvalidArgument(
            f"{name} has {size} samples along {dim_text} but microbatches={m}; use "
            f"microbatches <= {size} (every microbatch needs at least one sample)."
        )
    pieces = [
        (t,) * m if d is None else torch.tensor_split(t, m, dim=d)
        for t, d in zip(tensors, dims, strict=True)
    ]
    return [tree_unflatten(spec, [p[j] for p in pieces]) for j in range(m)]


def split(batch: Any, microbatches: int, *, dim: Dim = 0) -> list[Any]:
    """Split ``batch`` into ``microbatches`` pytrees of the same structure.

    Args:
        batch: a pytree of tensors that all have the same size B along their batch dim.
        microbatches: m, with ``1 <= m <= B``. Uneven splits are allowed: sizes are
            :func:`microbatch_sizes` ``(B, m)``, larger ones first.
        dim: the batch dim of every leaf (an int, negative allowed), or a pytree of ints with
            the structure of ``batch`` giving one dim per leaf.

    Returns:
        A list of m pytrees whose leaves are views of the batch's leaves.
    """
    return _split_named(batch, microbatches, dim=dim, name="batch")


def merge(microbatches: Sequence[Any], *, dim: Dim = 0) -> Any:
    """Concatenate microbatch pytrees leafwise along ``dim``: the inverse of :func:`split`.

    All microbatches must have the same structure; ``dim`` is as in :func:`split`.
    """
    if isinstance(microbatches, str | bytes) or not isinstance(microbatches, Sequence):
        raise InvalidArgument(
            f"merge takes a sequence of microbatch pytrees (e.g. the list from split); got "
            f"microbatches of type {type(microbatches).__name__}."
        )
    if len(microbatches) == 0:
        raise InvalidArgument("merge needs at least one microbatch; got microbatches=[].")
    first = microbatches[0]
    spec = tree_structure(first)
    for j, mb in enumerate(microbatches):
        check_tensor_tree(mb, name=f"microbatches[{j}]")
        if tree_structure(mb) != spec:
            raise InvalidArgument(
                f"microbatches must all have the same structure; microbatches[0] is {spec} but "
                f"microbatches[{j}] is {tree_structure(mb)}."
            )
    tensors, _ = tree_flatten(first)
    if not tensors:
        raise InvalidArgument("microbatches have no tensor leaves; there is nothing to merge.")
    dims = _leaf_dims(spec, tensors, leaf_paths(first, name="microbatches[0]"), dim, dim_name="dim")
    columns = zip(*(tree_flatten(mb)[0] for mb in microbatches), strict=True)
    return tree_unflatten(
        spec, [torch.cat(list(col), dim=d) for col, d in zip(columns, dims, strict=True)]
    )


def split_targets(targets: Any, microbatches: int, *, batch: Any, dim: Dim = 0) -> list[Any]:
    """Split ``targets`` (batch dim 0) like :func:`split` splits ``batch`` (batch dim ``dim``).

    Checks up front that the targets hold as many samples as the batch, so that a mismatch is
    an :class:`InvalidArgument` naming both sizes instead of an error inside ``loss_fn``.
    """
    size = _batch_size(batch, dim=dim, name="batch")
    tsize = _batch_size(targets, dim=0, name="targets")
    if tsize != size:
        raise InvalidArgument(
            f"targets have {tsize} samples along dim 0 but the batch has {size}; pass one "
            "target per sample (targets are split into microbatches along dim 0, like the batch)."
        )
    return _split_named(targets, microbatches, dim=0, name="targets")
