"""Hypothesis strategies shared by the tensor-parallel tests (configs, dims, op cases)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from funcpipe.parallel import ParallelConfig
from tests import jobs_parallel as J


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_options(mode: str, world: int) -> list[dict[str, Any]]:
    """Every tensor part of a config for ``mode`` that fits a world of ``world`` ranks."""
    out: list[dict[str, Any]] = []
    for t in divisors(world):
        square = round(t**0.5) ** 2 == t
        cube = round(t ** (1 / 3)) ** 3 == t
        if mode in ("1d", "sequence") or (mode == "2d" and square) or (mode == "3d" and cube):
            out.append({"size": t, "mode": mode})
        elif mode == "2.5d":
            for d in divisors(t):
                q = round((t // d) ** 0.5)
                if q * q * d == t:
                    out.append({"size": t, "mode": mode, "depth": d})
    return out


@st.composite
def configs(draw: st.DrawFn, mode: str, world: int, *, min_size: int = 1) -> dict[str, Any]:
    """A config of ``mode`` for ``world`` ranks; the remaining ranks go to pipe and data."""
    options = [o for o in tensor_options(mode, world) if o["size"] >= min_size]
    tensor = draw(st.sampled_from(options))
    pipeline = draw(st.sampled_from(divisors(world // tensor["size"])))
    return {"pipeline": pipeline, "tensor": tensor}


_BASE = {"b": 2, "s": 3, "i": 2, "o": 2, "v": 3, "d": 2, "h": 2, "e": 3, "f": 2, "w": 2}


@st.composite
def op_cases(draw: st.DrawFn, names: list[str], world: int, *, min_size: int = 1) -> dict[str, Any]:
    """One op case: op name, config, dims (multiples of what the mesh needs) and a seed."""
    name = draw(st.sampled_from(sorted(names)))
    op = J.OPS[name]
    config = draw(configs(op.mode, world, min_size=min_size))
    sizes = ParallelConfig.from_dict(config, world_size=world).axis_sizes
    mult = op.multiples(sizes)
    dims = {k: mult.get(k, 1) * draw(st.integers(1, top)) for k, top in _BASE.items()}
    dims["causal"] = draw(st.integers(0, 1))
    return {"op": name, "config": config, "dims": dims, "seed": draw(st.integers(0, 2**31 - 1))}


def ops_of(*modes: str) -> list[str]:
    return [n for n, op in J.OPS.items() if op.mode in modes]


def scaled(n: int) -> int:
    """``n`` examples under the ``ci`` profile (25 max), proportionally more under ``dev``."""
    from hypothesis import settings

    return max(1, n * settings.default.max_examples // 25)


def run_and_check(pool: Any, world: int, cases: list[dict[str, Any]]) -> None:
    """Run a batch of op cases in one pool job, then check each against one device."""
    results = pool(world).run(J.run_op_cases, cases)
    for k, case in enumerate(cases):
        J.check_op_case(case, [r[k] for r in results], world)
