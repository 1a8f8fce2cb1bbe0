"""Pure optimizers over params pytrees: ``init(params) -> state`` and
``update(grads, state, params) -> (new_params, new_state)``.

An :class:`Optimizer` is a pair of functions, optax style. Parameters, gradients and optimizer
state are values: ``update`` returns new tensors and leaves its arguments untouched. The arithmetic
runs on torch's multi-tensor ``torch._foreach_*`` kernels, applied to fresh outputs (one kernel
launch per (device, dtype) group instead of one per leaf).

``None`` in ``grads`` means "not held here": a pipeline rank gets ``grads[k] = None`` for the
stages it does not hold. Those subtrees are skipped: their params are passed through unchanged
(they may be ``None`` or meta tensors) and their optimizer state is kept as it was.

``master_weights=True`` keeps a float32 master copy of every low-precision (bfloat16, float16)
param in the state (``state.master``) and its optimizer state in float32: the update runs in
float32 on the master and the new params are the master rounded to each param's own dtype.
float32 and float64 params have no master copy and are updated exactly as without the option.

Users reach these through :mod:`funcpipe.train.optim` (``funcpipe.optim``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import optree
import torch

from funcpipe.errors import InvalidArgument, check_number, is_real
from funcpipe.pipeline.zero import copies_differ, like
from funcpipe.train.common import low_precision
from funcpipe.train.lr_schedules import Schedule

__all__ = ["AdamWState", "Optimizer", "SGDState", "adamw", "sgd"]

Tensor = torch.Tensor


# ----------------------------------------------------------------------------------- types
class UpdateFn(Protocol):
    def __call__(
        self, grads: Any, state: Any, params: Any, *, lr: float | None = None
    ) -> tuple[Any, Any]: ...


class Optimizer(NamedTuple):
    """``init(params) -> state`` and ``update(grads, state, params, *, lr=None) -> (params, state)``.

    ``lr=`` overrides the optimizer's learning rate (or schedule) for that one update.
    """

    init: Callable[[Any], Any]
    update: UpdateFn

    def __repr__(self) -> str:
        hyper = getattr(self.update, "args", (None,))[0]
        if isinstance(hyper, _Hyper):
            return repr(hyper)
        return f"Optimizer(init={self.init!r}, update={self.update!r})"


class SGDState(NamedTuple):
    """``step``: updates made so far (an int); ``momentum``: a pytree like params (``None``
    without momentum); ``master``: with ``master_weights=True`` a pytree like params holding a
    float32 copy of each low-precision param (``None`` at the other leaves), else ``None``."""

    step: int
    momentum: Any
    master: Any = None


class AdamWState(NamedTuple):
    """``step``: updates made so far (an int); ``mu``, ``nu``: first and second moment
    estimates, pytrees like params; ``master``: as in :class:`SGDState`."""

    step: int
    mu: Any
    nu: Any
    master: Any = None


# ----------------------------------------------------------------------------- validation
def _check_lr(name: str, lr: Any) -> float | Schedule:
    if callable(lr):
        return lr
    return check_number(
        name,
        lr,
        "the learning rate must be a finite number >= 0, or a schedule step -> lr "
        "(e.g. funcpipe.optim.warmup_cosine(3e-4, warmup=100, total=10_000))",
        ge=0,
    )


def _lr_at(hyper_lr: float | Schedule, count: int, override: float | None) -> float:
    if override is not None:
        value: Any = override
        where = "lr"
    elif callable(hyper_lr):
        value = hyper_lr(count)
        where = f"the schedule's value at step {count}"
    else:
        return hyper_lr
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    return check_number(
        "lr" if override is not None else "lr(step)",
        value,
        f"{where} must be a finite number >= 0",
        ge=0,
    )


def _state_step(state: Any, cls: type[SGDState] | type[AdamWState], opt: str) -> int:
    if not isinstance(state, cls):
        raise InvalidArgument(
            f"state={type(state).__name__}(...): {opt} needs the state its init(params) "
            f"returned (a {cls.__name__}); did you pass another optimizer's state?"
        )
    step = state.step
    if isinstance(step, Tensor) and step.numel() == 1:
        step = int(step.item())
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise InvalidArgument(f"state.step={state.step!r}: the number of updates, an int >= 0")
    return step


# ------------------------------------------------------------------------------ alignment
def _align(grads: Any, params: Any, states: dict[str, Any]) -> tuple[Any, list[int], list[Any]]:
    """Line ``params`` and each state tree up with the leaves of ``grads``.

    Returns the treespec of ``grads`` (``None`` as a leaf), the positions of its tensor leaves,
    and per tree (params first, then ``states`` in order) the list of its subtrees at every
    position of the spec.
    """
    spec = optree.tree_structure(grads, none_is_leaf=True)
    g_leaves = spec.flatten_up_to(grads)
    where = [i for i, g in enumerate(g_leaves) if g is not None]
    out = [g_leaves]
    for name, tree in {"params": params, **states}.items():
        try:
            subs = spec.flatten_up_to(like(tree, grads))
        except (ValueError, TypeError) as e:
            copies = copies_differ(grads, tree, name)
            if copies:
                raise InvalidArgument(copies) from None
            detail = str(e).split("; dict:")[0].rstrip(". ")
            if len(detail) > 200:  # optree quotes the whole tree
                detail = detail[:200] + "..."
            source = "" if name == "params" else f", and {name} must come from init(params)"
            raise InvalidArgument(
                f"{name} does not have the structure of grads ({detail}). grads must be shaped "
                f"like params (None allowed for subtrees this rank does not hold){source}."
            ) from None
        out.append(subs)
    for i in where:
        g = g_leaves[i]
        for name, subs in zip(("grads", "params", *states), out, strict=True):
            leaf = subs[i]
            bad = None
            if not isinstance(leaf, Tensor):
                bad = f"is {type(leaf).__name__}, not a tensor"
            elif leaf.shape != g.shape:
                bad = f"has shape {tuple(leaf.shape)}, grads has {tuple(g.shape)}"
            elif not leaf.is_floating_point():
                bad = f"has dtype {leaf.dtype}; optimizers update floating-point tensors"
            if bad is not None:
                raise InvalidArgument(
                    f"{name}{_path(grads, i)} {bad}. grads, params and the optimizer state must have "
                    "the same structure and shapes (as returned by init(params)); pass the "
                    "gradients of these params."
                )
    return spec, where, out


def _path(grads: Any, i: int) -> str:
    """The path of leaf ``i`` of ``grads`` (``None`` a leaf), as in ``['blocks'][0]``."""
    return optree.tree_accessors(grads, none_is_leaf=True)[i].codify("")


def _rebuild(spec: Any, subs: list[Any], new: dict[int, Tensor]) -> Any:
    return optree.tree_unflatten(spec, [new.get(i, s) for i, s in enumerate(subs)])


def _master_tree(params: Any) -> Any:
    """A float32 copy of each low-precision param, ``None`` at the other leaves."""
    return optree.tree_map(
        lambda p: p.detach().to(torch.float32, copy=True) if low_precision(p) else None,
        params,
        none_is_leaf=False,
    )


def _zeros_like_tree(params: Any, master_weights: bool = False) -> Any:
    """Zeros like each param; float32 for low-precision params when ``master_weights``."""
    return optree.tree_map(
        lambda p: (
            torch.zeros_like(p, dtype=torch.float32)
            if master_weights and low_precision(p)
            else torch.zeros_like(p)
        ),
        params,
        none_is_leaf=False,
    )


def _masters(
    spec: Any, where: list[int], p_l: list[Any], master: Any, enabled: bool, grads: Any
) -> list[Any]:
    """The master copy at every position of ``spec`` (``None`` where a param has none), checked
    against the params: float32, same shape and device, present exactly for low-precision
    params."""
    if not enabled:
        leaves = optree.tree_leaves(master, none_is_leaf=False)
        if leaves:
            raise InvalidArgument(
                f"state.master holds {len(leaves)} master copies, but this optimizer was built "
                "with master_weights=False; update with the optimizer whose init made the state "
                "(pass master_weights=True)"
            )
        return [None] * len(p_l)
    if master is None:
        m_l: list[Any] = [None] * len(p_l)
    else:
        try:
            m_l = spec.flatten_up_to(like(master, grads))
        except (ValueError, TypeError):
            raise InvalidArgument(
                "state.master does not have the structure of grads; it must be the state.master "
                "that init(params) returned for these params"
            ) from None
    for i in where:
        p, m = p_l[i], m_l[i]
        bad = None
        if low_precision(p):
            if not isinstance(m, Tensor):
                bad = f"is {type(m).__name__}, not the float32 master copy of a {p.dtype} param"
            elif m.dtype != torch.float32 or m.shape != p.shape or m.device != p.device:
                bad = (
                    f"is {m.dtype} {tuple(m.shape)} on {m.device}; the param is {p.dtype} "
                    f"{tuple(p.shape)} on {p.device} and its master must be float32 of the "
                    "same shape on the same device"
                )
        elif m is not None:
            bad = f"is a tensor, but the param is {p.dtype}: only low-precision params have one"
        if bad is not None:
            raise InvalidArgument(
                f"state.master{_path(grads, i)} {bad}. With master_weights=True the state must come "
                "from init(params) of these params (same dtypes and devices)."
            )
    return m_l


def _groups(where: list[int], work: list[Any]) -> list[list[int]]:
    """Positions grouped by (device, dtype) of what is updated (the master or the param), for
    the foreach kernels."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i in where:
        t = work[i]
        groups.setdefault((t.device, t.dtype), []).append(i)
    return list(groups.values())


