"""Cut any ``nn.Module`` into pipeline stages at named submodules, keeping its parameter names.

``split_module(model, ["model.layers.2"], example={"input_ids": ids})`` traces ``model``'s forward
with ``torch.export`` (non-strict) on one example microbatch, cuts the traced graph where the
named submodules are first called, and returns a :class:`ModuleSplit`: pure stages, one params
dict per stage keyed by the module's own ``state_dict`` names, the ties found from shared
storage, and the side inputs each stage reads. The forward need not be a plain sequence: what one
stage computes and a later one uses (a mask, rotary cos/sin, a residual) is passed on.

The stages are specialised to the example's shapes and dtypes (``torch.export``'s default):
run them on microbatches shaped like the example, or pass ``dynamic_shapes``. Each stage checks
its inputs against the traced ones and refuses others (:mod:`funcpipe.stages.split_inputs`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, fx, nn

from funcpipe.errors import InvalidArgument
from funcpipe.stages.keyed_ops import keyed_ops
from funcpipe.stages.split_balance import balanced_points, check_count, stage_count
from funcpipe.stages.split_errors import near_names, quiet_export, untraceable, written_buffers
from funcpipe.stages.split_inputs import (
    InputCheck,
    InputSpec,
    dim_names,
    param_problem,
    size_source,
)
from funcpipe.stages.stage import ConstFn, Stage
from funcpipe.stages.ties import find_ties

__all__ = ["ModuleSplit", "split_module"]

Points = Sequence[str] | Callable[[str, nn.Module], bool] | int


class ModuleSplit(NamedTuple):
    """What :func:`split_module` returns.

    ``stages[i]`` runs with ``params[i]`` (``{state_dict name: tensor}``, detached aliases of the
    module's parameters). ``ties`` (``{name: [(stage, name), ...]}``) and ``side_inputs``
    (``{stage: [forward argument, ...]}``) go to ``Pipeline(ties=..., side_inputs=...)`` as they
    are; ``points`` are the submodule names where stages 1.. begin.
    """

    stages: tuple[Stage, ...]
    params: tuple[dict[str, Tensor], ...]
    ties: dict[str, list[tuple[int, Any]]]
    side_inputs: dict[int, list[str]]
    points: tuple[str, ...]
    inputs: tuple[str, ...]

    def batch(self, fields: Mapping[str, Any]) -> Any:
        """The pipeline's batch from ``fields`` (the forward's keyword arguments, whole batch):
        the first stage's input alone, a tuple of them, or with side inputs the dict
        ``{"inputs": ..., side input: ...}`` that ``Pipeline`` takes."""
        missing = [k for k in (*self.inputs, *self.side_names()) if k not in fields]
        if missing:
            raise InvalidArgument(
                f"batch fields {sorted(fields)!r} lack {missing!r}, which the stages read."
            )
        entry = (
            fields[self.inputs[0]]
            if len(self.inputs) == 1
            else tuple(fields[k] for k in self.inputs)
        )
        if not self.side_inputs:
            return entry
        return {"inputs": entry, **{k: fields[k] for k in self.side_names()}}

    def side_names(self) -> list[str]:
        """Every side input some stage reads, in order of first use."""
        return list(dict.fromkeys(k for names in self.side_inputs.values() for k in names))

    def __repr__(self) -> str:
        counts = ", ".join(str(len(p)) for p in self.params)
        return (
            f"ModuleSplit({len(self.stages)} stages at {list(self.points)!r}, params per stage: "
            f"({counts}), inputs={list(self.inputs)!r}, side_inputs={self.side_inputs!r}, "
            f"ties={self.ties!r})"
        )


class _GraphStage:
    """``(params, *carried, **side) -> outputs``: one slice of the traced graph.

    The slice's placeholders are, in order: parameters (by name, from ``params``), constants
    (buffers, captured here), the positional inputs, the side inputs (by name). ``check``
    refuses inputs other than the traced ones before the graph runs.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        param_names: Sequence[str],
        consts: Mapping[str, Tensor],
        n_inputs: int,
        side_names: Sequence[str],
        out_spec: Any,
        label: str,
        check: InputCheck,
        param_specs: Sequence[tuple[torch.Size, torch.dtype]] = (),
    ) -> None:
        self.gm = gm
        self.param_names = tuple(param_names)
        self.consts = dict(consts)
        self.n_inputs = n_inputs
        self.side_names = tuple(side_names)
        self.out_spec = out_spec  # None: a tuple of carried values; else the forward's output
        self.label = label
        self.check = check
        self.param_specs = tuple(param_specs)  # as traced: (shape, dtype) per param_names

    def __call__(self, params: Any, *inputs: Any, **side: Any) -> Any:
        if not isinstance(params, Mapping):
            raise InvalidArgument(
                f"stage {self.label} takes params as a dict of state_dict name -> tensor; got "
                f"params of type {type(params).__name__}. Pass the dict from split_module(...)."
            )
        missing = [n for n in self.param_names if n not in params]
        if missing or len(inputs) != self.n_inputs or set(side) != set(self.side_names):
            raise InvalidArgument(
                f"stage {self.label} takes params {list(self.param_names)!r} (missing: "
                f"{missing!r}), {self.n_inputs} positional inputs (got {len(inputs)}) and side "
                f"inputs {list(self.side_names)!r} (got {sorted(side)!r}). Run it with the "
                "params, ties and side_inputs split_module returned."
            )
        given = (*inputs, *(side[n] for n in self.side_names))
        self.check(given)
        held = [params[n] for n in self.param_names]
        for t, (shape, dtype) in zip(held, self.param_specs, strict=False):
            if not isinstance(t, Tensor) or t.shape != shape or t.dtype != dtype:
                problem = param_problem(self.label, self.param_names, self.param_specs, held)
                if problem is not None:
                    raise InvalidArgument(problem)
                break
        args = [*held, *self.consts.values(), *given]
        flat = self.gm(*args)
        if self.out_spec is None:
            return tuple(flat)
        out = torch.utils._pytree.tree_unflatten(list(flat), self.out_spec)
        if isinstance(out, Mapping):  # a transformers ModelOutput: a plain dict of its fields
            return {k: v for k, v in out.items() if v is not None}
        return out

    def map_consts(self, f: ConstFn) -> _GraphStage:
        consts = {k: f(v) for k, v in self.consts.items()}
        return _GraphStage(
            self.gm,
            self.param_names,
            consts,
            self.n_inputs,
            self.side_names,
            self.out_spec,
            self.label,
            self.check,
            self.param_specs,
        )

    def __repr__(self) -> str:
        return f"graph({self.label}, {len(self.param_names)} params)"


