"""A step's tensors as the interpreter keeps them (:mod:`funcpipe.runtime.interpreter`): the
parameter copies a stage computes with, the gradient sums handed back, and the check that
what a stage made is finite."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from funcpipe.errors import NonFiniteError
from funcpipe.runtime.rank_io import RankInputs

__all__ = ["check_finite", "compute_leaves", "take_grad"]

Tensor = torch.Tensor


def compute_leaves(leaves: list[Tensor], casts: Sequence[torch.dtype | None]) -> list[Tensor]:
    """Each leaf in the dtype the stage computes with: a copy of its own (a leaf of autograd)
    where that differs, the leaf itself elsewhere."""
    return [
        t if c is None else t.detach().to(c).requires_grad_(t.requires_grad)
        for t, c in zip(leaves, casts, strict=True)
    ]


def take_grad(leaf: Tensor) -> Tensor:
    """The gradient sum of a parameter leaf as a value (zeros if it got none); the leaf lets go
    of it."""
    g = leaf.grad
    if g is None:
        return torch.zeros_like(leaf)
    leaf.grad = None
    return g


def check_finite(
    x: RankInputs,
    s: int,
    m: int,
    tensors: Sequence[Tensor | None],
    names: Sequence[str],
    where: str,
) -> None:
    """Raise :class:`~funcpipe.errors.NonFiniteError` for the first of ``tensors`` (named by
    ``names``) of stage ``s``, microbatch ``m`` holding a NaN or an infinity."""
    for t, name in zip(tensors, names, strict=False):
        if (
            t is not None
            and (t.is_floating_point() or t.is_complex())
            and not bool(torch.isfinite(t).all())
        ):
            bad = "NaN" if bool(torch.isnan(t).any()) else "inf"
            raise NonFiniteError(
                f"rank {x.rank}: {bad} in the {name} of stage {s} ({x.stages[s].name!r}), "
                f"microbatch {m}, during the {where}. Look at that stage's inputs and "
                "parameters for this microbatch (Pipeline(check_finite=False) turns the check off).",
                stage=s,
                microbatch=m,
                what=name,
            )