def _outputs(
    idx: list[int], new_w: Sequence[Tensor], p_l: list[Any], m_l: list[Any]
) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
    """New params (each in its own dtype) and new masters from the updated working tensors."""
    new_p: dict[int, Tensor] = {}
    new_m: dict[int, Tensor] = {}
    for i, w in zip(idx, new_w, strict=True):
        if m_l[i] is None:
            new_p[i] = w
        else:
            new_m[i] = w
            new_p[i] = w.to(p_l[i].dtype)
    return new_p, new_m


# -------------------------------------------------------------------------------- hypers
@dataclasses.dataclass(frozen=True)
class _Hyper:
    name: str = dataclasses.field(init=False, default="")

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self) if f.init
        )
        return f"{self.name}({fields})"


@dataclasses.dataclass(frozen=True, repr=False)
class _SGDHyper(_Hyper):
    lr: float | Schedule
    momentum: float
    nesterov: bool
    weight_decay: float
    master_weights: bool
    name: str = dataclasses.field(init=False, default="sgd")


@dataclasses.dataclass(frozen=True, repr=False)
class _AdamWHyper(_Hyper):
    lr: float | Schedule
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    master_weights: bool
    name: str = dataclasses.field(init=False, default="adamw")


def _check_master(master_weights: Any) -> bool:
    if not isinstance(master_weights, bool):
        raise InvalidArgument(
            f"master_weights={master_weights!r}: pass True (a float32 master copy and float32 "
            "optimizer state for bfloat16/float16 params) or False"
        )
    return master_weights


