"""vocab_parallel_cross_entropy computes in float32 whatever the logits' dtype.

Against ``F.cross_entropy(logits.float(), ...)`` on the same bfloat16 / float16 logits: the loss
is float32 and equal to float32 rounding, the logits' gradient has the logits' dtype and is the
float32 gradient rounded to it (within one ulp of that dtype). Two cases where arithmetic in the
logits' dtype goes wrong (a confident bfloat16 prediction whose exp-sum rounds to 1, a float16
exp-sum over a large vocabulary that overflows) come out right. On a size-1 axis (the
single-device reference) and split over two gloo ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from funcpipe.models.gpt import single_axis
from funcpipe.parallel import ops
from funcpipe.testing import assert_trees_close

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
LOSS_TOL = {"rtol": 1e-6, "atol": 1e-6}  # float32 against float32, another summation order
# the gradient is the float32 gradient rounded to the logits' dtype: within one ulp of it
# (for float16 also one subnormal spacing, 2**-24: small softmax entries are subnormal)
GRAD_TOL = {BF16: {"rtol": 2.0**-7, "atol": 1e-9}, F16: {"rtol": 2.0**-10, "atol": 2.0**-24}}


def _reference(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (float64 for float64 logits) per-token loss and gradient of its mean."""
    wide = logits.detach().to(torch.promote_types(logits.dtype, F32)).requires_grad_(True)
    v = wide.shape[-1]
    loss = F.cross_entropy(wide.reshape(-1, v), target.reshape(-1), reduction="none")
    loss = loss.reshape(target.shape)
    loss.mean().backward()
    assert wide.grad is not None
    return loss.detach(), wide.grad


def _ours(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.detach().clone().requires_grad_(True)
    loss = ops.vocab_parallel_cross_entropy(x, target, axis=single_axis())
    loss.mean().backward()
    assert x.grad is not None
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_low_precision_logits_match_float32_cross_entropy(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 7, 50, generator=g) * 4).to(dtype)
    target = torch.randint(0, 50, (3, 7), generator=g)
    loss, grad = _ours(logits, target)
    ref_loss, ref_grad = _reference(logits, target)
    assert loss.dtype == F32 and grad.dtype == dtype
    assert_trees_close(loss, ref_loss, **LOSS_TOL)
    assert_trees_close(grad.float(), ref_grad, **GRAD_TOL[dtype])


def test_float32_and_float64_logits_keep_their_dtype() -> None:
    g = torch.Generator().manual_seed(2)
    for dtype in (F32, torch.float64):
        logits = torch.randn(2, 5, 9, generator=g, dtype=dtype)
        target = torch.randint(0, 9, (2, 5), generator=g)
        loss, grad = _ours(logits, target)
        assert loss.dtype == dtype and grad.dtype == dtype
        ref_loss, ref_grad = _reference(logits, target)
        tol = {"rtol": 1e-6, "atol": 1e-7} if dtype == F32 else {"rtol": 1e-12, "atol": 1e-14}
        assert_trees_close((loss, grad), (ref_loss, ref_grad), **tol)


def test_a_confident_bfloat16_prediction_keeps_its_small_loss_and_gradient() -> None:
    """Large logits, target ahead by 12: the exp-sum is 1 + 15 e^-12 = 1.00009, which bfloat16
    (8 significant bits) rounds to 1, so a bfloat16 computation returns a loss of 0 (it is
    9.2e-5) and a target gradient of 0. In float32 the loss is right to float32's resolution
    near an exp-sum of 1 (2**-22 absolute, under 0.3% here) and the gradient to bfloat16's."""
    logits = torch.full((2, 16), 988.0, dtype=BF16)
    target = torch.tensor([3, 11])
    logits[0, 3] = logits[1, 11] = 1000.0
    # the failure being guarded against: the same arithmetic in bfloat16
    shifted = logits - logits.amax(-1, keepdim=True)
    assert torch.equal(shifted.exp().sum(-1).log(), torch.zeros(2, dtype=BF16))

    loss, grad = _ours(logits, target)
    ref_loss, ref_grad = _reference(logits, target)
    expected = torch.log1p(torch.tensor(15 * torch.e**-12.0))
    assert_trees_close(loss, expected.expand(2).float(), rtol=0.0, atol=2.0**-22)
    assert_trees_close(loss, ref_loss, rtol=0.0, atol=2.0**-22)
    rows = torch.arange(2)
    assert bool((grad[rows, target] < 0).all())
    assert_trees_close(grad.float(), ref_grad, rtol=2.0**-7, atol=0.0)


def test_a_float16_exp_sum_over_a_large_vocabulary_does_not_overflow() -> None:
    """70,000 equal logits: the exp-sum is 70,000 > 65,504, float16's largest value."""
    v = 70_000
    logits = torch.zeros(1, v, dtype=F16)
    target = torch.tensor([5])
    assert torch.isinf(logits.exp().sum(-1)).all()  # what float16 arithmetic gives

    loss, grad = _ours(logits, target)
    ref_loss, ref_grad = _reference(logits, target)
    assert_trees_close(loss, torch.tensor([torch.log(torch.tensor(float(v))).item()]), rtol=1e-6)
    assert_trees_close(loss, ref_loss, **LOSS_TOL)
    assert grad.dtype == F16 and bool(torch.isfinite(grad).all())
    # 1/70000 is a float16 subnormal (spacing 6e-8): compare with that spacing as atol
    assert_trees_close(grad.float(), ref_grad, rtol=2.0**-10, atol=2.0**-24)


# ------------------------------------------------------------------------------ two gloo ranks
def split_rank(rank: int, logits: torch.Tensor, target: torch.Tensor) -> dict[str, Any]:
    """Pool job: this rank's half of the vocabulary, forward and backward."""
    from tests.jobs_parallel import mesh_for

    axis = mesh_for({"tensor": {"size": 2, "mode": "1d"}})["tensor"]
    n = logits.shape[-1] // 2
    x = logits[..., rank * n : (rank + 1) * n].clone().requires_grad_(True)
    loss = ops.vocab_parallel_cross_entropy(x, target, axis=axis)
    loss.mean().backward()
    return {"loss": loss.detach(), "grad": x.grad}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_logits_split_over_two_ranks_match_float32(pool: Any, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 6, 40, generator=g) * 4).to(dtype)
    logits[0, 0, 27] = 60.0  # a confident row whose max is on rank 1
    target = torch.randint(0, 40, (2, 6), generator=g)
    results = pool(2).run(split_rank, logits, target)
    ref_loss, ref_grad = _reference(logits, target)
    for rank, r in enumerate(results):
        assert r["loss"].dtype == F32 and r["grad"].dtype == dtype
        assert_trees_close(r["loss"], ref_loss, **LOSS_TOL, msg=f"rank {rank}")
    grad = torch.cat([r["grad"] for r in results], dim=-1)
    assert_trees_close(grad.float(), ref_grad, **GRAD_TOL[dtype])
