"""Sharding specs: the derivation rules (pure), errors that quote the pattern and shapes, the
cache, and random specs against einsum on one device (gloo)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from funcpipe.errors import InvalidArgument
from funcpipe.parallel import Sharding, shard_spec
from tests import jobs_parallel as J
from tests.parallel.strategies import divisors, scaled


def rows(spec: Any) -> list[tuple[str, str, str, str]]:
    return [(r.operand, r.mesh_axis, r.forward, r.backward) for r in spec.collectives.rows]


# ------------------------------------------------------------------------------ derivation rules
def test_replicated_input_of_a_split_op_is_copied_to_the_group() -> None:
    spec = shard_spec("b s d, (h k) d -> b s (h k)", {"h": "tensor"})
    assert rows(spec) == [
        ("in0", "tensor", "identity", "all_reduce"),
        ("in1", "tensor", "-", "-"),
        ("out", "tensor", "-", "-"),
    ]
    assert spec.input_sharding(1) == Sharding.of("tensor", None)
    assert spec.output_sharding == Sharding.of(None, None, "tensor")


def test_partial_sum_resolutions() -> None:
    pattern = "b s (h k), d (h k) -> b s d"
    ar = shard_spec(pattern, {"h": "tensor"}, reduce="all_reduce")
    assert rows(ar)[-1] == ("out", "tensor", "all_reduce", "identity")
    assert ar.output_sharding == Sharding.of(None, None, None)
    rs = shard_spec(pattern, {"h": "tensor"}, reduce="reduce_scatter", scatter="s")
    assert rows(rs)[-1] == (
        "out",
        "tensor",
        "reduce_scatter on s (dim 1)",
        "all_gather on s (dim 1)",
    )
    assert rs.output_sharding == Sharding.of(None, "tensor", None)
    keep = shard_spec(pattern, {"h": "tensor"}, reduce="partial")
    assert rows(keep)[-1] == ("out", "tensor", "-", "-")
    assert keep.output_sharding == Sharding.of(None, None, None, partial=("tensor",))


def test_the_old_names_give_the_same_values() -> None:
    """``spec.plan``, ``input_layout``, ``output_layout``, ``Plan`` and ``PlanRow``: old names."""
    from funcpipe.parallel import CollectiveRow, Collectives, Plan, PlanRow, spec

    sp = shard_spec("b s i, o i -> b s o", {"o": "tensor"}, in_shards={0: {"s": "tensor"}})
    assert sp.plan == sp.collectives and str(sp.plan) == str(sp.collectives)
    assert sp.input_layout(0) == sp.input_sharding(0)
    assert sp.output_layout == sp.output_sharding
    assert Plan is spec.Plan is Collectives and PlanRow is spec.PlanRow is CollectiveRow


def test_input_sharding_conversions() -> None:
    sp = shard_spec("b s i, o i -> b s o", {"o": "tensor"}, in_shards={0: {"s": "tensor"}})
    assert rows(sp)[0] == (
        "in0",
        "tensor",
        "all_gather on s (dim 1)",
        "reduce_scatter on s (dim 1)",
    )
    assert sp.input_sharding(0) == Sharding.of(None, "tensor", None)
    split = shard_spec("b i, o i -> b o", {"o": "tensor"}, in_shards={1: {}})
    assert rows(split)[1] == ("in1", "tensor", "take shard on o (dim 0)", "all_gather on o (dim 0)")
    other = shard_spec("b i, o i -> b o", {"o": "tensor"}, in_shards={0: {"b": "data"}})
    assert ("in0", "data", "all_gather on b (dim 0)", "take shard on b (dim 0)") in rows(other)
    gathered = shard_spec("... i, o i -> ... o", {"o": "tensor"}, gather_output=True)
    assert rows(gathered)[-1] == (
        "out",
        "tensor",
        "all_gather on o (dim -1)",
        "take shard on o (dim -1)",
    )


def test_parse_is_cached() -> None:
    a = shard_spec("b d, d f -> b f", {"f": "tensor"})
    assert shard_spec("b d, d f -> b f", {"f": "tensor"}) is a
    a.check_shapes((2, 4), (4, 8), mesh_sizes={"tensor": 2})
    a.check_shapes((2, 4), (4, 8), mesh_sizes={"tensor": 2})
    assert len(a._shape_cache) == 1
    assert repr(a) == "shard_spec('b d, d f -> b f', {'f': 'tensor'})"


def test_check_shapes_gives_local_shapes() -> None:
    spec = shard_spec(
        "b s (h k), d (h k) -> b s d", {"h": "tensor"}, reduce="reduce_scatter", scatter="s"
    )
    assert spec.check_shapes((2, 8, 12), (5, 12), mesh_sizes={"tensor": 2}, h=4) == [
        (2, 8, 6),
        (5, 6),
        (2, 4, 5),
    ]


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("args", "kwargs", "needles"),
    [
        (("b d, d f", {"f": "tensor"}), {}, ["exactly one '->'"]),
        (("b d, d f -> b f -> f", {"f": "tensor"}), {}, ["exactly one '->'"]),
        (
            ("b d, d (k f) -> b (k f)", {"f": "tensor"}),
            {},
            ["'f' is split but is an inner factor of group (k f)", "write (f k)"],
        ),
        (("b d, d f -> b f", {"x": "tensor"}), {}, ["mapped axis 'x' is not in the pattern"]),
        (
            ("b d, d f -> b f", {"b": "tensor", "f": "tensor"}),
            {},
            ["mesh axis 'tensor' is mapped from both"],
        ),
        (("b d, d f -> b g", {"f": "tensor"}), {}, ["output axis 'g' appears in no input"]),
        (("b d, d f -> b f", {"d": "tensor"}), {}, ["partial sums", "reduce='all_reduce'"]),
        (
            ("b d, d f -> b f", {"f": "tensor"}),
            {"reduce": "all_reduce"},
            ["no summed axis is split", "drop reduce"],
        ),
        (
            ("b d, d f -> b f", {"d": "tensor"}),
            {"reduce": "sum"},
            ["reduce='sum'", "'all_reduce', 'reduce_scatter', 'partial'"],
        ),
        (
            ("b d, d f -> b f", {"d": "tensor"}),
            {"reduce": "reduce_scatter"},
            ["scatter=<output axis> goes with reduce='reduce_scatter'"],
        ),
        (
            ("b d, d f -> b f", {"d": "tensor"}),
            {"reduce": "reduce_scatter", "scatter": "d"},
            ["scatter='d' is not an output axis"],
        ),
        (
            ("b d, d f -> b f", {"f": "tensor"}),
            {"in_shards": {1: {"d": "tensor"}}},
            ["arrives split on 'd'", "all-to-all"],
        ),
        (
            ("b d, d f -> b f", {"f": "tensor"}),
            {"in_shards": {0: {"f": "tensor"}}},
            ["in_shards[0] splits 'f', which input 0 ('b d') does not have"],
        ),
        (
            ("b d, d f -> b f", {"f": "tensor"}),
            {"in_shards": {2: {}}},
            ["in_shards names input 2, but there are 2"],
        ),
        (
            ("b d, d f -> b f", {"d": "tensor"}),
            {"reduce": "partial", "gather_output": True},
            ["gather_output=True but no output axis is split"],
        ),
        (("b ((d)), d f -> b f", {"f": "tensor"}), {}, ["nested parentheses"]),
        (("b d), d f -> b f", {"f": "tensor"}), {}, ["unbalanced ')'"]),
        (("b 2, d f -> b f", {"f": "tensor"}), {}, ["'2' in 'b 2' is not an axis name"]),
        (("b b, d f -> b f", {"f": "tensor"}), {}, ["axis 'b' appears twice in operand 'b b'"]),
        (("b d, d f -> b f", "f"), {}, ["axes='f' must be a dict"]),
    ],
)
def test_bad_specs_quote_the_pattern(
    args: tuple[Any, ...], kwargs: dict[str, Any], needles: list[str]
) -> None:
    with pytest.raises(InvalidArgument) as info:
        shard_spec(*args, **kwargs)
    message = str(info.value)
    assert "pattern" in message or "axes=" in message
    for needle in needles:
        assert needle in message, message


@pytest.mark.parametrize(
    ("shapes", "sizes", "needles"),
    [
        (
            ((2, 6), (6, 10)),
            {},
            [
                "axis 'f' has global size 10, not divisible by mesh axis 'tensor' of size 4",
                "global shapes [(2, 6), (6, 10)]",
                "mesh sizes {'tensor': 4}",
            ],
        ),
        (((2, 6), (5, 8)), {}, ["axis sizes disagree", "(d) = 5"]),
        (((2, 6, 1), (6, 8)), {}, ["input 0 ('b d') has 3 dims; the pattern gives it 2"]),
    ],
)
def test_bad_shapes_quote_pattern_shapes_and_mesh(
    shapes: Any, sizes: dict[str, int], needles: list[str]
) -> None:
    spec = shard_spec("b d, d f -> b f", {"f": "tensor"})
    with pytest.raises(InvalidArgument) as info:
        spec.check_shapes(*shapes, mesh_sizes={"tensor": 4}, **sizes)
    message = str(info.value)
    assert "pattern 'b d, d f -> b f'" in message
    for needle in needles:
        assert needle in message, message


def test_grouped_axis_sizes() -> None:
    spec = shard_spec("b (h k), (h k) f -> b f", {"h": "tensor"}, reduce="all_reduce")
    with pytest.raises(
        InvalidArgument,
        match=r"cannot infer the size of \['h', 'k'\] in group \(h k\); pass it as a keyword, e.g. h=",
    ):
        spec.check_shapes((2, 12), (12, 3), mesh_sizes={"tensor": 2})
    with pytest.raises(
        InvalidArgument,
        match="axis 'h' has global size 3, not divisible by mesh axis 'tensor' of size 2",
    ):
        spec.check_shapes((2, 12), (12, 3), mesh_sizes={"tensor": 2}, h=3)
    with pytest.raises(InvalidArgument, match=r"dim \(h k\) has size 12, not divisible by 5"):
        spec.check_shapes((2, 12), (12, 3), mesh_sizes={"tensor": 2}, h=5)
    with pytest.raises(InvalidArgument, match=r"sizes given for \['z'\], not axes of the pattern"):
        spec.check_shapes((2, 12), (12, 3), mesh_sizes={"tensor": 2}, h=2, z=1)
    with pytest.raises(InvalidArgument, match="a Sharding needs one entry per dim"):
        _ = shard_spec("... d, d f -> ... f", {"f": "tensor"}).output_sharding


# ------------------------------------------------------------------------------ random specs on gloo
LETTERS = "abcde"


@st.composite
def spec_cases(draw: st.DrawFn, world: int) -> dict[str, Any]:
    t = draw(st.sampled_from([d for d in divisors(world) if d > 1] or [1]))
    data = world // t
    n_in = draw(st.integers(1, 2))
    ins = [list(draw(st.permutations(LETTERS)))[: draw(st.integers(1, 3))] for _ in range(n_in)]
    union = sorted({a for op in ins for a in op})
    out = list(draw(st.permutations(union)))[: draw(st.integers(1, len(union)))]
    # optionally group the first two axes of an operand: the second one is an inner factor
    operands = [*ins, out]
    grouped = [len(op) >= 2 and draw(st.booleans()) for op in operands]
    inner = {op[1] for op, g in zip(operands, grouped, strict=True) if g}
    outer_ok = [a for a in union if a not in inner]
    if not outer_ok:
        grouped = [False] * len(operands)
        inner, outer_ok = set(), union
    mapped = draw(st.sampled_from(outer_ok))
    case: dict[str, Any] = {"axes": {mapped: "tensor"}}
    if mapped not in out:
        eligible = [a for a in out if a in outer_ok and a != mapped]
        how = draw(
            st.sampled_from(["all_reduce", "partial"] + (["reduce_scatter"] if eligible else []))
        )
        case["reduce"] = how
        if how == "reduce_scatter":
            case["scatter"] = draw(st.sampled_from(eligible))
    else:
        case["gather_output"] = draw(st.booleans())
    in_shards: dict[str, dict[str, str]] = {}
    for i, op in enumerate(ins):
        if draw(st.integers(0, 2)) != 0:
            continue  # arrives as the op computes on it
        outer = [a for a in op if a in outer_ok]
        arrival: dict[str, str] = {}
        if mapped in op:  # as needed, or whole (then each rank takes its shard)
            if draw(st.booleans()):
                arrival[mapped] = "tensor"
        elif outer and draw(st.booleans()):  # split, though the op needs it whole
            arrival[draw(st.sampled_from(outer))] = "tensor"
        free = [a for a in outer if a not in arrival]
        if data > 1 and free and draw(st.booleans()):  # split over an axis the op does not use
            arrival[draw(st.sampled_from(free))] = "data"
        in_shards[str(i)] = arrival
    if in_shards:
        case["in_shards"] = in_shards

    def text(op: list[str], g: bool) -> str:
        return (f"({op[0]} {op[1]}) " + " ".join(op[2:])).strip() if g else " ".join(op)

    case["pattern"] = (
        ", ".join(text(op, g) for op, g in zip(ins, grouped[:-1], strict=True))
        + " -> "
        + text(out, grouped[-1])
    )
    m = t * data
    case["sizes"] = {
        a: m * draw(st.integers(1, 2)) if a in outer_ok else draw(st.integers(1, 2)) for a in union
    }
    case["config"] = {"tensor": t}
    case["seed"] = draw(st.integers(0, 10**6))
    return case


@pytest.mark.timeout(120)
@settings(max_examples=scaled(5))
@given(st.lists(spec_cases(2), min_size=8, max_size=16))
def test_random_specs_match_einsum_on_2_ranks(pool: Any, cases: list[dict[str, Any]]) -> None:
    results = pool(2).run(J.run_spec_cases, cases)
    for k, case in enumerate(cases):
        J.check_spec_case(case, [r[k] for r in results], 2)


@pytest.mark.timeout(120)
@settings(max_examples=scaled(5))
@given(st.lists(spec_cases(4), min_size=8, max_size=16))
def test_random_specs_match_einsum_on_4_ranks(pool: Any, cases: list[dict[str, Any]]) -> None:
    results = pool(4).run(J.run_spec_cases, cases)
    for k, case in enumerate(cases):
        J.check_spec_case(case, [r[k] for r in results], 4)


def test_a_spec_first_called_under_torch_compile_makes_one_graph() -> None:
    """A spec's per-signature lowering is not stored while dynamo traces (the store would break
    the trace's own guard on it: a second graph at the next call)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from funcpipe.parallel.mesh import Axis

    axis = Axis("tensor", 1, 0, None)
    spec = shard_spec("... j, q j -> ... q", {"q": "tensor"})  # a pattern no other test uses
    w, b = torch.randn(8, 4), torch.randn(8)

    def f(x: torch.Tensor) -> torch.Tensor:
        return spec(x, w, bias=b, mesh={"tensor": axis})

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, backend="eager")
    x = torch.randn(2, 3, 4)
    for _ in range(3):
        torch.testing.assert_close(compiled(x), torch.nn.functional.linear(x, w, b))
    assert counters["stats"]["unique_graphs"] == 1


