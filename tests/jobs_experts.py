"""Pool jobs for tests/test_experts.py: residual MoE stages in a Pipeline whose mesh splits the
experts over the data-parallel copies (``ParallelConfig(expert=2)``), against the same stages
with every expert on one device."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

F64 = torch.float64


def _config(experts: int) -> Any:
    from funcpipe.models import moe

    return moe.MoEConfig(d_model=4, experts=experts, ffn=3, top_k=2, shared=1)


def _stages(n: int, config: Any, axis: Any) -> list[Any]:
    import funcpipe as fp
    from funcpipe.models import moe

    def block(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return h + moe.moe(p, h, config, axis=axis)[0]

    return [fp.Stage(block, name=f"moe {s}") for s in range(n)]


def _mse(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((o - t) ** 2).mean()


def _batch(seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, 3, 4, dtype=F64, generator=g), torch.randn(
        size, 3, 4, dtype=F64, generator=g
    )


def expert_pipelines_vs_one_device(
    rank: int,
    names: Sequence[str],
    *,
    expert: int = 2,
    microbatches: int = 4,
    recompute: bool = False,
    strict: bool = True,
) -> list[dict[str, Any]]:
    """For each schedule of ``names``: one step at pipeline 2 with the experts split over
    ``expert`` copies; returns this process's worst differences from the one-device step
    (loss, dense gradients, its own experts' gradients) and what it held."""
    import funcpipe as fp
    from funcpipe.models import moe
    from funcpipe.schedule import generate
    from tests.jobs_parallel import mesh_for

    mesh = mesh_for({"pipeline": 2, "expert": expert})
    axis, copies = mesh["expert"], mesh.config.data
    copy, coord = mesh.place.coords["data"], axis.coord
    out = []
    for k, name in enumerate(names):
        program = generate(name, ranks=2, microbatches=microbatches)
        n = len(set(program.replica_of or range(program.n_stages)))
        config = _config(2 * expert)
        full = tuple(moe.init(config, seed=10 * k + s, dtype=F64) for s in range(n))
        mine = tuple(moe.expert_shard(p, config, axis) for p in full)
        experts = [(s, leaf) for s in range(n) for leaf in ("w_in", "w_out")]
        if strict:  # NCCL's point-to-point rules enforced by the transport
            os.environ["FUNCPIPE_STRICT_P2P"] = "1"
        try:
            pipe = fp.Pipeline(
                _stages(n, config, axis), program, loss_fn=_mse, mesh=mesh,
                experts=experts, recompute=recompute,
            )  # fmt: skip
        finally:
            os.environ.pop("FUNCPIPE_STRICT_P2P", None)
        x, y = _batch(k, microbatches * copies)
        share = slice(microbatches * copy, microbatches * (copy + 1))
        with pipe:
            got = pipe.step(mine, x[share], y[share])
        ref_loss, ref_grads = fp.reference_step(
            _stages(n, config, None), full, x, _mse, targets=y,
            microbatches=microbatches * copies,
        )  # fmt: skip
        local = config.experts // expert
        # relative to the largest value compared (residual MoE stages grow their activations)
        worst = {"loss": float((got.loss - ref_loss).abs() / ref_loss.abs().clamp(min=1))}
        worst |= {"dense": 0.0, "experts": 0.0}
        held = []
        for s, g in enumerate(got.grads):
            if g is None:
                continue
            held.append(s)
            for leaf, value in g.items():
                want = ref_grads[s][leaf]
                if leaf in ("w_in", "w_out"):
                    want, kind = want[coord * local : (coord + 1) * local], "experts"
                else:
                    kind = "dense"
                size = want.abs().max().clamp(min=1)
                worst[kind] = max(worst[kind], float((value - want).abs().max() / size))
        out.append({"name": name, "worst": worst, "held": held, "loss": float(ref_loss)})
    return out
