"""Pool jobs for the bucketed data-parallel reduction (funcpipe.runtime.buckets)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

import funcpipe as fp
from funcpipe.runtime import buckets
from funcpipe.schedule.generators import generate
from funcpipe.stages.stage import Stage
from tests import jobs_gpt

F64 = torch.float64


@contextmanager
def bucket_cap(cap: int) -> Iterator[None]:
    saved = buckets.BUCKET_BYTES
    buckets.BUCKET_BYTES = cap
    try:
        yield
    finally:
        buckets.BUCKET_BYTES = saved


@contextmanager
def recorded_all_reduces(calls: list[tuple[Any, int, torch.dtype]]) -> Iterator[None]:
    """Record (group, numel, dtype) of every torch.distributed.all_reduce while inside."""
    import torch.distributed as dist

    real = dist.all_reduce

    def record(t: torch.Tensor, *args: Any, group: Any = None, **kwargs: Any) -> Any:
        calls.append((group, t.numel(), t.dtype))
        return real(t, *args, group=group, **kwargs)

    dist.all_reduce = record
    try:
        yield
    finally:
        dist.all_reduce = real


def _mixed(params: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    z = torch.tanh(h @ params["a"] + params["b"])
    return (z @ params["d"]) * params["c"].to(F64).sum()


def mixed_stage() -> tuple[Stage, dict[str, torch.Tensor]]:
    """One stage with leaves of two dtypes and three sizes (a 6x6, b 6, c 5 float32, d 6x6)."""
    g = torch.Generator().manual_seed(3)
    params = {
        "a": torch.randn(6, 6, generator=g, dtype=F64) / 3,
        "b": torch.randn(6, generator=g, dtype=F64),
        "c": torch.randn(5, generator=g, dtype=torch.float32),
        "d": torch.randn(6, 6, generator=g, dtype=F64) / 3,
    }
    return Stage(_mixed, name="mixed"), params


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def data_reduce_under_caps(rank: int, caps: Sequence[int], strict: bool = False) -> dict[str, Any]:
    """A one-rank program on every process (data-parallel copies): per bucket cap, the
    data-parallel all-reduces this process posted (numel, dtype, in order) and its gradients;
    and the single-device reference's gradients of the whole batch. ``strict``: under the strict
    transport (NCCL's rules)."""
    import os

    import torch.distributed as dist

    from funcpipe.distributed.world import SCALARS

    stage, params = mixed_stage()
    program = generate("1f1b", ranks=1, microbatches=2)
    copies = dist.get_world_size()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4 * copies, 6, generator=g, dtype=F64)
    y = torch.randn(4 * copies, 6, generator=g, dtype=F64)
    mine = slice(4 * rank, 4 * rank + 4)
    if strict:
        os.environ["FUNCPIPE_STRICT_P2P"] = "1"
    try:
        pipe = fp.Pipeline([stage], program, loss_fn=mse, transport="dist")
    finally:
        os.environ.pop("FUNCPIPE_STRICT_P2P", None)
    out: dict[str, Any] = {"runs": []}
    for cap in caps:
        calls: list[tuple[Any, int, torch.dtype]] = []
        with bucket_cap(cap), recorded_all_reduces(calls):
            loss, grads = pipe.step([params], x[mine], y[mine])
        scalars = pipe._world.transport.groups[SCALARS]  # the loss sum's group
        out["runs"].append(
            {
                "cap": cap,
                "calls": [(n, str(d)) for group, n, d in calls if group is not scalars],
                "grads": grads[0],
                "loss": float(loss),
            }
        )
    ref_loss, ref_grads = fp.reference_step(
        [stage], [params], x, mse, targets=y, microbatches=2 * copies
    )
    out["reference"] = (float(ref_loss), ref_grads[0])
    return out


def gpt_under_caps(rank: int, pipeline: int, tensor: int, caps: Sequence[int]) -> list[Any]:
    """The demo GPT's first-step gradients on this rank (pipeline x tensor x data, tied
    embeddings) under each bucket cap."""
    results = []
    for cap in caps:
        with bucket_cap(cap):
            results.append(jobs_gpt.pipeline_step(rank, pipeline, tensor, "1f1b", 1)["grads"])
    return results
