"""The random ops of a module split in training mode, as funcpipe's stages draw them: inside a
keyed call (a training step, each stage call under its random key: :mod:`funcpipe.stages.keys`)
as traced, outside one (an evaluation program, a stage called by hand) drawing nothing.
:func:`funcpipe.split_module` puts these in place of the traced ops."""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "keyed_alpha_dropout",
    "keyed_attention",
    "keyed_dropout",
    "keyed_feature_alpha_dropout",
    "keyed_feature_dropout",
    "keyed_ops",
]

Tensor = torch.Tensor


def keyed_ops() -> dict[Any, Any]:
    """The traced ops that draw dropout masks, each with the stand-in that draws only in a
    keyed call (:func:`keyed_dropout`)."""
    aten = torch.ops.aten
    return {
        aten.dropout.default: keyed_dropout,
        aten.feature_dropout.default: keyed_feature_dropout,
        aten.alpha_dropout.default: keyed_alpha_dropout,
        aten.feature_alpha_dropout.default: keyed_feature_alpha_dropout,
        aten.scaled_dot_product_attention.default: keyed_attention,
    }


def _drawing() -> bool:
    from funcpipe.stages.keys import current_key

    return current_key() is not None


def keyed_dropout(x: Tensor, p: float, train: bool) -> Tensor:
    """The traced ``aten.dropout`` of a module split in training mode, as funcpipe's own models
    draw: inside a keyed call (a training step, each stage call under its random key) it drops,
    outside one (an evaluation program, a stage called by hand) it drops nothing. Traced as
    they were, an evaluation over a split in training mode kept dropout on: two evaluations
    differed, and the logits were 0.28 off the model's in eval mode. The three below do the same
    for the other dropout ops."""
    return torch.ops.aten.dropout.default(x, p, train and _drawing())


def keyed_feature_dropout(x: Tensor, p: float, train: bool) -> Tensor:
    return torch.ops.aten.feature_dropout.default(x, p, train and _drawing())


def keyed_alpha_dropout(x: Tensor, p: float, train: bool) -> Tensor:
    return torch.ops.aten.alpha_dropout.default(x, p, train and _drawing())


def keyed_feature_alpha_dropout(x: Tensor, p: float, train: bool) -> Tensor:
    return torch.ops.aten.feature_alpha_dropout.default(x, p, train and _drawing())


def keyed_attention(*args: Any, **kwargs: Any) -> Tensor:
    """The traced ``aten.scaled_dot_product_attention`` (transformers' ``sdpa`` attention with
    ``attention_dropout``): its ``dropout_p`` applies in a keyed call only, as
    :func:`keyed_dropout`. Traced as it was, an evaluation of a Llama split in training mode
    with ``attention_dropout=0.1`` differed between two runs by 0.21 in the logits."""
    if not _drawing():
        if len(args) > 4:
            args = (*args[:4], 0.0, *args[5:])
        if "dropout_p" in kwargs:
            kwargs = {**kwargs, "dropout_p": 0.0}
    out: Tensor = torch.ops.aten.scaled_dot_product_attention.default(*args, **kwargs)
    return out