# ------------------------------------------------------------------------------------ SGD
def sgd(
    lr: float | Schedule,
    *,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    master_weights: bool = False,
) -> Optimizer:
    """Stochastic gradient descent, with the update rule of ``torch.optim.SGD`` (no dampening).

    Per leaf, with ``g = grad + weight_decay * param`` (coupled L2 decay, as in torch)::

        buf   = momentum * buf + g                        (buf starts at 0)
        step  = g + momentum * buf   if nesterov else buf  (g without momentum)
        param = param - lr * step

    Args:
        lr: a number >= 0, or a schedule ``step -> lr`` called with the number of updates
            already made (0 for the first update).
        momentum: >= 0; 0 keeps no momentum buffer (``state.momentum`` is ``None``).
        nesterov: Nesterov momentum (needs ``momentum > 0``).
        weight_decay: >= 0, added to the gradient as ``weight_decay * param``.
        master_weights: keep a float32 master copy of every low-precision (bfloat16,
            float16) param in ``state.master`` and that param's optimizer state in float32;
            the update runs in float32 from the master (gradients are upcast) and the returned
            param is the new master rounded to the param's dtype. For those leaves the params'
            own values are not read: the master is the truth. Other params (float32, float64)
            are updated exactly as with ``False``, which keeps and computes everything, the
            state included, in each param's dtype (as ``torch.optim`` does).
    """
    lr = _check_lr("lr", lr)
    momentum = check_number("momentum", momentum, "must be a finite number >= 0", ge=0)
    if not isinstance(nesterov, bool):
        raise InvalidArgument(f"nesterov={nesterov!r}: pass True or False")
    if nesterov and momentum == 0:
        raise InvalidArgument(
            "nesterov=True needs momentum > 0 (got momentum=0.0); pass e.g. momentum=0.9"
        )
    weight_decay = check_number("weight_decay", weight_decay, "must be a finite number >= 0", ge=0)
    hyper = _SGDHyper(
        lr=lr,
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=weight_decay,
        master_weights=_check_master(master_weights),
    )
    return Optimizer(functools.partial(_sgd_init, hyper), functools.partial(_sgd_update, hyper))