def _resolve_points(module: nn.Module, points: Points) -> list[str]:
    names = dict(module.named_modules())
    if callable(points):
        return [n for n, m in names.items() if n and points(n, m)]
    if isinstance(points, str) or not isinstance(points, Sequence):
        raise InvalidArgument(
            f"points must be a list of submodule names, a callable (name, module) -> bool or a "
            f"number of stages; got points={points!r}."
        )
    for p in points:
        if p not in names or not p:
            near = near_names(str(p), names)
            raise InvalidArgument(
                f"points names {p!r}, which is not a submodule of {type(module).__name__}"
                + (f" (did you mean {near}?)" if near else "")
                + "; use names from module.named_modules()."
            )
    return list(points)


def _export(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], dynamic: Any) -> Any:
    try:
        with quiet_export():
            return torch.export.export(module, args, kwargs, strict=False, dynamic_shapes=dynamic)
    except Exception as e:
        raise untraceable(module, e, dynamic) from e


def _starts(graph: fx.Graph, points: Sequence[str]) -> list[tuple[int, str]]:
    """For each point, the index of the first graph node run inside that submodule."""
    nodes = list(graph.nodes)
    found: dict[str, int] = {}
    for i, node in enumerate(nodes):
        if node.op != "call_function":
            continue
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            for p in points:
                if p not in found and (path == p or path.startswith(p + ".")):
                    found[p] = i
    never = [p for p in points if p not in found]
    if never:
        raise InvalidArgument(
            f"points {never!r} name submodules that the forward never calls on this example; cut "
            "before modules that run."
        )
    starts = sorted((i, p) for p, i in found.items())
    if len({i for i, _ in starts}) != len(starts):
        raise InvalidArgument(
            f"points {list(points)!r} include two that begin at the same place (one holds the "
            "other); name each cut once."
        )
    return starts


