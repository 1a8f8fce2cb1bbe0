"""Cut a sequence of layers into contiguous stages.

``partition(model, 4, by="parameters")`` returns a :class:`Partition` of stages (pure functions),
their params and the layer range of each stage. Module stages keep the full model's parameter
names, so the union of the stage params is exactly ``dict(model.named_parameters())``.
"""

from __future__ import annotations

import inspect
import itertools
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from funcpipe.errors import InvalidArgument
from funcpipe.stages.stage import Stage, as_inputs, compose, from_module
from funcpipe.tree import check_tensor_tree, tree_leaves

__all__ = ["Partition", "partition"]

_BY_NAMES = ("uniform", "parameters", "profile")


class Partition(NamedTuple):
    """The result of :func:`partition`.

    ``stages[i]`` runs layers ``bounds[i][0] <= l < bounds[i][1]`` with params ``params[i]``.
    """

    stages: tuple[Stage, ...]
    params: tuple[Any, ...]
    bounds: tuple[tuple[int, int], ...]

    def __repr__(self) -> str:
        counts = ", ".join(f"{len(tree_leaves(p))} tensors" for p in self.params)
        return f"Partition(stages={self.stages!r}, params=({counts}), bounds={self.bounds!r})"


class _Chain(nn.Sequential):
    """``nn.Sequential`` that chains with funcpipe's convention (a tuple output is unpacked).

    For layers that take and return one tensor it is exactly ``nn.Sequential``. Side inputs
    (keyword arguments, see ``Pipeline(side_inputs=...)``) reach each layer whose ``forward``
    takes them by name (or takes ``**kwargs``).
    """

    def forward(self, *inputs: Any, **side: Any) -> Any:
        outputs: Any = None
        for module in self:
            outputs = module(*inputs, **_accepted(module, side)) if side else module(*inputs)
            inputs = as_inputs(outputs)
        return outputs


