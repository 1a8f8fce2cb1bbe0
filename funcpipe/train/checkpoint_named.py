"""A model's state as named pieces: what :func:`funcpipe.train.checkpoint.save_model` writes and
:func:`~funcpipe.train.checkpoint.load_model` puts back together at another stage split,
tensor layout or optimizer-state sharding.

**On disk.** Each held tensor leaf is stored as a plain tensor under
``"<kind>/<name>@<region>"``: ``kind`` is ``params`` or ``opt/<field>`` (``opt/mu``,
``opt/nu``, ``opt/master``, ``opt/momentum``), ``name`` the model's name of the tensor (the
:class:`~funcpipe.train.checkpoint_regions.Naming` says which) and ``region`` the part of the
full tensor the leaf holds (:meth:`Region.text`: ``"0:16,0:16"``, with ``"~a:b"`` for a flat
range). Scalar fields of the optimizer state are stored under ``"opt/<field>"``.
``funcpipe.json`` gets ``"keys": "named"``, ``"tensors"``: ``{"<kind>/<name>": {"shape":
full shape, "dtype": "torch.float32"}}`` gathered from every rank, and ``"scalars"``:
``{"opt/step": "int"}``. The copies several ranks (or two stages of one rank: tied
parameters) hold of one region have one key and are written once.

**Loading.** :func:`plan_load` checks everything against ``funcpipe.json`` and DCP's metadata
before any data is read: every name the templates ask for is there with their full shape and
dtype, and the saved pieces cover each leaf's region. Each rank then reads the pieces that
overlap its leaves (whole pieces: a leaf's bytes are read once even where several leaves
need them) and :meth:`Plan.finish` cuts them to the regions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import optree
import torch
import torch.distributed as dist

from funcpipe.errors import FuncpipeError, InvalidArgument
from funcpipe.train.checkpoint_regions import (
    SCALAR_DTYPES,
    Naming,
    Region,
    assemble,
    coverage,
    path_key,
)

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["NAMED", "Loaded", "Plan", "merge_tables", "named_pieces", "plan_load"]

Tensor = torch.Tensor
NAMED = "named"
_SCALAR_TYPES: dict[str, type] = {t.__name__: t for t in SCALAR_DTYPES}


class Loaded(NamedTuple):
    """What :func:`~funcpipe.train.checkpoint.load_model` returns: the params per stage, the
    optimizer state (``None`` when none was asked for) and the saved ``step``."""

    params: tuple[Any, ...]
    opt_state: Any
    step: int | None


# ------------------------------------------------------------------------------ walking
@dataclass
class _Leaf:
    kind: str  # "params" or "opt/<field>"
    stage: int
    model_name: str  # the naming's name of the tensor
    value: Any
    region: Region | None = None  # None: not held here (a meta tensor)

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.model_name}"


def _stages(params: Any) -> tuple[Any, ...]:
    if isinstance(params, (tuple, list)) and not hasattr(params, "_fields"):
        return tuple(params)
    raise InvalidArgument(
        f"params={type(params).__name__}: the per-stage params, a tuple with one pytree per "
        "stage (None or meta tensors for stages this rank does not hold), as gpt.split or "
        "split_module(...).params give"
    )


def _opt_fields(opt_state: Any) -> list[tuple[str, Any]]:
    if opt_state is None:
        return []
    if isinstance(opt_state, tuple) and hasattr(opt_state, "_fields"):
        return list(zip(opt_state._fields, opt_state, strict=True))
    if isinstance(opt_state, dict) and all(isinstance(k, str) for k in opt_state):
        return list(opt_state.items())
    raise InvalidArgument(
        f"opt_state={type(opt_state).__name__}: the optimizer's state as init(params) returns "
        "it (a NamedTuple such as AdamWState, or a dict of fields)"
    )


class _Walk:
    """Every leaf of params and of the optimizer state's per-stage trees, with its name and
    region, and how to put new leaves back into the same structures."""

    def __init__(self, params: Any, opt_state: Any, naming: Naming | None) -> None:
        self.naming = naming or Naming()
        self.params = _stages(params)
        self.n = len(self.params)
        self.opt_state = opt_state
        self.scalars: dict[str, Any] = {}
        self.trees: dict[str, tuple[Any, list[_Leaf]]] = {}  # kind -> (treespec, leaves)
        self.shapes: dict[tuple[int, str], tuple[int, ...]] = {}
        self._add("params", self.params)
        for name, value in _opt_fields(opt_state):
            kind = f"opt/{name}"
            if value is None:
                continue
            if type(value) in SCALAR_DTYPES:
                self.scalars[kind] = value
            elif isinstance(value, (tuple, list)) and len(value) == self.n:
                self._add(kind, value if isinstance(value, tuple) else tuple(value))  # (Shards)
            else:
                raise InvalidArgument(
                    f"opt_state.{name} is a {type(value).__name__}: a model checkpoint stores "
                    f"int, float and bool fields and trees shaped like params ({self.n} stages)"
                )

    def _add(self, kind: str, stages: Any) -> None:
        leaves: list[Any]
        leaves, spec = optree.tree_flatten(stages, none_is_leaf=False)
        accessors = optree.tree_accessors(stages, none_is_leaf=False)
        out = []
        for acc, value in zip(accessors, leaves, strict=True):
            stage, path = int(acc[0].entry), path_key(acc[1:])
            where = f"{'params' if kind == 'params' else 'opt_state.' + kind[4:]}{acc.codify('')}"
            if not isinstance(value, Tensor):
                raise InvalidArgument(
                    f"{where} is a {type(value).__name__}; model state leaves are tensors"
                )
            leaf = _Leaf(kind, stage, self.naming.name(stage, path), value)
            if kind == "params":
                self.shapes[stage, path] = tuple(value.shape)
            elif (stage, path) not in self.shapes:
                raise InvalidArgument(
                    f"{where} has no param at params[{stage}] {path!r}: the optimizer state's "
                    "trees must mirror params (pass the state init(params) returned)"
                )
            if value.device.type != "meta":
                leaf.region = self.naming.region(
                    stage, path, self.shapes[stage, path], opt=kind != "params"
                )
                if tuple(value.shape) != leaf.region.held_shape:
                    raise InvalidArgument(
                        f"{where} has shape {tuple(value.shape)}, but the naming says it holds "
                        f"{leaf.region!r} (shape {leaf.region.held_shape}); the naming must be "
                        "this run's (its shardings, place and opt_shard)"
                    )
            out.append(leaf)
        self.trees[kind] = (spec, out)

    def held(self) -> list[tuple[_Leaf, Region]]:
        """The leaves this rank holds, each with its region of the full tensor."""
        return [
            (leaf, leaf.region)
            for _, leaves in self.trees.values()
            for leaf in leaves
            if leaf.region is not None
        ]

    def rebuild(self, values: dict[int, Tensor], scalars: dict[str, Any]) -> tuple[Any, Any]:
        """New (params, opt_state) with the leaves in ``values`` (by ``id`` of the _Leaf)
        replaced and the scalar fields from ``scalars``."""
        trees = {
            kind: optree.tree_unflatten(spec, [values.get(id(lf), lf.value) for lf in leaves])
            for kind, (spec, leaves) in self.trees.items()
        }
        if self.opt_state is None:
            return trees["params"], None
        fields = {}
        for name, value in _opt_fields(self.opt_state):
            kind = f"opt/{name}"
            fields[name] = trees.get(kind, scalars.get(kind, value))
            if kind in trees and isinstance(value, list):
                fields[name] = list(fields[name])
        if isinstance(self.opt_state, dict):
            return trees["params"], fields
        return trees["params"], type(self.opt_state)(**fields)


# ------------------------------------------------------------------------------- saving
def named_pieces(
    params: Any, opt_state: Any, naming: Naming | None
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The tensors :func:`save_model` writes, by key, and this rank's ``funcpipe.json`` table."""
    if naming is not None and not isinstance(naming, Naming):
        raise InvalidArgument(
            f"naming={naming!r}: a funcpipe.train.checkpoint.Naming (or None: every leaf whole, "
            "named by its path inside its stage)"
        )
    walk = _Walk(params, opt_state, naming)
    tensors: dict[str, Tensor] = {}
    table: dict[str, dict[str, Any]] = {}
    for leaf, region in walk.held():
        entry = {"shape": list(region.shape), "dtype": str(leaf.value.dtype)}
        if table.setdefault(leaf.name, entry) != entry:
            raise InvalidArgument(
                f"two leaves are named {leaf.name!r} but are {table[leaf.name]} and {entry}; "
                "the naming's names must give each model tensor one name"
            )
        key = f"{leaf.name}@{region.text()}"
        value = leaf.value.detach()
        if key in tensors and not torch.equal(tensors[key], value):
            raise InvalidArgument(
                f"two leaves of this rank hold {key!r} with different values (stage "
                f"{leaf.stage} among them): copies of one tensor (tied parameters) must be "
                "equal when saved"
            )
        tensors[key] = value
    scalars = {}
    for kind, value in walk.scalars.items():
        if type(value) is int and not -(2**63) <= value < 2**63:
            raise InvalidArgument(f"opt_state {kind!r}={value!r}: ints must fit in 64 bits")
        tensors[kind] = torch.tensor(value, dtype=SCALAR_DTYPES[type(value)])
        scalars[kind] = type(value).__name__
    return tensors, {"tensors": table, "scalars": scalars}