def _alias(
    node: fx.Node, target: str, members: Sequence[fx.Node], named: Mapping[str, Tensor]
) -> str:
    """The name a stage knows a parameter by: among the names of that one tensor (a tied
    parameter has several), the one whose module the stage's uses of it run in."""
    aliases = [n for n, q in named.items() if q is named[target]]
    if len(aliases) == 1:
        return target
    paths: set[str] = set()
    for user in node.users:
        if user in members:
            paths |= {path for path, _ in (user.meta.get("nn_module_stack") or {}).values()}
    for name in aliases:
        if name.rpartition(".")[0] in paths:
            return name
    return target


def _holders(
    kind: Mapping[fx.Node, tuple[str, str]],
    stage_of: Mapping[fx.Node, int],
    named: Mapping[str, Tensor],
) -> dict[fx.Node, dict[str, set[int]]]:
    """For each parameter with several names (a tie), the stages that hold each name: those
    whose part of the graph runs in the module the name belongs to; a name whose module never
    runs (T5's ``shared.weight``) goes to the first stage using the parameter."""
    out: dict[fx.Node, dict[str, set[int]]] = {}
    for p in [n for n, (k, _) in kind.items() if k == "param"]:
        aliases = [n for n, q in named.items() if q is named[kind[p][1]]]
        users = [u for u in p.users if u in stage_of]
        if len(aliases) < 2 or not users:
            continue
        paths = [
            (stage_of[u], {path for path, _ in (u.meta.get("nn_module_stack") or {}).values()})
            for u in users
        ]
        first = min(s for s, _ in paths)
        out[p] = {
            a: {s for s, ps in paths if a.rpartition(".")[0] in ps} or {first} for a in aliases
        }
    return out


def _written_inputs(ep: Any) -> list[str]:
    """Buffers and inputs an op of the graph writes in place (BatchNorm's running stats in the
    training IR, which keeps such writes in the graph instead of returning them)."""
    targets = {s.arg.name: s.target or s.arg.name for s in ep.graph_signature.input_specs}
    written: list[str] = []
    for node in ep.graph_module.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if isinstance(value, fx.Node) and value.op == "placeholder":
                name = targets.get(value.name, value.name)
                if name not in written:
                    written.append(name)
        if node.target is torch.ops.aten.batch_norm.default and node.args[5]:
            # training mode: updates the running stats (args 3 and 4) in place
            written += [
                targets.get(a.name, a.name) for a in node.args[3:5] if isinstance(a, fx.Node)
            ]
    return written


