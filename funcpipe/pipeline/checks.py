"""Checks :class:`funcpipe.Pipeline` makes of its arguments, outside the hot path.

Each check either passes or raises :class:`~funcpipe.errors.InvalidArgument` naming the
argument, the value, the rule and the fix, before any work or communication of the step. The
constructor's arguments are checked together by :func:`arguments`, before anything is built;
a step's by the checks under "step". The ones that walk every parameter leaf
(:func:`shared_storage`) run on a pipeline's first step only; none reads a value on a device.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import optree
import torch

from funcpipe.distributed import world as _world
from funcpipe.errors import InvalidArgument
from funcpipe.pipeline.microbatch import _batch_size
from funcpipe.schedule.ir import Program
from funcpipe.stages.keys import draw_seed
from funcpipe.stages.stage import Stage
from funcpipe.stages.ties import TiePath, check_ties
from funcpipe.tree import check_tensor_tree, leaf_paths, tree_leaves

__all__ = [
    "Arguments",
    "arguments",
    "autograd_context",
    "data_shares",
    "device_available",
    "inference_tensors",
    "loss_arity",
    "loss_targets",
    "meta_inputs",
    "poison",
    "shared_storage",
    "stage_params",
    "step_loss_scale",
    "tensor_loss_scale",
    "tie_containers",
]

Tensor = torch.Tensor


# ------------------------------------------------------------------------------ construction
class Arguments(NamedTuple):
    """A Pipeline's constructor arguments once checked, in the forms it keeps: the stages as a
    tuple, ``side_inputs`` as ``{stage: (field, ...)}`` (of the program's stages as the user
    numbered them), ``ties`` normalised, ``device`` a :class:`torch.device` (or ``None``) and
    ``transport`` chosen (``"local"`` or ``"dist"``)."""

    stages: tuple[Stage, ...]
    side_inputs: dict[int, tuple[str, ...]]
    ties: dict[str, list[Any]]
    device: torch.device | None
    transport: str


def arguments(
    stages: Sequence[Stage],
    schedule: Program,
    *,
    loss_fn: Callable[..., Any] | None,
    metric_fn: Callable[..., Any] | None,
    ties: Mapping[str, Sequence[TiePath]] | None,
    side_inputs: Mapping[int, Sequence[str]] | None,
    data: int,
    transport: str | None,
    mesh: Any,
    scatter_gather: bool,
    device: torch.device | str | None,
    grad_dtype: torch.dtype | None,
) -> Arguments:
    """Every check of :class:`funcpipe.Pipeline`'s constructor, in the order it makes them
    (the first broken rule is the one reported); see the Pipeline for what each means."""
    checked = stage_list(stages, schedule)
    step_functions(loss_fn, metric_fn, schedule.training)
    if not isinstance(data, int) or data < 1:
        raise InvalidArgument(f"data={data!r}: the number of data-parallel replicas, an int >= 1")
    side = side_input_stages(side_inputs, schedule.n_stages)
    tie_containers(ties)
    tied = check_ties(ties, len(checked))
    place = torch.device(device) if device is not None else None
    device_available(place)
    gradient_dtype(grad_dtype)
    chosen = transport_choice(transport, mesh=mesh, scatter_gather=scatter_gather, data=data)
    return Arguments(checked, side, tied, place, chosen)


def stage_list(stages: Sequence[Stage], schedule: Program) -> tuple[Stage, ...]:
    """``stages`` as a tuple of :class:`~funcpipe.Stage`, as many as ``schedule``'s model
    stages, and ``schedule`` a :class:`~funcpipe.schedule.Program`."""
    checked = tuple(stages)
    for k, s in enumerate(checked):
        if not isinstance(s, Stage):
            raise InvalidArgument(
                f"stages[{k}]={s!r}: pass funcpipe.Stage objects (see from_module)"
            )
    if not isinstance(schedule, Program):
        raise InvalidArgument(
            f"schedule={schedule!r}: pass a funcpipe.schedule.Program, e.g. "
            "generate('1f1b', ranks=2, microbatches=4)"
        )
    owners = schedule.replica_of or tuple(range(schedule.n_stages))
    if sorted(set(owners)) != list(range(len(checked))):
        raise InvalidArgument(
            f"the schedule has {len(set(owners))} model stage(s) but {len(checked)} stage(s) "
            "were given; partition the model into as many stages as the schedule places"
        )
    return checked


def step_functions(
    loss_fn: Callable[..., Any] | None, metric_fn: Callable[..., Any] | None, training: bool
) -> None:
    """``loss_fn`` and ``metric_fn`` are callables or ``None``; a training program has a loss."""
    for name, fn in (("loss_fn", loss_fn), ("metric_fn", metric_fn)):
        if fn is not None and not callable(fn):
            raise InvalidArgument(f"{name}={fn!r} must be callable")
    if training and loss_fn is None:
        raise InvalidArgument(
            "a training schedule needs loss_fn (the backward starts at the loss); pass "
            "loss_fn=..., or use an eval schedule (to_eval(program)) for forward only"
        )


def side_input_stages(
    side_inputs: Mapping[int, Sequence[str]] | None, n_stages: int
) -> dict[int, tuple[str, ...]]:
    """``side_inputs`` as ``{stage: (field, ...)}``, naming stages of the program only."""
    if side_inputs is not None and not isinstance(side_inputs, Mapping):
        raise InvalidArgument(
            f"side_inputs={side_inputs!r} is a {type(side_inputs).__name__}; pass a dict "
            "{stage: [field, ...]} naming, per stage, the batch fields it takes as keyword "
            "arguments, e.g. side_inputs={1: ['mask']}"
        )
    for s, v in (side_inputs or {}).items():
        if isinstance(v, (str, bytes)):
            raise InvalidArgument(
                f"side_inputs[{s!r}]={v!r} is a string, which would be read as its letters; "
                f"pass a list of field names: side_inputs={{{s!r}: [{v!r}]}}"
            )
        try:
            int(s)
        except (TypeError, ValueError):
            raise InvalidArgument(
                f"side_inputs names stage {s!r}; its keys are stage numbers (ints), e.g. "
                f"side_inputs={{1: {list(v)!r}}}"
            ) from None
    side = {int(s): tuple(v) for s, v in (side_inputs or {}).items()}
    for k in side:
        if not 0 <= k < n_stages:
            raise InvalidArgument(
                f"side_inputs names stage {k}; the program has stages 0..{n_stages - 1}"
            )
    return side


def tie_containers(ties: Any) -> None:
    """``ties`` is ``None`` or a dict of lists of ``(stage, path)`` tuples (the pairs' own
    rules are :func:`funcpipe.stages.ties.check_ties`'): lists where tuples belong are named."""
    if ties is None:
        return
    if not isinstance(ties, Mapping):
        raise InvalidArgument(
            f"ties={ties!r} is a {type(ties).__name__}; pass a dict naming each tie: "
            "{name: [(stage, path), ...]}, e.g. ties={'tied': [(0, 'embed.weight'), "
            "(3, 'head.weight')]}"
        )
    for name, members in ties.items():
        if not isinstance(members, (list, tuple)):
            continue
        for k, m in enumerate(members):
            if isinstance(m, list) and len(m) == 2:
                fixed = [tuple(x) if isinstance(x, list) and len(x) == 2 else x for x in members]
                raise InvalidArgument(
                    f"ties[{name!r}][{k}]={m!r} is a list; each member is a (stage, path) "
                    f"tuple: ties={{{name!r}: {fixed!r}}}"
                )


def gradient_dtype(grad_dtype: torch.dtype | None) -> None:
    """``grad_dtype`` is ``None`` or a floating :class:`torch.dtype`."""
    if grad_dtype is not None and (
        not isinstance(grad_dtype, torch.dtype) or not grad_dtype.is_floating_point
    ):
        raise InvalidArgument(
            f"grad_dtype={grad_dtype!r}: a floating torch.dtype (torch.float32 to sum bf16 "
            "gradients in float32), or None for each parameter's own dtype"
        )


def transport_choice(transport: str | None, *, mesh: Any, scatter_gather: bool, data: int) -> str:
    """The transport: ``transport``, or by default ``"dist"`` when a process group exists and
    ``"local"`` otherwise; checked against this process and the options that need one."""
    if transport is None:
        transport = "dist" if _world.initialised() else "local"
    if transport not in ("local", "dist"):
        raise InvalidArgument(f"transport={transport!r}: use 'local' or 'dist'")
    if transport == "dist" and not _world.initialised():
        raise InvalidArgument(
            "transport='dist' needs torch.distributed initialised (use funcpipe.launch, "
            "or torchrun and dist.init_process_group); without a process group use "
            "transport='local' (every rank in this process)"
        )
    if scatter_gather and mesh is None:
        raise InvalidArgument(
            "scatter_gather=True splits messages over the tensor ranks of mesh=; pass the mesh"
        )
    if mesh is not None and transport != "dist":
        raise InvalidArgument("mesh= describes processes: it needs transport='dist'")
    if transport == "dist" and data != 1:
        raise InvalidArgument(
            "data= is for transport='local'; with 'dist' the data-parallel size is the world "
            "size divided by the program's ranks"
        )
    return transport


def device_available(device: torch.device | None) -> None:
    """``device=`` names a device this process has (``cuda`` without CUDA fails here, not at
    the first step with torch's AssertionError)."""
    if device is None or device.type in ("cpu", "meta"):
        return
    module = getattr(torch, device.type, None)
    available = getattr(module, "is_available", None)
    if available is None:
        return
    if not available():
        raise InvalidArgument(
            f"device={str(device)!r}: this process has no {device.type.upper()} device "
            f"(torch.{device.type}.is_available() is False); pass device='cpu', or leave "
            "device unset to run where the parameters are"
        )
    count = getattr(module, "device_count", None)
    if device.index is not None and count is not None and device.index >= count():
        raise InvalidArgument(
            f"device={str(device)!r}: this process sees {count()} {device.type} device(s) "
            f"(indices 0..{count() - 1}); pass one of them"
        )


def loss_arity(fn: Callable[..., Any] | None) -> tuple[int, int | None] | None:
    """(required, most) positional arguments of ``fn`` (``most`` None for ``*args``), or None
    when its signature cannot be read."""
    if fn is None:
        return None
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    required, most = 0, 0
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            most += 1
            if p.default is p.empty:
                required += 1
        elif p.kind is p.VAR_POSITIONAL:
            return required, None
    return required, most


# ------------------------------------------------------------------------------------- step
def stage_params(params: Any, n_stages: int) -> tuple[Any, ...]:
    """``params`` as a tuple of one tensor pytree per stage."""
    if not isinstance(params, (tuple, list)) or len(params) != n_stages:
        raise InvalidArgument(
            f"params must be a tuple with one pytree per stage ({n_stages}); got "
            f"{type(params).__name__}"
            + (f" of length {len(params)}" if isinstance(params, (tuple, list)) else "")
        )
    for k, p in enumerate(params):
        check_tensor_tree(p, name=f"params[{k}]")
    return tuple(params)


def data_shares(batch: Any, dim: Any, data: int, microbatches: int) -> None:
    """In one process with ``data`` copies, each copy's share of ``batch`` holds at least one
    sample per microbatch (checked on the whole batch, so the message counts what was given)."""
    size = _batch_size(batch, dim=dim)
    least = size // data
    if size == 0 or least >= microbatches:  # (an empty batch: split says so)
        return
    raise InvalidArgument(
        f"the batch has {size} samples, split over data={data} copies (the smallest share "
        f"{least} samples), and each copy splits its share into microbatches={microbatches}: "
        f"every microbatch needs at least one sample. Use a batch of at least "
        f"{data * microbatches} samples (data x microbatches)"
        + (f", or microbatches <= {least}" if least >= 1 else f", or data <= {size}")
    )


def step_loss_scale(value: float | Tensor | None) -> float | Tensor:
    """A step's ``loss_scale``: ``None`` is 1.0; a number is checked here; a tensor (a loss
    scaler's state) by :func:`tensor_loss_scale`, which never reads one on an accelerator."""
    if value is None:
        return 1.0
    if isinstance(value, Tensor):
        return tensor_loss_scale(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgument(
            f"loss_scale={value!r}: a positive number (the factor the loss's gradient is "
            "multiplied by), or None"
        )
    if value == float("inf"):
        raise InvalidArgument("loss_scale=inf: the loss scale must be finite")
    return float(value)


def step_seed(seed: Any, training: bool) -> int | None:
    """A step's ``seed``: an int, or ``None`` for one drawn from torch's default CPU generator
    (:func:`funcpipe.stages.keys.draw_seed`); an eval program draws none (its stages run
    under no key)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidArgument(
            f"seed={seed!r}: an int (the step's random seed: every stage call runs under a key "
            "derived from it), or None to draw one from torch's default generator"
        )
    if not training:
        return None
    return draw_seed() if seed is None else seed


def autograd_context(training: bool) -> None:
    """A training step cannot run inside ``torch.inference_mode()``: the tensors made there can
    never be differentiated. (``torch.no_grad()`` is fine: the step enables grad inside.)"""
    if training and torch.is_inference_mode_enabled():
        raise InvalidArgument(
            "Pipeline.step was called inside torch.inference_mode(): a training step needs "
            "autograd, and tensors made in inference mode cannot be differentiated. Call step "
            "outside inference_mode (inside torch.no_grad() is fine: the step enables grad "
            "itself), or run an eval program (to_eval(program)) for forward only"
        )


def inference_tensors(tree: Any, name: str) -> None:
    """No leaf of ``tree`` is an inference tensor (made under ``torch.inference_mode()``):
    autograd cannot save one for the backward."""
    leaves = tree_leaves(tree)
    if not any(isinstance(t, Tensor) and t.is_inference() for t in leaves):
        return
    for path, t in zip(leaf_paths(tree, name=name), leaves, strict=True):
        if isinstance(t, Tensor) and t.is_inference():
            raise InvalidArgument(
                f"{path} is an inference tensor (made under torch.inference_mode()); a training "
                "step cannot differentiate through it. Make it outside inference_mode, or copy "
                "it there with .clone() outside inference_mode"
            )


def meta_inputs(tree: Any, name: str) -> None:
    """No leaf of the batch (or targets) is on the meta device (it has no data to train on)."""
    leaves = tree_leaves(tree)
    if not any(isinstance(t, Tensor) and t.is_meta for t in leaves):
        return
    for path, t in zip(leaf_paths(tree, name=name), leaves, strict=True):
        if isinstance(t, Tensor) and t.is_meta:
            raise InvalidArgument(
                f"{path} is on the meta device (shape {tuple(t.shape)}, no data); pass real "
                "tensors, or build the Pipeline with device='meta' for a dry run without data"
            )


def loss_targets(
    arity: tuple[int, int | None] | None, fn: Any, has_targets: bool, training: bool
) -> None:
    """``loss_fn`` is called ``loss_fn(outputs, targets)`` when targets are passed, else
    ``loss_fn(outputs)`` (training only): its signature must take that."""
    if arity is None:
        return
    required, most = arity
    name = getattr(fn, "__name__", repr(fn))
    if has_targets and most is not None and most < 2:
        raise InvalidArgument(
            f"loss_fn={name} takes {most} positional argument(s) but step was given targets, "
            "which it passes as loss_fn(outputs, targets); drop targets, or make loss_fn take "
            "(outputs, targets)"
        )
    if training and not has_targets and required >= 2:
        raise InvalidArgument(
            f"loss_fn={name} needs {required} positional arguments (outputs, targets, ...) but "
            "step was called without targets; pass them: pipe.step(params, batch, targets)"
        )


def tensor_loss_scale(value: Tensor) -> Tensor:
    """A one-element tensor loss scale, checked without waiting for a device.

    On the CPU its value is read here (no device to wait for): NaN, infinite, zero or negative
    is refused. On an accelerator reading it would wait for the device once a step, so it is
    not read: a scale that is not positive becomes NaN on the device (NaN and infinity stay as
    they are), so a bad scale gives non-finite gradients, which a loss scaler skips and
    ``check_finite`` names, never zero or sign-flipped gradients that look right.
    """
    if value.numel() != 1 or not value.is_floating_point():
        raise InvalidArgument(
            f"loss_scale must be a number or a one-element floating tensor; got a "
            f"{value.dtype} tensor of shape {tuple(value.shape)}"
        )
    v = value.detach().reshape(())
    if v.is_meta:
        raise InvalidArgument(
            "loss_scale is a meta tensor (no value); pass a number or a real tensor"
        )
    if v.device.type == "cpu":
        x = float(v)
        if not (x > 0 and x != float("inf")):
            raise InvalidArgument(
                f"loss_scale=tensor({x}): a loss scale must be finite and > 0 (the factor the "
                "loss's gradient is multiplied by); a LossScaleState never holds such a value, "
                "so check where this tensor was made"
            )
        return v
    return poison(v)


def poison(scale: Tensor) -> Tensor:
    """``scale`` where it is > 0, else NaN, computed on its device without reading it (NaN and
    infinity stay as they are): a bad scale can only give non-finite gradients."""
    return torch.where(scale > 0, scale, torch.full_like(scale, float("nan")))


# ------------------------------------------------------------------------------- first step
def _span(t: Tensor) -> tuple[int, int, int] | None:
    """(storage id, first byte, end byte) that ``t`` covers in its storage."""
    if t.is_meta or t.numel() == 0 or t.layout is not torch.strided:
        return None
    try:
        ptr = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return None
    if ptr == 0:
        return None
    size = t.element_size()
    first = int(t.storage_offset()) * size
    extent = 1 + sum(int(n - 1) * abs(int(s)) for n, s in zip(t.shape, t.stride(), strict=True))
    return ptr, first, first + extent * size


def _tie_path(accessor: Any) -> str:
    keys = [entry.entry for entry in accessor]
    if all(isinstance(k, str) and "." not in k for k in keys):
        return repr(".".join(keys))
    return repr(tuple(keys))


def _whole_params(params: Sequence[Any], j: int, k: int) -> None:
    """Refuse ``params[j]`` and ``params[k]`` that are one pytree of parameters (the same
    object, or every leaf the same tensor at the same path, two leaves or more): the whole
    model's parameters given to every stage, not a parameter two stages share."""
    a, b = params[j], params[k]
    la, sa = optree.tree_flatten(a, none_is_leaf=False)
    lb, sb = optree.tree_flatten(b, none_is_leaf=False)
    same = a is b or (
        sa == sb
        and len(la) >= 2
        and all(
            x is y or (isinstance(x, Tensor) and isinstance(y, Tensor) and _span(x) == _span(y))
            for x, y in zip(la, lb, strict=True)
        )
    )
    if same:
        raise InvalidArgument(
            f"params[{j}] and params[{k}] hold the same {len(la)} tensor(s) at the same paths "
            "(one pytree, such as the whole model's state_dict, given to several stages); each "
            "stage's params must hold only that stage's own parameters, or each stage trains "
            "its own copy of all of them. Pass one pytree per stage, as split_module and "
            "partition make them: pipe.step(parts.params, batch, targets). (A parameter two "
            "stages really share, such as a tied embedding, is declared with ties=.)"
        )


def shared_storage(params: Sequence[Any], tied: Mapping[tuple[int, int], str]) -> None:
    """Parameters of two different stages that share memory must be declared in ``ties=``.

    Without a tie each stage differentiates its own copy and the two gradients are never
    summed: training would go on silently with wrong gradients (GPT-2's tied embedding). Only
    floating leaves count (they get gradients); overlapping byte ranges of one storage count,
    views of disjoint parts of one buffer do not. ``tied`` maps (stage, leaf index) to the name
    of the tie that declares it.
    """
    seen: dict[int, list[tuple[int, int, int, Any, str | None]]] = {}
    for k, tree in enumerate(params):
        accessors = optree.tree_accessors(tree, none_is_leaf=False)
        for i, (accessor, t) in enumerate(zip(accessors, tree_leaves(tree), strict=True)):
            if not isinstance(t, Tensor) or not (t.is_floating_point() or t.is_complex()):
                continue
            span = _span(t)
            if span is None:
                continue
            ptr, lo, hi = span
            tie = tied.get((k, i))
            for j, lo2, hi2, acc2, tie2 in seen.get(ptr, ()):
                if j != k and lo < hi2 and lo2 < hi and (tie is None or tie != tie2):
                    _whole_params(params, j, k)
                    a, b = acc2.codify(f"params[{j}]"), accessor.codify(f"params[{k}]")
                    raise InvalidArgument(
                        f"{a} and {b} share memory, but ties= does not declare them: each stage "
                        "would differentiate its own copy and their gradients would never be "
                        "summed (silently wrong). Declare the tie, e.g. "
                        f"ties={{'shared': [({j}, {_tie_path(acc2)}), ({k}, {_tie_path(accessor)})]}}"
                        f", or give each stage its own copy (.clone()) if they are not meant to "
                        "be one parameter"
                    )
            seen.setdefault(ptr, []).append((k, lo, hi, accessor, tie))


def finite_default(check_finite: bool | None) -> bool:
    """``Pipeline(check_finite=)``: as given, else on when the environment sets
    ``FUNCPIPE_DEBUG`` to anything but ``0``."""
    if check_finite is None:
        import os

        return os.environ.get("FUNCPIPE_DEBUG", "") not in ("", "0")
    return bool(check_finite)
