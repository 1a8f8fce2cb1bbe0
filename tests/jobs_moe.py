"""Pool jobs for tests/test_moe_parallel.py: the MoE layer with its experts split over the
processes (expert parallelism), each process with its own tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

F64 = torch.float64


def config_of(case: dict[str, Any]) -> Any:
    from funcpipe.models import moe

    return moe.MoEConfig(
        d_model=4, experts=case["world"] * case["per"], ffn=3, top_k=case["k"],
        shared=case["shared"], score=case["score"], capacity=case.get("capacity"),
    )  # fmt: skip


def tokens_of(case: dict[str, Any], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens and the gradient its output gets."""
    g = torch.Generator().manual_seed(case["seed"] + 1 + rank)
    rows = case["tokens"][rank]
    return torch.randn(rows, 4, dtype=F64, generator=g), torch.randn(
        rows, 4, dtype=F64, generator=g
    )


def run_moe_cases(rank: int, cases: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    from funcpipe.models import moe
    from tests.jobs_parallel import mesh_for

    out = []
    for case in cases:
        axis = mesh_for({"tensor": case["world"]})["tensor"]
        config = config_of(case)
        full = moe.init(config, seed=case["seed"], dtype=F64)
        params = {
            k: v.clone().requires_grad_(True)
            for k, v in moe.expert_shard(full, config, axis).items()
        }
        x, gy = tokens_of(case, rank)
        x.requires_grad_(True)
        y, stats = moe.moe(params, x, config, axis=axis)
        y.backward(gy)
        grads = {k: (torch.zeros_like(v) if v.grad is None else v.grad) for k, v in params.items()}
        out.append({"y": y.detach(), "x_grad": x.grad, "grads": grads, "counts": stats["counts"]})
    return out