def _accepted(module: nn.Module, side: dict[str, Any]) -> dict[str, Any]:
    """The side inputs ``module.forward`` takes by name (all of them with ``**kwargs``)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return side
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return side
    names = {
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return {k: v for k, v in side.items() if k in names}


def _normalize_layers(layers: Any) -> tuple[str, list[tuple[Any, Any]]]:
    """``("module", [(name, module)])`` or ``("function", [(fn, params)])``."""
    if isinstance(layers, nn.Sequential):
        if len(layers) == 0:
            raise InvalidArgument("layers is an empty nn.Sequential; partition needs layers.")
        # Not named_children(): it skips a module instance that appears twice (a shared ReLU).
        return "module", [(name, m) for name, m in layers._modules.items() if m is not None]
    if isinstance(layers, nn.Module) or not isinstance(layers, Sequence) or isinstance(layers, str):
        raise InvalidArgument(
            f"layers must be an nn.Sequential, a list of nn.Module, or a list of (fn, params) "
            f"pairs; got layers of type {type(layers).__name__}. Wrap a single module in "
            "nn.Sequential or a list."
        )
    items = list(layers)
    if not items:
        raise InvalidArgument("layers is empty; partition needs at least one layer.")
    kinds = []
    for i, item in enumerate(items):
        if isinstance(item, nn.Module):
            kinds.append("module")
        elif (
            isinstance(item, tuple)
            and len(item) == 2
            and callable(item[0])
            and not isinstance(item[0], nn.Module)
        ):
            check_tensor_tree(item[1], name=f"layers[{i}] params")
            kinds.append("function")
        else:
            raise InvalidArgument(
                f"layers[{i}]={item!r} is neither an nn.Module nor an (fn, params) pair with "
                "fn(params, *inputs); for a module use the module itself."
            )
    if len(set(kinds)) > 1:
        first_fn = kinds.index("function")
        first_mod = kinds.index("module")
        raise InvalidArgument(
            f"layers mixes kinds: layers[{first_mod}] is an nn.Module but layers[{first_fn}] is "
            "an (fn, params) pair. Use one kind: turn modules into pairs with "
            "funcpipe.from_module(module), which returns (stage, params)."
        )
    if kinds[0] == "module":
        return "module", [(str(i), module) for i, module in enumerate(items)]
    return "function", items


def _num_stages(stages: int | None, ranks: int | None, chunks: int) -> int:
    def check_positive(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgument(f"{name} must be an int >= 1; got {name}={value!r}.")
        return value

    if (stages is None) == (ranks is None):
        raise InvalidArgument(
            f"give the number of stages either as stages=N or as ranks=R (with chunks=V, "
            f"N = R * V), exactly one of the two; got stages={stages!r}, ranks={ranks!r}."
        )
    chunks = check_positive("chunks", chunks)
    if stages is not None:
        if chunks != 1:
            raise InvalidArgument(
                f"chunks only applies together with ranks; got stages={stages!r}, "
                f"chunks={chunks!r}. Use ranks={stages}//{chunks} with chunks={chunks}, or "
                "stages alone."
            )
        return check_positive("stages", stages)
    return check_positive("ranks", ranks) * chunks


def _uniform_bounds(n_layers: int, n: int) -> list[tuple[int, int]]:
    q, r = divmod(n_layers, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + q + (1 if i < r else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _min_max_bounds(weights: Sequence[float], n: int) -> list[tuple[int, int]]:
    """Contiguous split into ``n`` non-empty parts minimising the largest part weight.

    Exact dynamic programme, O(n * L^2) at worst. Among the optimal splits, the one minimising the
    largest layer count is chosen (a second exact DP under the optimal weight bound), so that
    weightless layers (activations) spread out instead of piling up at one end.
    """
    n_layers = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def part(i: int, j: int) -> float:
        return prefix[j] - prefix[i]

    def solve(cost: Callable[[int, int], float], limit: float) -> Any:
        """Min over splits of the max part cost, among splits whose parts weigh <= limit.

        Both costs grow as a part's start ``i`` moves left, so scanning ``i`` downwards can
        stop as soon as the part alone is no better than the best found (or too heavy).
        """
        inf = math.inf
        best = [[inf] * (n_layers + 1) for _ in range(n + 1)]
        arg = [[-1] * (n_layers + 1) for _ in range(n + 1)]
        best[0][0] = 0.0
        for k in range(1, n + 1):
            for j in range(k, n_layers - (n - k) + 1):
                for i in range(j - 1, k - 2, -1):
                    here = cost(i, j)
                    if here >= best[k][j] or part(i, j) > limit:
                        break
                    value = max(best[k - 1][i], here)
                    if value < best[k][j]:
                        best[k][j], arg[k][j] = value, i
        return best[n][n_layers], arg

    max_weight, _ = solve(part, math.inf)
    _, arg = solve(lambda i, j: float(j - i), max_weight)
    bounds, j = [], n_layers
    for k in range(n, 0, -1):
        i = arg[k][j]
        bounds.append((i, j))
        j = i
    return bounds[::-1]


def _cut_bounds(cuts: Sequence[Any], n: int, n_layers: int) -> list[tuple[int, int]]:
    cuts = list(cuts)
    if len(cuts) != n - 1:
        raise InvalidArgument(
            f"by=cuts needs N-1 = {n - 1} cut indices for N = {n} stages; got by={cuts!r} "
            f"({len(cuts)} cuts)."
        )
    for c in cuts:
        if isinstance(c, bool) or not isinstance(c, int):
            raise InvalidArgument(f"cut indices must be ints; got by={cuts!r}.")
    points = [0, *cuts, n_layers]
    if any(a >= b for a, b in itertools.pairwise(points)):
        raise InvalidArgument(
            f"cut indices must be strictly increasing and within 1..{n_layers - 1} (every "
            f"stage non-empty) for {n_layers} layers; got by={cuts!r}."
        )
    return list(itertools.pairwise(points))


def _layer_stages(kind: str, items: list[tuple[Any, Any]]) -> list[tuple[Stage, Any]]:
    """One (stage, params) per layer, used for profiling."""
    if kind == "module":
        out = []
        for name, module in items:
            stage, params = from_module(module, name=name)
            # Clone the buffers so profiling never writes into the module's own buffers.
            out.append((stage.map_consts(torch.clone), params))
        return out
    return [(Stage(fn, f"layer {i}"), params) for i, (fn, params) in enumerate(items)]


def _sync(tree: Any) -> None:
    if any(isinstance(t, torch.Tensor) and t.is_cuda for t in tree_leaves(tree)):
        torch.cuda.synchronize()


def _profile(
    kind: str, items: list[tuple[Any, Any]], example: Any, repeats: int = 3
) -> list[float]:
    """Forward time of each layer (min over ``repeats`` runs after one warm-up), in seconds."""
    inputs = as_inputs(example)
    check_tensor_tree(inputs, name="example")
    times = []
    with torch.no_grad():
        for stage, params in _layer_stages(kind, items):
            best = math.inf
            outputs: Any = None
            for r in range(repeats + 1):
                start = time.perf_counter()
                outputs = stage(params, *inputs)
                _sync(outputs)
                if r > 0:
                    best = min(best, time.perf_counter() - start)
            times.append(best)
            inputs = as_inputs(outputs)
    return times


def _count_params(kind: str, item: tuple[Any, Any]) -> float:
    leaves = list(item[1].parameters()) if kind == "module" else tree_leaves(item[1])
    return float(sum(t.numel() for t in leaves))


def _range_name(start: int, stop: int) -> str:
    return f"layer {start}" if stop - start == 1 else f"layers {start}-{stop - 1}"


def partition(
    layers: nn.Sequential | Sequence[nn.Module] | Sequence[tuple[Callable[..., Any], Any]],
    stages: int | None = None,
    *,
    ranks: int | None = None,
    chunks: int = 1,
    by: str | Sequence[int] = "uniform",
    example: Any = None,
) -> Partition:
    """Cut ``layers`` into N contiguous, non-empty stages.

    Args:
        layers: an ``nn.Sequential``, a list of ``nn.Module``, or a list of ``(fn, params)``
            pairs where ``fn(params, *inputs)`` is one layer.
        stages: N, the number of stages. Give either this or ``ranks``.
        ranks: number of pipeline ranks; N = ``ranks * chunks`` (``chunks`` stages per rank).
        by: ``"uniform"`` (layer counts differ by at most one), ``"parameters"`` (minimise the
            largest per-stage parameter count), ``"profile"`` (minimise the largest per-stage
            forward time, measured on ``example``), or N-1 strictly increasing cut indices
            (stage i runs ``layers[cuts[i-1]:cuts[i]]``).
        example: the first stage's inputs for one microbatch (required for ``by="profile"``);
            a tuple is unpacked into positional inputs, anything else is one input.

    Module layers become one ``from_module`` stage per range whose params keep the full model's
    names (``"3.weight"``); function layers become a composed stage with params
    ``{str(layer_index): params_i}``. Within a stage, layers chain with funcpipe's convention.
    """
    kind, items = _normalize_layers(layers)
    n = _num_stages(stages, ranks, chunks)
    n_layers = len(items)
    if n > n_layers:
        given = f"stages={stages}" if stages is not None else f"ranks={ranks} * chunks={chunks}"
        raise InvalidArgument(
            f"{given} asks for {n} stages but layers has only {n_layers} layers; each stage "
            f"needs at least one layer, so use at most {n_layers} stages."
        )
    bounds: list[tuple[int, int]]
    if isinstance(by, str):
        if by == "uniform":
            bounds = _uniform_bounds(n_layers, n)
        elif by == "parameters":
            bounds = _min_max_bounds([_count_params(kind, item) for item in items], n)
        elif by == "profile":
            if example is None:
                raise InvalidArgument(
                    "by='profile' times each layer on example, the first stage's inputs for "
                    "one microbatch; got example=None. Pass example=x."
                )
            bounds = _min_max_bounds(_profile(kind, items, example), n)
        else:
            raise InvalidArgument(
                f"by must be one of {_BY_NAMES} or a sequence of N-1 cut indices; got by={by!r}."
            )
    elif isinstance(by, Sequence):
        bounds = _cut_bounds(by, n, n_layers)
    else:
        raise InvalidArgument(
            f"by must be one of {_BY_NAMES} or a sequence of N-1 cut indices; got by={by!r}."
        )

    out_stages: list[Stage] = []
    out_params: list[Any] = []
    for start, stop in bounds:
        name = _range_name(start, stop)
        if kind == "module":
            chain = _Chain(OrderedDict(items[start:stop]))
            stage, params = from_module(chain, name=name)
        else:
            params = {str(i): items[i][1] for i in range(start, stop)}
            stage = compose(
                [(Stage(items[i][0], f"layer {i}"), str(i)) for i in range(start, stop)],
                name=name,
            )
        out_stages.append(stage)
        out_params.append(params)
    return Partition(tuple(out_stages), tuple(out_params), tuple(bounds))