def test_a_mesh_entry_that_is_not_an_axis_is_refused_after_a_cached_call() -> None:
    """The per-signature lowering keys the axes by size only for real Axes: an object of the
    same size that is not one is refused, as every call's collectives refused it before."""
    import types

    import torch

    from funcpipe.parallel.mesh import Axis

    spec = shard_spec("... k, r k -> ... r", {"r": "tensor"})  # a pattern no other test uses
    x, w = torch.randn(2, 4), torch.randn(6, 4)
    spec(x, w, mesh={"tensor": Axis("tensor", 1, 0, None)})  # cached for axis size 1
    fake = types.SimpleNamespace(name="tensor", size=1, coord=0)
    with pytest.raises(
        InvalidArgument, match=r"mesh\['tensor'\] is .* not a funcpipe.parallel.Axis"
    ):
        spec(x, w, mesh={"tensor": fake})


def test_a_spec_keeps_a_bounded_number_of_call_signatures(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inputs of ever new shapes (sequence lengths) do not grow a spec's lowering cache past
    its bound; the oldest signature goes, and the results stay right."""
    import torch

    from funcpipe.parallel import spec as spec_module
    from funcpipe.parallel.mesh import Axis

    monkeypatch.setattr(spec_module, "LOWERED_CACHE", 3)
    spec = shard_spec("... u, v u -> ... v", {"v": "tensor"})  # a pattern no other test uses
    w, mesh = torch.randn(5, 4), {"tensor": Axis("tensor", 1, 0, None)}
    for n in range(1, 8):
        x = torch.randn(n, 4)
        torch.testing.assert_close(spec(x, w, mesh=mesh), x @ w.T)
    assert len(spec._lowered) == 3
