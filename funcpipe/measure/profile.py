"""Profiling: measure what each stage costs, for :func:`funcpipe.schedule.auto` and the simulator.

:func:`profile_stages` runs the real stages on a real microbatch through
:mod:`funcpipe.runtime.autodiff`, the functions the interpreter runs (forward, backward_input,
backward_weight, backward on flat tensor lists), chaining each stage's outputs into the next
stage's inputs (:func:`funcpipe.stages.stage.as_inputs`), and returns the medians as a
:class:`~funcpipe.schedule.simulate.Costs`. :func:`measure_stages` returns every number it took,
the full backward ``B`` included (a :class:`~funcpipe.schedule.costs.StageTimes`). They time
with the clock a traced step uses (:mod:`funcpipe.runtime.clock`): on CUDA, events on the
stream, so the numbers are the kernels' times, comparable with an executed timeline's.
:func:`measure_memory` counts the bytes each stage keeps for its backward (a
:class:`~funcpipe.schedule.costs.StageMemory`).

These run stages, so they live above both :mod:`funcpipe.schedule` (which never imports the
runtime) and :mod:`funcpipe.runtime`; what they return is plain schedule data
(:mod:`funcpipe.schedule.costs`, where :func:`~funcpipe.schedule.costs.costs_from_timelines`
reads the same costs off executed steps).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from funcpipe.errors import InvalidArgument
from funcpipe.runtime import autodiff
from funcpipe.runtime.clock import step_clock, timer
from funcpipe.runtime.saved import SavedBytes
from funcpipe.schedule.costs import StageMemory, StageTimes
from funcpipe.schedule.simulate import Costs
from funcpipe.stages.stage import Stage, as_inputs
from funcpipe.tree import tree_flatten, tree_unflatten

__all__ = ["measure_memory", "measure_stages", "profile_stages"]


def profile_stages(
    stages: Sequence[Any],
    params: Sequence[Any],
    example: Any,
    *,
    repeats: int = 5,
    warmup: int = 1,
    comm: float | None = None,
) -> Costs:
    """Per-stage costs of ``stages`` on one microbatch ``example``, in seconds.

    Args:
        stages: the model's stages in order (:class:`funcpipe.Stage`, as for ``Pipeline``).
        params: one params pytree per stage.
        example: the first stage's input for one microbatch (a tuple is several positional
            inputs, as everywhere in funcpipe). Each stage's outputs feed the next stage.
        repeats: timed runs per stage; the median is kept (default 5).
        warmup: untimed runs per stage first (default 1).
        comm: the message latency to report. ``None`` (the default): measured over
            ``torch.distributed`` when a process group of at least two ranks is initialised
            (then every rank must call this function; ranks 0 and 1 exchange the largest
            activation), else 0.

    Returns ``Costs(f=[...], b=[...], w=[...], comm=...)`` with one value per stage, where
    ``b`` is the input-gradient backward (I) and ``w`` the weight-gradient backward (W), as
    :func:`funcpipe.schedule.simulate.simulate` and :func:`funcpipe.schedule.auto.auto` take
    them. It takes ``(warmup + repeats)`` times two forwards and two backwards per stage.
    """
    return measure_stages(
        stages, params, example, repeats=repeats, warmup=warmup, comm=comm
    ).costs()


def measure_stages(
    stages: Sequence[Any],
    params: Sequence[Any],
    example: Any,
    *,
    repeats: int = 5,
    warmup: int = 1,
    comm: float | None = None,
) -> StageTimes:
    """What :func:`profile_stages` measures, with the full backward ``B`` too (see there)."""
    _check_stages("profile_stages", stages, params)
    for name, value, least in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InvalidArgument(
                f"profile_stages: {name}={value!r}; {name} is a whole number >= {least}"
            )
    if comm is not None and (
        isinstance(comm, bool) or not isinstance(comm, int | float) or not comm >= 0
    ):
        raise InvalidArgument(
            f"profile_stages: comm={comm!r}; the message latency is a number >= 0 (seconds), "
            "or None to measure it"
        )

    inputs = as_inputs(example)
    f_t, i_t, w_t, b_t = [], [], [], []
    largest: Any = None
    for k, (stage, p) in enumerate(zip(stages, params, strict=True)):
        f, i, w, b, outputs = _time_stage(stage, p, inputs, k, repeats=repeats, warmup=warmup)
        f_t.append(f)
        i_t.append(i)
        w_t.append(w)
        b_t.append(b)
        if k + 1 < len(stages):
            flat, _ = tree_flatten(outputs)
            size = sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor))
            if largest is None or size > largest[0]:
                largest = (size, flat)
            inputs = as_inputs(outputs)
    latency = float(comm) if comm is not None else _measure_comm(largest[1] if largest else [])
    return StageTimes(tuple(f_t), tuple(i_t), tuple(w_t), tuple(b_t), latency)


def measure_memory(
    stages: Sequence[Any],
    params: Sequence[Any],
    example: Any,
    *,
    loss_fn: Callable[..., Any] | None = None,
    target: Any = None,
) -> StageMemory:
    """Per-stage activation bytes of ``stages`` on one microbatch ``example``.

    Runs each stage's F and then its I through :mod:`funcpipe.runtime.autodiff`, as the
    interpreter does, counting with :class:`funcpipe.runtime.saved.SavedBytes` what autograd
    saves (each tensor once, parameters excluded) and what the I keeps outside the graph for
    the W. Each stage's outputs feed the next (as in :func:`profile_stages`). With ``loss_fn``
    the last stage's F also runs ``loss_fn(outputs, target)`` (``loss_fn(outputs)`` without a
    target), as a pipeline's last stage does, and its saved tensors count as that stage's.
    Deterministic: one run per stage, no timing.
    """
    _check_stages("measure_memory", stages, params)
    if loss_fn is not None and not callable(loss_fn):
        raise InvalidArgument(
            f"measure_memory: loss_fn={loss_fn!r} is not callable; pass the pipeline's loss "
            "function (outputs[, target]) -> scalar, or None"
        )
    inputs = as_inputs(example)
    act, kept = [], []
    last = len(stages) - 1
    for k, (stage, p) in enumerate(zip(stages, params, strict=True)):
        loss = None
        if k == last and loss_fn is not None:
            loss = (lambda o: loss_fn(o, target)) if target is not None else loss_fn
        fn, flat_params, in_leaves, out_tree = _flat_stage(
            "measure_memory", stage, p, inputs, k, loss
        )
        with SavedBytes(flat_params) as counter:
            outputs, saved = autodiff.forward(fn, flat_params, in_leaves)
            if k == 0:  # as the interpreter: the batch needs no gradient
                for t in saved.inputs:
                    t.requires_grad_(False)
            act.append(counter.live)
            autodiff.backward_input(saved, flat_params, _seeds(outputs))
            held = [counter.hold(t) for t in _left_for_w(saved)]
            kept.append(counter.live)
            for key, t in held:
                counter.release(key, t)
            autodiff.backward_weight(saved, flat_params, accumulate=True)
        if k < last:
            inputs = as_inputs(tree_unflatten(out_tree[0], outputs))
    return StageMemory(tuple(act), tuple(kept))


def _left_for_w(saved: Any) -> list[Any]:
    """The tensors an I keeps outside autograd's graph for its W: the gradients recorded where
    W's branches start."""
    out: list[Any] = []
    for group in saved.roots:
        out += [g for r in group for _, g in r.edges if g is not None]
    out += [g for _, g in saved.direct if g is not None]
    return out