def split_module(
    module: nn.Module,
    points: Points,
    *,
    example: Any,
    inputs: Sequence[str] | None = None,
    dynamic_shapes: Any = None,
) -> ModuleSplit:
    """Cut ``module`` into stages that begin where each of ``points`` is first called.

    Args:
        module: any ``nn.Module``; it is traced, never modified. Put it in the dtype, device and
            mode it trains in first (dropout may stay on: each stage call runs under its random
            key, :mod:`funcpipe.stages.keys`; BatchNorm in training mode is refused).
        points: submodule names (``["model.layers.2"]``: stage 1 begins where that block is
            first called), a callable ``(name, submodule) -> bool`` choosing them, or a number
            of stages ``n``: cut before ``n - 1`` blocks of the runs of repeated blocks (every
            ``nn.ModuleList`` or ``nn.Sequential`` of one block type) so that the largest
            stage's parameter count is the least it can be
            (:mod:`funcpipe.stages.split_balance`).
        example: one microbatch: a dict of ``forward`` keyword arguments, or a tensor / tuple of
            positional arguments. The stages are specialised to its shapes.
        inputs: the keys of ``example`` the first stage takes positionally, in order (default:
            the first key). Every other key is a side input: a batch field passed to each stage
            that reads it (``side_inputs``).
        dynamic_shapes: passed to ``torch.export.export``: the dims it names may vary (within
            the range the trace holds); every other dim, and every dtype, is the example's. Each
            stage refuses inputs other than the traced ones.

    Returns:
        a :class:`ModuleSplit`. Its ``params`` map 1:1 onto ``module.state_dict()``'s parameter
        names (each stage holds those it uses; a shared parameter used in two stages is in
        both, and listed in ``ties``). Values one stage passes to the next that do not depend on
        parameters or differentiable inputs (masks, rotary cos/sin) need no gradient and the
        pipeline sends none back.
    """
    if not isinstance(module, nn.Module):
        raise InvalidArgument(
            f"split_module needs an nn.Module; got module of type {type(module).__name__}."
        )
    count = stage_count(points)
    cut_at = [] if count is not None else _resolve_points(module, points)
    if isinstance(example, Mapping):
        kwargs = dict(example)
        if not kwargs:
            raise InvalidArgument("example is an empty dict; give the forward's inputs.")
        entry = tuple(inputs) if inputs is not None else (next(iter(kwargs)),)
        bad = [k for k in entry if k not in kwargs]
        if bad:
            raise InvalidArgument(
                f"inputs={list(entry)!r} names {bad!r}, not keys of example ({sorted(kwargs)!r})."
            )
        args: tuple[Any, ...] = ()
    else:
        if inputs is not None:
            raise InvalidArgument(
                "inputs= names keys of a dict example; with positional example arguments every "
                "one is an input of the first stage."
            )
        args = example if type(example) is tuple else (example,)
        kwargs, entry = {}, ()
    if count is not None:
        check_count(module, count)  # (before the export, which may take minutes)
    ep = _export(module, args, kwargs, dynamic_shapes)
    if count is not None:
        cut_at = balanced_points(module, ep, count)
    return _cut(module, ep, cut_at, entry, bool(kwargs), dynamic_shapes)