def _sgd_init(hyper: _SGDHyper, params: Any) -> SGDState:
    mw = hyper.master_weights
    momentum = _zeros_like_tree(params, mw) if hyper.momentum else None
    return SGDState(0, momentum, _master_tree(params) if mw else None)


def _sgd_update(
    hyper: _SGDHyper, grads: Any, state: Any, params: Any, *, lr: float | None = None
) -> tuple[Any, SGDState]:
    count = _state_step(state, SGDState, "sgd")
    lr_t = _lr_at(hyper.lr, count, lr)
    trees = {"state.momentum": state.momentum} if hyper.momentum else {}
    spec, where, (g_l, p_l, *rest) = _align(grads, params, trees)
    m_l = _masters(spec, where, p_l, state.master, hyper.master_weights, grads)
    work = [p if m is None else m for p, m in zip(p_l, m_l, strict=True)]
    new_p: dict[int, Tensor] = {}
    new_m: dict[int, Tensor] = {}
    new_b: dict[int, Tensor] = {}
    with torch.no_grad():
        for idx in _groups(where, work):
            p = [work[i] for i in idx]
            g: Any = [g_l[i].to(work[i].dtype) for i in idx]
            if hyper.weight_decay:
                g = torch._foreach_add(g, p, alpha=hyper.weight_decay)
            d: Any = g
            if hyper.momentum:
                buf = torch._foreach_mul([rest[0][i] for i in idx], hyper.momentum)
                torch._foreach_add_(buf, g)
                new_b.update(zip(idx, buf, strict=True))
                d = torch._foreach_add(g, buf, alpha=hyper.momentum) if hyper.nesterov else buf
            ps, ms = _outputs(idx, torch._foreach_add(p, d, alpha=-lr_t), p_l, m_l)
            new_p.update(ps)
            new_m.update(ms)
    momentum = _rebuild(spec, rest[0], new_b) if hyper.momentum else None
    master = _rebuild(spec, m_l, new_m) if hyper.master_weights else None
    return _rebuild(spec, p_l, new_p), SGDState(count + 1, momentum, master)


