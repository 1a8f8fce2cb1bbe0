"""Pool jobs for tests/parallel/test_routing.py: rows dispatched to expert ranks, a per-expert
matmul there, combined back; each rank returns what the single-device check needs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

F64 = torch.float64


def case_tensors(case: dict[str, Any], rank: int) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s tokens, their experts, the incoming gradient, and every expert's weight
    (the same on every rank), from the case's seed."""
    d, experts = case["d"], case["per"] * case["world"]
    weights = torch.randn(
        experts, d, d, dtype=F64, generator=torch.Generator().manual_seed(case["seed"])
    )
    g = torch.Generator().manual_seed(case["seed"] + 1 + rank)
    rows = len(case["experts"][rank])
    x = torch.randn(rows, d, dtype=F64, generator=g)
    gout = torch.randn(rows, d, dtype=F64, generator=g)
    return x, torch.tensor(case["experts"][rank], dtype=torch.int64), gout, weights


def run_routing_cases(rank: int, cases: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    from funcpipe.parallel import count_bytes
    from funcpipe.parallel.routing import combine, dispatch
    from tests.jobs_parallel import mesh_for

    out = []
    for case in cases:
        axis = mesh_for({"tensor": case["world"]})["tensor"]
        per, c = case["per"], axis.coord
        x, experts, gout, weights = case_tensors(case, rank)
        x.requires_grad_(True)
        mine = weights[c * per : (c + 1) * per].clone().requires_grad_(True)
        with count_bytes() as counter:
            y, routed = dispatch(x, experts // per, axis, extras=(experts,))
            local = routed.extras[0] - c * per
            z = torch.bmm(y.unsqueeze(1), mine[local]).squeeze(1)
            back = combine(z, routed)
            back.backward(gout)
        out.append(
            {
                "out": back.detach(),
                "x_grad": x.grad,
                "w_grad": mine.grad,
                "received": routed.rows,
                "records": [(r.kind, r.phase, r.nbytes, r.volume) for r in counter.records],
            }
        )
    return out
