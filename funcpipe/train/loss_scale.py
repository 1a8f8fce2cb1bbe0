"""Dynamic loss scaling for float16 training, as pure functions of a small state.

float16 has 5 exponent bits: gradients below about ``6e-8`` flush to zero and values above
``65504`` overflow. Multiplying the loss by a large ``scale`` moves the whole backward pass up
into float16's range; the gradients are divided by the same ``scale`` (in float32) before the
optimizer sees them. The scale is chosen dynamically: an overflow (an ``inf`` or ``NaN`` in any
gradient) skips the step and multiplies the scale by ``backoff_factor``; ``growth_interval``
finite steps in a row multiply it by ``growth_factor``. The rule is the one of
``torch.amp.GradScaler``, with a floor: the scale never goes below ``min_scale`` (default 1.0,
as Megatron-LM's ``min_loss_scale`` and DeepSpeed's), and a step that overflows with the scale
already there raises :class:`LossScaleFloorError` (see :func:`update` for why it raises).

One step::

    loss, grads = pipe.step(params, x, y, loss_scale=ls.scale)   # grads of the scaled loss
    grads, finite = loss_scale.unscale(grads, ls)                # float32, and a bool tensor
    new_params, new_opt = opt.update(grads, opt_state, params)
    params, opt_state = loss_scale.apply_if_finite(finite, (new_params, new_opt), (params, opt_state))
    ls = loss_scale.update(ls, finite)

bfloat16 has float32's exponent range and needs no loss scaling. :func:`all_finite` alone is
still useful there, to skip a step whose gradients hold a ``NaN``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import optree
import torch

from funcpipe.errors import FuncpipeError, InvalidArgument, check_number, is_real
from funcpipe.train.common import all_reduce_sum, low_precision

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "LossScaleFloorError",
    "LossScaleState",
    "all_finite",
    "apply_if_finite",
    "init",
    "scale_loss",
    "unscale",
    "update",
]

Tensor = torch.Tensor


class LossScaleFloorError(FuncpipeError, FloatingPointError):
    """A step overflowed with the loss scale already at its floor (``min_scale``): the model
    produces non-finite gradients, which no smaller scale cures. Raised by :func:`update`."""


class LossScaleState(NamedTuple):
    """``scale``: the current loss scale (a float32 0-dim tensor); ``good_steps``: finite steps
    since the scale last changed (an int64 0-dim tensor); the hyperparameters, carried in the
    state so that :func:`update` needs nothing else and a checkpoint restores them (see
    :func:`init`). ``min_scale`` came last (issue 42): a state built with the first five fields
    gets 1.0."""

    scale: Tensor
    good_steps: Tensor
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    min_scale: float = 1.0


def init(
    initial: float = 2.0**16,
    *,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float | None = None,
    device: torch.device | str | None = None,
) -> LossScaleState:
    """A dynamic loss scale starting at ``initial``.

    Args:
        initial: the first scale, a finite number > 0 (a power of two keeps scaling exact).
        growth_factor: > 1; the scale is multiplied by it after ``growth_interval`` finite
            steps in a row (unless that would make it infinite).
        backoff_factor: in (0, 1); the scale is multiplied by it after a step that overflowed.
        growth_interval: an int >= 1.
        min_scale: the floor, a finite number in (0, ``initial``]; default 1.0, or ``initial``
            when that is smaller. Below 1 the scale shrinks the gradients instead of lifting
            them into float16's range, so a step that overflows at 1 overflows without any
            scaling: the model itself produces an ``inf`` or ``NaN`` (:func:`update` raises).
        device: where the scale lives (default CPU; the training step's device avoids copies).
    """
    initial = check_number(
        "initial", initial, "the first loss scale, a finite number > 0, e.g. 2.**16", gt=0
    )
    growth_factor = check_number(
        "growth_factor", growth_factor, "must be a finite number > 1, e.g. 2.0", gt=1
    )
    backoff_factor = check_number(
        "backoff_factor", backoff_factor, "must be a number in (0, 1), e.g. 0.5", gt=0, lt=1
    )
    if type(growth_interval) is not int or growth_interval < 1:
        raise InvalidArgument(
            f"growth_interval={growth_interval!r}: the number of finite steps in a row after "
            "which the scale grows, an int >= 1, e.g. 2000"
        )
    if min_scale is None:
        min_scale = min(1.0, initial)
    min_scale = check_number(
        "min_scale",
        min_scale,
        "the smallest loss scale, a finite number > 0 and <= initial, e.g. 1.0",
        gt=0,
    )
    if min_scale > initial:
        raise InvalidArgument(
            f"min_scale={min_scale!r} is above initial={initial!r}: the scale starts at "
            f"initial and never goes below min_scale; pass min_scale <= initial (e.g. "
            f"min_scale={initial!r}) or a larger initial"
        )
    return LossScaleState(
        torch.tensor(initial, dtype=torch.float32, device=device),
        torch.zeros((), dtype=torch.int64, device=device),
        growth_factor,
        backoff_factor,
        growth_interval,
        min_scale,
    )


def _check_state(state: Any, fn: str) -> LossScaleState:
    if not isinstance(state, LossScaleState):
        raise InvalidArgument(
            f"state={type(state).__name__}(...): {fn} needs the LossScaleState that "
            "funcpipe.loss_scale.init(...) (or update) returned"
        )
    return state


# ------------------------------------------------------------------------------ the loss
ScaleLike = LossScaleState | Tensor | float


def _scale_of(scale: Any, what: str) -> Tensor | float:
    if isinstance(scale, LossScaleState):
        return scale.scale
    if isinstance(scale, Tensor) and scale.numel() == 1 and scale.is_floating_point():
        return scale.reshape(())
    if is_real(scale) and math.isfinite(scale) and scale > 0:
        return float(scale)
    raise InvalidArgument(
        f"{what}={scale!r}: a LossScaleState, a one-element float tensor or a number > 0"
    )


def scale_loss(loss: Tensor, scale: ScaleLike) -> Tensor:
    """``loss * scale``, computed in at least float32 (a float16 loss times ``2**16`` would
    overflow): its gradient with respect to everything upstream is multiplied by ``scale``."""
    if not isinstance(loss, Tensor) or not loss.is_floating_point():
        raise InvalidArgument(f"loss={loss!r}: scale_loss needs the floating-point loss tensor")
    s = _scale_of(scale, "scale")
    wide = loss.to(torch.promote_types(loss.dtype, torch.float32))
    if isinstance(s, Tensor):
        s = s.to(wide.device)
    return wide * s


# ------------------------------------------------------------------------- the gradients
def _float_leaves(tree: Any, name: str) -> tuple[list[Tensor], Any]:
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=False)
    for path, leaf in zip(optree.tree_paths(tree, none_is_leaf=False), leaves, strict=True):
        if not isinstance(leaf, Tensor) or not leaf.is_floating_point():
            raise InvalidArgument(
                f"{name} leaf at {path!r} is {leaf!r}; {name} must be a pytree of floating-point "
                "tensors (None for subtrees this rank does not hold)"
            )
    return leaves, spec


def _nonfinite_count(leaves: list[Tensor], device: torch.device) -> Tensor:
    """How many of ``leaves`` hold an ``inf`` or ``NaN`` (a float32 0-dim tensor)."""
    count = torch.zeros((), dtype=torch.float32, device=device)
    by_key: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in leaves:
        by_key.setdefault((t.device, t.dtype), []).append(t)
    for ts in by_key.values():
        peaks = torch.stack(torch._foreach_norm(ts, ord=math.inf))  # NaN stays NaN, inf stays inf
        count = count + (~peaks.isfinite()).sum().to(device, torch.float32)
    return count


def _finite_over(count: Tensor, group: ProcessGroup | None) -> Tensor:
    if group is not None:
        count = all_reduce_sum(count, group)
    return count == 0


def all_finite(tree: Any, *, group: ProcessGroup | None = None) -> Tensor:
    """Whether every leaf of ``tree`` is free of ``inf`` and ``NaN``: a 0-dim bool tensor.

    ``None`` subtrees are skipped. With ``group`` the answer covers the leaves of every rank of
    the group (one all-reduce), so all ranks agree; every rank of ``group`` must call it.
    """
    leaves, _ = _float_leaves(tree, "tree")
    device = leaves[0].device if leaves else torch.device("cpu")
    with torch.no_grad():
        return _finite_over(_nonfinite_count(leaves, device), group)


def unscale(
    grads: Any, state: LossScaleState, *, group: ProcessGroup | None = None
) -> tuple[Any, Tensor]:
    """``(grads / state.scale, finite)``.

    New tensors are returned (``grads`` is not modified) and ``None`` subtrees stay ``None``.
    Low-precision leaves (float16, bfloat16) come back as **float32**: divided in float16, the
    small gradients that the scale rescued would underflow again. The optimizer (with
    ``master_weights=True``) takes float32 gradients as they are.

    ``finite`` is a 0-dim bool tensor: no leaf holds an ``inf`` or ``NaN``. With ``group`` (a
    ``torch.distributed`` process group: in a pipeline, all its ranks) the flag covers the
    leaves of every rank of the group, so that all ranks skip or take the same steps; every
    rank of ``group`` must call it, also one that holds no gradient.
    """
    state = _check_state(state, "unscale")
    leaves, spec = _float_leaves(grads, "grads")
    device = leaves[0].device if leaves else state.scale.device
    out: list[Tensor] = list(leaves)
    with torch.no_grad():
        by_key: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, t in enumerate(leaves):
            dtype = torch.float32 if low_precision(t) else t.dtype
            by_key.setdefault((t.device, dtype), []).append(i)
        for (dev, dtype), idx in by_key.items():
            wide = [leaves[i].to(dtype) for i in idx]
            for i, t in zip(idx, torch._foreach_div(wide, state.scale.to(dev, dtype)), strict=True):
                out[i] = t
        finite = _finite_over(_nonfinite_count(out, device), group)
    return optree.tree_unflatten(spec, out), finite


# ------------------------------------------------------------------------------ the scale
def _finite_flag(finite: Any, what: str) -> bool | Tensor:
    if isinstance(finite, bool):
        return finite
    if isinstance(finite, Tensor) and finite.numel() == 1 and finite.dtype == torch.bool:
        return finite.reshape(())
    raise InvalidArgument(
        f"{what}={finite!r}: the flag that unscale (or all_finite) returned, a bool or a "
        "one-element bool tensor"
    )


def update(state: LossScaleState, finite: bool | Tensor) -> LossScaleState:
    """The scale for the next step.

    After an overflow (``finite`` false) the scale is multiplied by ``backoff_factor``, but not
    below ``state.min_scale``, and the count of good steps restarts; after ``growth_interval``
    finite steps in a row it is multiplied by ``growth_factor`` (kept as it is if that would
    overflow float32) and the count restarts.

    An overflow with the scale already at ``min_scale`` raises :class:`LossScaleFloorError`
    (``state`` is not changed: this function is pure). Raise, not warn: without a floor the
    scale used to decay to 0.0, after which every step was skipped and the run went on,
    silently, doing nothing; with a floor and a warning it would do the same under a line in a
    log. At a floor of 1 the gradients are not scaled at all, so no scale can help: the model
    produces non-finite gradients (a divergence, a bad batch, a learning rate too high), and
    only the user can decide what to do. DeepSpeed raises at its minimum loss scale too
    (Megatron-LM keeps skipping at its ``min_loss_scale``). To ride out a single bad batch,
    catch the error and keep the ``state`` given.

    Tensor arithmetic, and one read of ``finite`` on the host (a synchronisation; in the loop of
    the module docstring :func:`apply_if_finite` has already waited for it, so it adds no wait);
    the scale is read only after an overflow.
    """
    state = _check_state(state, "update")
    flag = _finite_flag(finite, "finite")
    scale, good = state.scale, state.good_steps
    if not bool(flag) and bool(scale <= state.min_scale):
        raise LossScaleFloorError(
            f"loss_scale.update: the step's gradients hold an inf or NaN with the loss scale "
            f"already at its floor, min_scale={state.min_scale!r}: the model produces "
            "non-finite gradients that no smaller scale cures (each further step would be "
            "skipped). Find the first NaN or inf with Pipeline(check_finite=True) or "
            "FUNCPIPE_DEBUG=1 (it names the stage and microbatch); then lower the learning "
            "rate, clip the gradients (optim.clip_by_global_norm) or check the batch. A scale "
            "below 1 is rarely right, but loss_scale.init(min_scale=...) allows it"
        )
    ok = torch.as_tensor(flag, device=scale.device)
    counted = torch.where(ok, good + 1, torch.zeros_like(good))
    grown = scale * state.growth_factor
    due = counted >= state.growth_interval
    new_scale = torch.where(
        ok,
        torch.where(due & grown.isfinite(), grown, scale),
        torch.clamp(scale * state.backoff_factor, min=state.min_scale),
    )
    new_good = torch.where(due, torch.zeros_like(counted), counted)
    return state._replace(scale=new_scale, good_steps=new_good)


def apply_if_finite(finite: bool | Tensor, new: Any, old: Any) -> Any:
    """``new`` if ``finite`` else ``old``: take a step's new params and optimizer state, or keep
    the previous ones after an overflow.

    ``new`` and ``old`` are pytrees of the same structure (any leaves: tensors, the optimizer's
    step count, ``None`` subtrees). Reading a tensor flag synchronises with its device once.
    """
    flag = _finite_flag(finite, "finite")
    new_spec = optree.tree_structure(new, none_is_leaf=True)
    old_spec = optree.tree_structure(old, none_is_leaf=True)
    if new_spec != old_spec:
        raise InvalidArgument(
            f"new and old must have the same structure (new {_short(new_spec)}, old "
            f"{_short(old_spec)}); pass the same things before and after the update, e.g. "
            "(params, opt_state) for both"
        )
    return new if bool(flag) else old


def _short(spec: Any) -> str:
    text = str(spec)
    return text if len(text) <= 120 else text[:120] + "..."