def _check_stages(who: str, stages: Any, params: Any) -> None:
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not stages:
        raise InvalidArgument(
            f"{who}: stages={stages!r}; pass a non-empty list of funcpipe.Stage "
            "(e.g. from funcpipe.partition or funcpipe.from_module)"
        )
    for k, s in enumerate(stages):
        if not isinstance(s, Stage):
            raise InvalidArgument(
                f"{who}: stages[{k}]={s!r} is not a funcpipe.Stage; wrap a function "
                "with funcpipe.Stage(fn) or a module with funcpipe.from_module(module)"
            )
    if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
        raise InvalidArgument(
            f"{who}: params must be a sequence with one params pytree per stage; got "
            f"{type(params).__name__}"
        )
    if len(params) != len(stages):
        raise InvalidArgument(
            f"{who}: {len(stages)} stage(s) but {len(params)} params; give one params "
            "pytree per stage"
        )


def _flat_stage(
    who: str,
    stage: Any,
    params: Any,
    inputs: tuple[Any, ...],
    k: int,
    loss: Callable[[Any], Any] | None,
) -> tuple[Callable[..., list[Any]], list[Any], list[Any], list[Any]]:
    """``stage`` as the interpreter runs it: ``fn(flat params, flat inputs) -> flat outputs``
    (through ``loss`` when given), the params as fresh leaves requiring grad, the flat inputs,
    and a list that gets the outputs' tree structure at the first call."""
    p_leaves, p_tree = tree_flatten(params)
    for t in p_leaves:
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(
                f"{who}: params[{k}] holds a {type(t).__name__}; params are pytrees of tensors"
            )
    flat_params = [
        t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in p_leaves
    ]
    in_leaves, in_tree = tree_flatten(inputs)
    out_tree: list[Any] = []

    def fn(ps: Sequence[Any], xs: Sequence[Any]) -> list[Any]:
        out = stage(tree_unflatten(p_tree, list(ps)), *tree_unflatten(in_tree, list(xs)))
        if loss is not None:
            out = loss(out)
        flat, tree = tree_flatten(out)
        if not out_tree:
            out_tree.append(tree)
        return list(flat)

    return fn, flat_params, list(in_leaves), out_tree


