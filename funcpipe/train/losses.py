"""Losses that weight microbatches by what they count: ``(sum, count)`` pairs.

A ``loss_fn`` that returns ``(sum, count)`` makes a step's loss the full batch's mean over its
items, however they fall into microbatches and data-parallel copies
(:mod:`funcpipe.runtime.loss_terms`); :func:`token_cross_entropy` is the usual one: next-token
cross-entropy over the labels that are not ``ignore_index`` (the padding convention of
``transformers``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["token_cross_entropy"]

Tensor = torch.Tensor


def token_cross_entropy(
    logits: Tensor, labels: Tensor, *, ignore_index: int = -100
) -> tuple[Tensor, Tensor]:
    """``(sum of the cross-entropy over counted tokens, number of counted tokens)``.

    ``logits``: ``(..., classes)``; ``labels``: the same leading shape, integer classes, with
    ``ignore_index`` on the tokens that do not count (padding, prompts). Pass it as
    ``loss_fn=funcpipe.token_cross_entropy``: the step's loss is then the mean over every
    counted token of the batch, exactly what ``F.cross_entropy(all_logits, all_labels,
    ignore_index=...)`` gives on the whole batch at once, and so are the gradients.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    target = labels.reshape(-1)
    total = F.cross_entropy(flat, target, ignore_index=ignore_index, reduction="sum")
    return total, (target != ignore_index).sum()