def _cut(
    module: nn.Module,
    ep: Any,
    cut_at: Sequence[str],
    entry: Sequence[str],
    by_name: bool,
    dynamic_shapes: Any = None,
) -> ModuleSplit:
    _check_pure(module, ep)
    graph: fx.Graph = ep.graph_module.graph
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    named_params = dict(module.named_parameters(remove_duplicate=False))
    consts_all: dict[str, Tensor] = {**dict(module.named_buffers(remove_duplicate=False))}
    consts_all.update(getattr(ep, "constants", {}))
    kind, user_inputs = _kinds(placeholders, ep.graph_signature.input_specs)
    entry_nodes = (
        [next(n for n in user_inputs if n.name == k) for k in entry] if by_name else user_inputs
    )
    starts = _starts(graph, cut_at)
    n_stages = len(starts) + 1
    stage_of: dict[fx.Node, int] = {}
    bounds = [i for i, _ in starts]
    k = 0
    for i, node in enumerate(nodes):
        while k < len(bounds) and i >= bounds[k]:
            k += 1
        if node.op in ("call_function", "call_method", "call_module", "get_attr"):
            src = node.args[0] if node.target is operator.getitem and node.args else None
            stage_of[node] = stage_of.get(src, k) if isinstance(src, fx.Node) else k
    for node in entry_nodes:
        stage_of[node] = 0  # the batch enters at the first stage and is carried from there
    output = next(n for n in nodes if n.op == "output")
    outs = list(output.args[0])
    carried = _carried(nodes, stage_of, outs, [name for _, name in starts])
    holders = _holders(kind, stage_of, named_params)  # the names of each tied parameter

    # a symbolic size (dynamic_shapes) is not sent: the stage reads it from one of its inputs
    sent = [[v for v in vals if isinstance(v.meta.get("val"), Tensor)] for vals in carried]
    ranges = dict(getattr(ep, "range_constraints", None) or {})
    dims = dim_names(dynamic_shapes, {n.name: n.meta.get("val") for n in user_inputs})
    first_input = kind[entry_nodes[0]][1] if entry_nodes else "x"
    stages: list[Stage] = []
    params: list[dict[str, Tensor]] = []
    side_inputs: dict[int, list[str]] = {}
    for s in range(n_stages):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        members = [n for n in nodes if stage_of.get(n) == s and n.op != "placeholder"]
        used = {u for n in members for u in n.all_input_nodes}
        if s == n_stages - 1:
            used |= {v for v in outs if isinstance(v, fx.Node)}
        p_nodes = [n for n in placeholders if n in used and kind[n][0] == "param"]
        c_nodes = [n for n in placeholders if n in used and kind[n][0] == "const"]
        in_nodes = entry_nodes if s == 0 else sent[s - 1]
        side_nodes = [
            n for n in placeholders if n in used and kind[n][0] == "input" and n not in entry_nodes
        ]
        for n in [*p_nodes, *c_nodes, *in_nodes, *side_nodes]:
            env[n] = g.placeholder(n.name)
            env[n].meta = dict(n.meta)
        label = f"{s}" if s == 0 else f"{s} from {starts[s - 1][1]}"
        if s > 0:
            sizes = [v for v in carried[s - 1] if v in used and v not in sent[s - 1]]
            _read_sizes(g, env, sizes, [*in_nodes, *side_nodes], label, dims)
        for n in members:
            env[n] = g.node_copy(n, env.__getitem__)
            keyed = keyed_ops().get(env[n].target)
            if keyed is not None:  # drawn in a keyed call only (training)
                env[n].target = keyed
        if s < n_stages - 1:
            g.output(tuple(env[v] for v in sent[s]))
            out_spec = None
        else:
            g.output(tuple(env[v] if isinstance(v, fx.Node) else v for v in outs))
            out_spec = ep.call_spec.out_spec
        gm = fx.GraphModule(ep.graph_module, g)
        names = [_alias(n, kind[n][1], members, named_params) for n in p_nodes]
        held = [a for n in p_nodes for a in holders.get(n, {}) if s in holders[n][a]]
        stage_params = {n: named_params[n].detach() for n in [*names, *held]}
        consts = {kind[n][1]: consts_all[kind[n][1]].detach() for n in c_nodes}
        sides = [kind[n][1] for n in side_nodes]
        if sides:
            side_inputs[s] = sides
        whats = [
            f"input {kind[n][1]!r}" if s == 0 else f"input #{i} (passed on by stage {s - 1})"
            for i, n in enumerate(in_nodes)
        ] + [f"side input {name!r}" for name in sides]
        specs = [
            InputSpec.of(w, n.meta.get("val"))
            for w, n in zip(whats, [*in_nodes, *side_nodes], strict=True)
        ]
        check = InputCheck(label, specs, ranges, dims, first_input)
        traced = [n.meta["val"] for n in p_nodes]
        pspecs = [(torch.Size(v.shape), v.dtype) for v in traced]
        fn = _GraphStage(gm, names, consts, len(in_nodes), sides, out_spec, label, check, pspecs)
        stages.append(Stage(fn, f"stage {label}"))
        params.append(stage_params)
    return ModuleSplit(
        tuple(stages),
        tuple(params),
        find_ties(params),
        side_inputs,
        tuple(p for _, p in starts),
        tuple(kind[n][1] for n in entry_nodes),
    )