def _seeds(outs: Sequence[Any]) -> list[Any]:
    """The gradient arriving from the next stage (or the loss): ones, shaped as each output."""
    return [torch.ones_like(o) if (o.is_floating_point() or o.is_complex()) else None for o in outs]


def _time_stage(
    stage: Any, params: Any, inputs: tuple[Any, ...], k: int, *, repeats: int, warmup: int
) -> tuple[float, float, float, float, Any]:
    """Median F, I, W, B seconds of one stage, and its outputs (detached) for the next stage."""
    fn, flat_params, in_leaves, out_tree = _flat_stage(
        "profile_stages", stage, params, inputs, k, None
    )
    device = next(
        (t.device for t in [*flat_params, *in_leaves] if isinstance(t, torch.Tensor)),
        torch.device("cpu"),
    )

    def forward() -> tuple[list[Any], Any]:
        outs, saved = autodiff.forward(fn, flat_params, in_leaves)
        if k == 0:  # as the interpreter: the batch needs no gradient, so stage 0's I is empty
            for t in saved.inputs:
                t.requires_grad_(False)
        return outs, saved

    # timed as a traced step times its instructions (funcpipe.runtime.clock): on CUDA, events on
    # the stream, resolved after each run, so the numbers are kernel times, not launch times;
    # as the interpreter: parameter gradients summed in place into the leaves' .grad
    times: dict[str, list[float]] = {"f": [], "i": [], "w": [], "b": []}
    outputs: list[Any] = []
    for run in range(warmup + repeats):
        clock = step_clock(device)
        stamps = [clock.stamp()]
        outputs, saved = forward()
        stamps.append(clock.stamp())
        autodiff.backward_input(saved, flat_params, _seeds(outputs))
        stamps.append(clock.stamp())
        autodiff.backward_weight(saved, flat_params, accumulate=True)
        stamps.append(clock.stamp())
        _, saved = forward()
        stamps.append(clock.stamp())
        autodiff.backward(saved, flat_params, _seeds(outputs), accumulate=True)  # the runtime's B
        stamps.append(clock.stamp())
        t0, t1, t2, t3, t4, t5 = clock.resolve(stamps)
        if run >= warmup:
            times["f"] += [t1 - t0, t4 - t3]
            times["i"].append(t2 - t1)
            times["w"].append(t3 - t2)
            times["b"].append(t5 - t4)
    med = {name: statistics.median(v) for name, v in times.items()}
    return med["f"], med["i"], med["w"], med["b"], tree_unflatten(out_tree[0], outputs)


def _measure_comm(payload: Sequence[Any], *, rounds: int = 10) -> float:
    """Half the median round trip of ``payload`` between ranks 0 and 1 over torch.distributed
    (0 without a process group of two or more ranks); every rank gets rank 0's number."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return 0.0
    rank = dist.get_rank()
    tensors = [t.detach().clone() for t in payload if isinstance(t, torch.Tensor)]
    if not tensors:
        tensors = [torch.zeros(1)]
    if dist.get_backend() == "nccl":
        tensors = [t.cuda() for t in tensors]
    # NCCL's send and recv return once queued: wait for the device before reading the clock
    now = timer(tensors[0].device)
    samples = []
    for _ in range(rounds + 1):
        t0 = now()
        for t in tensors:
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            elif rank == 1:
                dist.recv(t, 0)
                dist.send(t, 0)
        samples.append((now() - t0) / 2)
    result = torch.tensor([statistics.median(samples[1:]) if rank == 0 else 0.0])
    if dist.get_backend() == "nccl":
        result = result.cuda()
    dist.broadcast(result, 0)
    return float(result.item())