# ---------------------------------------------------------------------------------- AdamW
def adamw(
    lr: float | Schedule,
    *,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    master_weights: bool = False,
) -> Optimizer:
    """Adam with decoupled weight decay, with the update rule of ``torch.optim.AdamW``.

    Per leaf, at update ``t`` (1, 2, ...)::

        param = param * (1 - lr * weight_decay)
        mu    = b1 * mu + (1 - b1) * grad
        nu    = b2 * nu + (1 - b2) * grad**2
        param = param - lr / (1 - b1**t) * mu / (sqrt(nu) / sqrt(1 - b2**t) + eps)

    Args:
        lr: a number >= 0, or a schedule ``step -> lr`` called with the number of updates
            already made (0 for the first update).
        betas: ``(b1, b2)``, each in ``[0, 1)``.
        eps: > 0 (added to the denominator).
        weight_decay: >= 0 (decoupled: scaled by ``lr``, not added to the gradient).
        master_weights: float32 master copies and float32 state for low-precision params,
            as for :func:`sgd`.
    """
    lr = _check_lr("lr", lr)
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(is_real(b) and 0.0 <= float(b) < 1.0 for b in betas)
    ):
        raise InvalidArgument(
            f"betas={betas!r}: a pair (b1, b2) of numbers in [0, 1), e.g. (0.9, 0.999)"
        )
    eps = check_number("eps", eps, "must be a finite number > 0, e.g. 1e-8", gt=0)
    weight_decay = check_number("weight_decay", weight_decay, "must be a finite number >= 0", ge=0)
    b1, b2 = (float(b) for b in betas)
    hyper = _AdamWHyper(
        lr=lr,
        betas=(b1, b2),
        eps=eps,
        weight_decay=weight_decay,
        master_weights=_check_master(master_weights),
    )
    return Optimizer(functools.partial(_adamw_init, hyper), functools.partial(_adamw_update, hyper))


def _adamw_init(hyper: _AdamWHyper, params: Any) -> AdamWState:
    mw = hyper.master_weights
    return AdamWState(
        0,
        _zeros_like_tree(params, mw),
        _zeros_like_tree(params, mw),
        _master_tree(params) if mw else None,
    )


def _adamw_update(
    hyper: _AdamWHyper, grads: Any, state: Any, params: Any, *, lr: float | None = None
) -> tuple[Any, AdamWState]:
    count = _state_step(state, AdamWState, "adamw")
    lr_t = _lr_at(hyper.lr, count, lr)
    spec, where, (g_l, p_l, mu_l, nu_l) = _align(
        grads, params, {"state.mu": state.mu, "state.nu": state.nu}
    )
    m_l = _masters(spec, where, p_l, state.master, hyper.master_weights, grads)
    work = [p if m is None else m for p, m in zip(p_l, m_l, strict=True)]
    b1, b2 = hyper.betas
    t = count + 1
    step_size = lr_t / (1 - b1**t)
    bc2_sqrt = (1 - b2**t) ** 0.5
    new_p: dict[int, Tensor] = {}
    new_m: dict[int, Tensor] = {}
    new_mu: dict[int, Tensor] = {}
    new_nu: dict[int, Tensor] = {}
    with torch.no_grad():
        for idx in _groups(where, work):
            p = [work[i] for i in idx]
            g = [g_l[i].to(work[i].dtype) for i in idx]
            out: Any
            if hyper.weight_decay:
                out = torch._foreach_mul(p, 1 - lr_t * hyper.weight_decay)
            else:
                out = [x.clone() for x in p]
            mu = torch._foreach_lerp([mu_l[i] for i in idx], g, 1 - b1)
            nu = torch._foreach_mul([nu_l[i] for i in idx], b2)
            torch._foreach_addcmul_(nu, g, g, value=1 - b2)
            denom = torch._foreach_sqrt(nu)
            torch._foreach_div_(denom, bc2_sqrt)
            torch._foreach_add_(denom, hyper.eps)
            torch._foreach_addcdiv_(out, mu, denom, value=-step_size)
            ps, ms = _outputs(idx, out, p_l, m_l)
            new_p.update(ps)
            new_m.update(ms)
            new_mu.update(zip(idx, mu, strict=True))
            new_nu.update(zip(idx, nu, strict=True))
    master = _rebuild(spec, m_l, new_m) if hyper.master_weights else None
    return _rebuild(spec, p_l, new_p), AdamWState(
        t, _rebuild(spec, mu_l, new_mu), _rebuild(spec, nu_l, new_nu), master
    )
