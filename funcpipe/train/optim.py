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

:func:`clip_by_global_norm` clips by the norm of the whole model's gradient, also when the
leaves are spread over ranks; the schedules (:func:`warmup_cosine`, :func:`linear_warmup`,
:func:`constant`) are pure functions of the step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import optree
import torch

from funcpipe.errors import InvalidArgument, check_int, check_number, is_real

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

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
    "warmup_cosine",
]

Tensor = torch.Tensor
Schedule = Callable[[int], float]
"""A learning-rate schedule: ``step -> lr``, where ``step`` counts the updates already made."""


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
            subs = spec.flatten_up_to(tree)
        except (ValueError, TypeError) as e:
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


def _low(t: Any) -> bool:
    """Whether ``t`` is a floating tensor narrower than float32 (bfloat16, float16, ...)."""
    return isinstance(t, Tensor) and t.is_floating_point() and torch.finfo(t.dtype).bits < 32


def _rebuild(spec: Any, subs: list[Any], new: dict[int, Tensor]) -> Any:
    return optree.tree_unflatten(spec, [new.get(i, s) for i, s in enumerate(subs)])


def _master_tree(params: Any) -> Any:
    """A float32 copy of each low-precision param, ``None`` at the other leaves."""
    return optree.tree_map(
        lambda p: p.detach().to(torch.float32, copy=True) if _low(p) else None,
        params,
        none_is_leaf=False,
    )


def _zeros_like_tree(params: Any, master_weights: bool = False) -> Any:
    """Zeros like each param; float32 for low-precision params when ``master_weights``."""
    return optree.tree_map(
        lambda p: (
            torch.zeros_like(p, dtype=torch.float32)
            if master_weights and _low(p)
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
            m_l = spec.flatten_up_to(master)
        except (ValueError, TypeError):
            raise InvalidArgument(
                "state.master does not have the structure of grads; it must be the state.master "
                "that init(params) returned for these params"
            ) from None
    for i in where:
        p, m = p_l[i], m_l[i]
        bad = None
        if _low(p):
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
            values = spec.flatten_up_to(weights)
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
            total = _all_reduce_sum(total, group)
        return total.sqrt()


def _all_reduce_sum(total: Tensor, group: ProcessGroup) -> Tensor:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidArgument(
            f"group={group!r} was given but torch.distributed is not initialised; pass "
            "group=None on a single process"
        )
    comm = total
    if dist.get_backend(group) == "nccl" and total.device.type != "cuda":
        comm = total.to(torch.device("cuda", torch.cuda.current_device()))
    else:
        comm = total.clone()
    dist.all_reduce(comm, op=dist.ReduceOp.SUM, group=group)
    return comm.to(total.device)


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


# ------------------------------------------------------------------------------ schedules
def _check_step(step: Any) -> int:
    if isinstance(step, Tensor) and step.numel() == 1:
        step = int(step.item())
    return check_int("step", step, 0, "the number of updates made so far, an int >= 0")


_STEPS = "a number of steps, an int >= 0"
_RATE = "a learning rate, a finite number >= 0"


@dataclasses.dataclass(frozen=True)
class _Constant:
    lr: float

    def __call__(self, step: int) -> float:
        _check_step(step)
        return self.lr

    def __repr__(self) -> str:
        return f"constant({self.lr!r})"


@dataclasses.dataclass(frozen=True)
class _LinearWarmup:
    peak: float
    warmup: int

    def __call__(self, step: int) -> float:
        step = _check_step(step)
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        return self.peak

    def __repr__(self) -> str:
        return f"linear_warmup({self.peak!r}, warmup={self.warmup!r})"


@dataclasses.dataclass(frozen=True)
class _WarmupCosine:
    peak: float
    warmup: int
    total: int
    final: float

    def __call__(self, step: int) -> float:
        step = _check_step(step)
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        if step >= self.total:
            return self.final
        progress = (step - self.warmup) / (self.total - self.warmup)
        return self.final + (self.peak - self.final) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def __repr__(self) -> str:
        return (
            f"warmup_cosine({self.peak!r}, warmup={self.warmup!r}, total={self.total!r}, "
            f"final={self.final!r})"
        )


def constant(lr: float) -> Schedule:
    """The schedule ``step -> lr``."""
    return _Constant(check_number("lr", lr, _RATE, ge=0))


def linear_warmup(peak: float, *, warmup: int) -> Schedule:
    """``peak * (step + 1) / warmup`` for ``step < warmup``, then ``peak``.

    The first update (step 0) uses ``peak / warmup`` and step ``warmup - 1`` reaches ``peak``;
    ``warmup=0`` is the constant ``peak``.
    """
    return _LinearWarmup(
        check_number("peak", peak, _RATE, ge=0), check_int("warmup", warmup, 0, _STEPS)
    )


def warmup_cosine(peak: float, *, warmup: int, total: int, final: float = 0.0) -> Schedule:
    """Linear warmup to ``peak``, then a cosine decay to ``final`` at step ``total``.

    * ``step < warmup``: ``peak * (step + 1) / warmup`` (as :func:`linear_warmup`);
    * ``warmup <= step < total``: ``final + (peak - final) * (1 + cos(pi * p)) / 2`` with
      ``p = (step - warmup) / (total - warmup)``, so ``peak`` at ``step == warmup``;
    * ``step >= total``: ``final``.
    """
    peak = check_number("peak", peak, _RATE, ge=0)
    warmup = check_int("warmup", warmup, 0, _STEPS)
    total = check_int("total", total, 0, _STEPS)
    if total < warmup:
        raise InvalidArgument(
            f"total={total!r} < warmup={warmup!r}: total counts all steps, warmup included; "
            "pass total >= warmup"
        )
    return _WarmupCosine(peak, warmup, total, check_number("final", final, _RATE, ge=0))
