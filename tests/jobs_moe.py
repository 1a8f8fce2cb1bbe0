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


def tokens_split_vs_one_device(rank: int, cases: Sequence[dict[str, Any]]) -> list[float]:
    """``moe(split="tokens")`` over a tensor axis of 2 (each rank routes half of the same
    tokens, 2 of the 4 experts on each): per case the worst relative difference from the layer
    on one device of the output, the counts, the auxiliary and z losses, the tokens' gradient
    and every gradient leaf (this rank's block of it) of ``(y * gy).sum() + aux + z``."""
    from funcpipe.models import moe
    from funcpipe.parallel.sharding import shard_tree
    from tests.jobs_parallel import mesh_for

    mesh = mesh_for({"tensor": 2})
    tensor, spread = mesh["tensor"], mesh["expert_tensor"]
    out = []
    for case in cases:
        config = moe.MoEConfig(
            d_model=4, experts=4, ffn=4, top_k=case["k"], shared=case["shared"],
            score=case["score"], capacity=case.get("capacity"),
        )  # fmt: skip
        full = moe.init(config, seed=case["seed"], dtype=F64)
        g = torch.Generator().manual_seed(case["seed"])
        x = torch.randn(case["tokens"], 4, dtype=F64, generator=g)
        gy = torch.randn(case["tokens"], 4, dtype=F64, generator=g)
        got, want = [], []
        for split in ("tokens", None):
            lay = moe.shardings(config, expert=None, tensor="tensor", split="tokens")
            p = shard_tree(full, lay, mesh.place) if split else full
            p = {k: v.clone().requires_grad_(True) for k, v in p.items()}
            xi = x.clone().requires_grad_(True)
            kw: dict[str, Any] = {"axis": spread, "tensor": tensor, "split": split} if split else {}
            y, stats = moe.moe(p, xi, config, **kw)
            ((y * gy).sum() + stats["aux"] + stats["z"]).backward()
            grads = {k: v.grad for k, v in p.items()}
            if not split:
                grads = shard_tree(grads, lay, mesh.place)
            (got if split else want).append(
                [y, stats["counts"], stats["aux"], stats["z"], xi.grad, *grads.values()]
            )
        worst = 0.0
        for a, b in zip(got[0], want[0], strict=True):
            a, b = a.detach().to(F64), b.detach().to(F64)
            worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp(min=1)))
        out.append(worst)
    return out