def _kinds(
    placeholders: Sequence[fx.Node], specs: Sequence[Any]
) -> tuple[dict[fx.Node, tuple[str, str]], list[fx.Node]]:
    """Each traced placeholder's kind and name (``param``, ``const`` or ``input``), and the
    user inputs in order."""
    from torch.export.graph_signature import InputKind

    kind: dict[fx.Node, tuple[str, str]] = {}
    user_inputs: list[fx.Node] = []
    for node, spec in zip(placeholders, specs, strict=True):
        if spec.kind == InputKind.PARAMETER:
            kind[node] = ("param", spec.target)
        elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            kind[node] = ("const", spec.target)
        elif spec.kind == InputKind.USER_INPUT:
            kind[node] = ("input", node.name)
            user_inputs.append(node)
        else:
            raise InvalidArgument(f"split_module cannot handle a traced input of kind {spec.kind}.")
    return kind, user_inputs


def _read_sizes(
    g: fx.Graph,
    env: dict[fx.Node, fx.Node],
    sizes: Sequence[fx.Node],
    inputs: Sequence[fx.Node],
    label: str,
    dims: Mapping[Any, str],
) -> None:
    """Symbolic sizes made before stage ``label``'s cut and read in it: read each from the dim
    of one of the stage's ``inputs`` that has that size (only tensors cross stages)."""
    for v in sizes:
        val = v.meta["val"]  # a torch.SymInt (only those are carried without being sent)
        found = size_source(val, [(n, n.meta.get("val")) for n in inputs])
        if found is None:
            raise InvalidArgument(
                f"the size {v.name!r} ({dims.get(val.node.expr, val)}, a dim that dynamic_shapes= "
                "made symbolic) is made "
                f"before stage {label} and read in it, but only tensors cross stages and no "
                "tensor the stage takes has a dim of that size to read it from. Move the cut "
                "point to where a tensor with that dim crosses, or make that dim static (leave "
                "it out of dynamic_shapes=)."
            )
        node, d = found
        env[v] = g.call_function(torch.ops.aten.sym_size.int, (env[node], d))
        env[v].meta["val"] = val


def _check_pure(module: nn.Module, ep: Any) -> None:
    """Refuse a forward that writes a buffer or an input (a stage is a pure function)."""
    from torch.export.graph_signature import OutputKind

    mutated = [
        s.target for s in ep.graph_signature.output_specs if s.kind != OutputKind.USER_OUTPUT
    ]
    mutated += [n for n in _written_inputs(ep) if n not in mutated]  # in-place, in the graph
    if mutated:
        raise InvalidArgument(written_buffers(module, mutated))


def _carried(
    nodes: Sequence[fx.Node],
    stage_of: Mapping[fx.Node, int],
    outs: Sequence[Any],
    cuts: Sequence[str],
) -> list[list[fx.Node]]:
    """``carried[s]``: the values stage ``s`` passes to stage ``s + 1`` (those made at or before
    ``s`` and used after it; ``cuts[s]`` is the cut point that starts stage ``s + 1``). Only
    tensors can cross stages."""
    n_stages = len(cuts) + 1
    # where each value is used: a later stage's use means it is carried up to there
    last_use: dict[fx.Node, int] = {}
    for node in nodes:
        if node.op == "output":
            for v in outs:
                if isinstance(v, fx.Node):
                    last_use[v] = max(last_use.get(v, -1), n_stages - 1)
            continue
        if node not in stage_of:
            continue
        for u in node.all_input_nodes:
            last_use[u] = max(last_use.get(u, -1), stage_of[node])
    carried: list[list[fx.Node]] = []  # carried[s]: what stage s passes to stage s + 1
    for s in range(n_stages - 1):
        carried.append(
            [n for n in nodes if n in stage_of and stage_of[n] <= s and last_use.get(n, -1) > s]
        )
    for s, vals in enumerate(carried):
        for v in vals:
            val = v.meta.get("val")
            if not isinstance(val, Tensor | torch.SymInt):  # a SymInt is read, not sent
                raise InvalidArgument(
                    f"the value {v.name!r} ({type(val).__name__}) crosses from stage {s} to stage "
                    f"{s + 1} but only tensors can cross stages; move the cut point "
                    f"{cuts[s]!r} so that it is not used across the cut."
                )
    return carried
