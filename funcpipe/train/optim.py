"""The optimizer namespace, ``funcpipe.optim``: pure optimizers, gradient clipping and
learning-rate schedules.

An optimizer is a pair of pure functions, ``init(params) -> state`` and
``update(grads, state, params) -> (new_params, new_state)`` (optax style): :func:`sgd` and
:func:`adamw`, with float32 master weights for low-precision params on request.
:func:`clip_by_global_norm` clips by the norm of the whole model's gradient, also when the
leaves are spread over ranks; the schedules (:func:`warmup_cosine`, :func:`linear_warmup`,
:func:`constant`) are pure functions of the step.

They are defined in :mod:`funcpipe.train.optimizers`, :mod:`funcpipe.train.clip` and
:mod:`funcpipe.train.lr_schedules`, and re-exported here, where users call them
(``funcpipe.optim.adamw(...)``).
"""

from __future__ import annotations

from funcpipe.train.clip import clip_by_global_norm, global_norm, tie_weights
from funcpipe.train.lr_schedules import Schedule, constant, linear_warmup, warmup_cosine
from funcpipe.train.optimizers import AdamWState, Optimizer, SGDState, adamw, sgd

__all__ = [
    "AdamWState",
    "Optimizer",
    "SGDState",
    "Schedule",
    "adamw",
    "clip_by_global_norm",
    "constant",
    "global_norm",
    "linear_warmup",
    "sgd",
    "tie_weights",
    "warmup_cosine",
]