def merge_tables(table: dict[str, Any], group: ProcessGroup | None, on: bool) -> dict[str, Any]:
    """Every rank's table merged (the same on every rank); a name two ranks give different
    full shapes or dtypes raises InvalidArgument on every rank."""
    every: list[Any] = [table]
    if on:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, table, group=group)
    out: dict[str, dict[str, Any]] = {"tensors": {}, "scalars": {}}
    for rank, part in enumerate(every):
        for section in ("tensors", "scalars"):
            for k, v in sorted(part[section].items()):
                if out[section].setdefault(k, v) != v:
                    raise InvalidArgument(
                        f"not saved: rank {rank} holds {k!r} as {v}, another rank as "
                        f"{out[section][k]}; every rank's naming must describe the same model"
                    )
    return {k: dict(sorted(v.items())) for k, v in out.items()}


# ------------------------------------------------------------------------------ loading
@dataclass
class Plan:
    """What one rank reads (``wanted``: key -> empty tensor, filled by DCP) and how the
    leaves are cut from it."""

    walk: _Walk
    wanted: dict[str, Tensor] = field(default_factory=dict)
    jobs: list[tuple[_Leaf, Region, list[tuple[Region, str]]]] = field(default_factory=list)
    scalars: dict[str, str] = field(default_factory=dict)

    def finish(self, step: Any) -> Loaded:
        values = {}
        for leaf, region, pieces in self.jobs:
            if len(pieces) == 1 and pieces[0][0] == region:  # stored as held: no copy
                got = self.wanted[pieces[0][1]]
            else:
                got = assemble(region, [(r, self.wanted[k]) for r, k in pieces])
            values[id(leaf)] = got.to(device=leaf.value.device, dtype=leaf.value.dtype)
        scalars = {
            kind: _SCALAR_TYPES[kind_type](self.wanted[kind].item())
            for kind, kind_type in self.scalars.items()
        }
        params, opt_state = self.walk.rebuild(values, scalars)
        return Loaded(params, opt_state, step if isinstance(step, int) else None)


