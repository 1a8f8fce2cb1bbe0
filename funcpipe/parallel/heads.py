"""Heads and projections shared by the attention ops (:mod:`funcpipe.parallel.ops`,
:mod:`funcpipe.parallel.ring`): how many heads a rank holds, ``[b, s, h*e] <-> [b, h, s, e]``,
and a linear on this rank's weights."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from funcpipe.errors import InvalidArgument

__all__: list[str] = []  # (internal to the attention ops)


def _heads(d: int, num_heads: int, t: int, what: str) -> int:
    if not isinstance(num_heads, int) or num_heads < 1 or d % num_heads:
        raise InvalidArgument(
            f"{what}: num_heads={num_heads!r} must be a positive int dividing the model width "
            f"d={d}."
        )
    if num_heads % t:
        raise InvalidArgument(
            f"{what}: num_heads={num_heads} is not divisible by the tensor axis size {t}; "
            f"heads are split over ranks, so use a multiple of {t} heads."
        )
    return num_heads // t


def _split_heads(y: Tensor, heads: int) -> Tensor:
    b, s, w = y.shape
    return y.reshape(b, s, heads, w // heads).transpose(1, 2)


def _merge_heads(y: Tensor) -> Tensor:
    b, h, s, e = y.shape
    return y.transpose(1, 2).reshape(b, s, h * e)


def _local_linear(x: Tensor, p: dict[str, Tensor]) -> Tensor:
    return F.linear(x, p["weight"], p.get("bias"))