def _stored_pieces(source: str, metadata: Any, table: dict[str, Any]) -> dict[str, list[Any]]:
    """``{"<kind>/<name>": [(Region, key), ...]}`` of the pieces DCP's metadata lists."""
    out: dict[str, list[Any]] = {}
    for key in metadata.state_dict_metadata:
        name, at, text = key.rpartition("@")
        if not at:
            continue
        try:
            region = Region.parse(text, table[name]["shape"])
        except (KeyError, ValueError, TypeError) as e:
            raise InvalidArgument(
                f"the checkpoint {source!r} lists the piece {key!r}, which its funcpipe.json "
                f"does not describe ({e!r}); it was not written by save_model"
            ) from None
        out.setdefault(name, []).append((region, key))
    return out


def _tables(source: str, info: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """funcpipe.json's tables of a named checkpoint, checked (it is read before any tensor)."""
    table: Any = info.get("tensors")
    scalars: Any = info.get("scalars")
    ok = isinstance(table, dict) and isinstance(scalars, dict)
    ok = ok and all(
        isinstance(v, dict)
        and isinstance(v.get("shape"), list)
        and all(type(n) is int and n >= 0 for n in v["shape"])
        and isinstance(v.get("dtype"), str)
        for v in table.values()
    )
    ok = ok and all(v in _SCALAR_TYPES for v in scalars.values())
    if not ok:
        raise FuncpipeError(
            f"the checkpoint {source!r} is damaged: its funcpipe.json has no valid 'tensors' "
            "and 'scalars' tables (full shapes, dtypes, scalar types). Load an earlier "
            "checkpoint (funcpipe.train.checkpoint.latest)"
        )
    return table, scalars


def plan_load(
    source: str,
    info: dict[str, Any],
    metadata: Any,
    params: Any,
    opt_state: Any,
    naming: Naming | None,
) -> Plan:
    """Check this rank's templates against the checkpoint and plan what it reads."""
    walk = _Walk(params, opt_state, naming)
    table, scalars = _tables(source, info)
    stored = _stored_pieces(source, metadata, table)
    plan = Plan(walk)
    missing: list[str] = []
    wrong: list[str] = []
    for leaf, held in walk.held():
        saved = table.get(leaf.name)
        if saved is None:
            missing.append(leaf.name)
            continue
        if tuple(saved["shape"]) != held.shape or saved["dtype"] != str(leaf.value.dtype):
            wrong.append(
                f"{leaf.name!r} was saved as {saved['dtype']} of full shape "
                f"{tuple(saved['shape'])}, this run has {leaf.value.dtype} of full shape "
                f"{held.shape}"
            )
            continue
        pieces = stored.get(leaf.name, [])
        short, used = coverage(held, [r for r, _ in pieces])
        if short:
            wrong.append(
                f"{leaf.name!r}: {short} element(s) of the region {held.text()} this "
                "rank holds are in no saved piece (the save did not write every shard)"
            )
            continue
        chosen = [pieces[k] for k in used]
        dtype = leaf.value.dtype
        for region, key in chosen:
            plan.wanted.setdefault(key, torch.empty(region.held_shape, dtype=dtype))
        plan.jobs.append((leaf, held, chosen))
    for kind, value in walk.scalars.items():
        if kind not in scalars:
            missing.append(kind)
            continue
        plan.scalars[kind] = type(value).__name__
        plan.wanted[kind] = torch.empty((), dtype=SCALAR_DTYPES[_SCALAR_TYPES[scalars[kind]]])
    _raise_mismatch(source, table, missing, wrong)
    return plan


def _raise_mismatch(
    source: str, table: dict[str, Any], missing: list[str], wrong: list[str]
) -> None:
    if not missing and not wrong:
        return
    parts = []
    if missing:
        have = sorted(table, key=lambda k: (not k.startswith("params/"), k))
        parts.append(
            f"it has no {', '.join(repr(m) for m in missing[:6])}"
            f"{' ...' if len(missing) > 6 else ''} ({len(missing)} asked for; it holds "
            f"{len(have)} tensors: {have[:6]}{' ...' if len(have) > 6 else ''}): another "
            "model's checkpoint, names that differ (Naming(names=...)), or an optimizer state "
            "of another kind"
        )
    if wrong:
        parts.append(
            "; ".join(wrong[:4]) + (f" ... ({len(wrong)} in all)" if len(wrong) > 4 else "")
        )
    raise InvalidArgument(
        f"the checkpoint {source!r} does not fit this model: {'. '.join(parts)}. Nothing was "
        "read; load it into params (and opt_state) of the model it was saved from."
    )
