"""funcpipe.train.loss_scale: exact scaling by powers of two, overflow -> skipped step and backoff,
growth, the rule of torch's GradScaler, a float16 model whose gradients underflow without
scaling and trains with it, the flag agreed over two gloo ranks, and a Pipeline following a
changing scale."""

from __future__ import annotations

import math
from typing import Any

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import funcpipe as fp
from funcpipe.errors import InvalidArgument
from funcpipe.schedule import generate
from funcpipe.testing import assert_trees_close
from funcpipe.train import loss_scale, optim

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
EXACT = {"rtol": 0.0, "atol": 0.0}


# ------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("exponent", [-8, 0, 7, 16, 24])
def test_scaling_and_unscaling_by_a_power_of_two_is_exact(exponent: int) -> None:
    scale = 2.0**exponent
    state = loss_scale.init(scale)
    g = torch.Generator().manual_seed(exponent + 100)
    scaled = {  # what a backward of the scaled loss produced
        "h": torch.randn(20, generator=g).to(F16),
        "b": torch.randn(3, generator=g).to(BF16),
        "d": torch.randn(3, generator=g, dtype=F64),
        "none": None,
    }
    out, finite = loss_scale.unscale(scaled, state)
    assert finite.dtype == torch.bool and bool(finite)
    assert out["none"] is None
    assert out["h"].dtype == F32 and out["b"].dtype == F32 and out["d"].dtype == F64
    expected = {k: None if v is None else v.to(out[k].dtype) / scale for k, v in scaled.items()}
    assert_trees_close(out, expected, **EXACT)
    # and back: the unscaled float32 gradients times the scale are the float16 ones
    assert_trees_close((out["h"] * scale).to(F16), scaled["h"], **EXACT)
    # the gradient of the scaled loss is the gradient times the scale, exactly
    w = torch.randn(5, generator=g, requires_grad=True)
    (plain,) = torch.autograd.grad((w**2).sum(), w)
    (scaled,) = torch.autograd.grad(loss_scale.scale_loss((w**2).sum(), state), w)
    assert_trees_close(scaled, plain * scale, **EXACT)


def test_a_float16_loss_is_scaled_in_float32() -> None:
    """5 * 2**16 overflows float16 (max 65504): the scaled loss is computed in float32."""
    loss = torch.tensor(5.0, dtype=F16)
    out = loss_scale.scale_loss(loss, loss_scale.init())
    assert out.dtype == F32 and out.item() == 5.0 * 2**16


# ------------------------------------------------------------------------------ overflow
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_an_overflow_skips_the_step_and_backs_off(bad: float) -> None:
    params = {"w": torch.ones(4, dtype=F16), "stage1": None}
    opt = optim.adamw(1e-2, master_weights=True)
    opt_state = opt.init(params)
    state = loss_scale.init(2.0**10, backoff_factor=0.25)
    grads = {"w": torch.tensor([1.0, bad, 2.0, 3.0], dtype=F16), "stage1": None}
    unscaled, finite = loss_scale.unscale(grads, state)
    assert not bool(finite)
    new = opt.update(unscaled, opt_state, params)
    kept = loss_scale.apply_if_finite(finite, new, (params, opt_state))
    assert kept[0] is params and kept[1] is opt_state  # params and optimizer state unchanged
    state = loss_scale.update(state, finite)
    assert state.scale.item() == 2.0**8 and state.good_steps.item() == 0
    # a finite step is taken
    grads = {"w": torch.ones(4, dtype=F16), "stage1": None}
    unscaled, finite = loss_scale.unscale(grads, state)
    new = opt.update(unscaled, opt_state, params)
    assert loss_scale.apply_if_finite(finite, new, (params, opt_state)) is new


def test_the_scale_grows_after_growth_interval_finite_steps() -> None:
    state = loss_scale.init(8.0, growth_factor=4.0, growth_interval=3)
    seen = []
    for finite in [True, True, True, True, False, True, True, True]:
        state = loss_scale.update(state, torch.tensor(finite))
        seen.append((state.scale.item(), state.good_steps.item()))
    assert seen == [
        (8.0, 1),
        (8.0, 2),
        (32.0, 0),  # grown after 3 finite steps in a row
        (32.0, 1),
        (16.0, 0),  # an overflow restarts the count
        (16.0, 1),
        (16.0, 2),
        (64.0, 0),
    ]
    # growth that would overflow float32 is not taken
    top = loss_scale.init(2.0**127, growth_interval=1)
    assert loss_scale.update(top, True).scale.item() == 2.0**127


def test_the_scale_stops_at_its_floor_and_an_overflow_there_raises() -> None:
    """Issue 42: repeated overflow used to back the scale off to 0.0, after which every step was
    skipped without a word. The scale now stops at ``min_scale`` and an overflow there raises."""
    state = loss_scale.init(8.0, min_scale=2.0, backoff_factor=0.25)
    state = loss_scale.update(state, False)
    assert state.scale.item() == 2.0  # 8 x 0.25, floored at 2 (not 0.5)
    assert loss_scale.update(state, True).scale.item() == 2.0  # finite steps at the floor go on
    with pytest.raises(loss_scale.LossScaleFloorError) as caught:
        loss_scale.update(state, torch.tensor(False))
    text = str(caught.value)
    assert "min_scale=2.0" in text and "non-finite gradients" in text
    assert "check_finite=True" in text and isinstance(caught.value, FloatingPointError)
    assert state.scale.item() == 2.0  # pure: the state given is as it was
    # the default floor is 1.0 (or the first scale, when that is smaller)
    assert loss_scale.init().min_scale == 1.0 and loss_scale.init(2.0**-8).min_scale == 2.0**-8
    state, overflows = loss_scale.init(), 0
    with pytest.raises(loss_scale.LossScaleFloorError, match=r"min_scale=1\.0"):
        for overflows in range(1, 200):  # noqa: B007
            state = loss_scale.update(state, False)
    assert state.scale.item() == 1.0 and overflows == 17  # 2**16 -> 1 in 16, the 17th raises
    with pytest.raises(InvalidArgument, match=r"min_scale=4.0 is above initial=2.0"):
        loss_scale.init(2.0, min_scale=4.0)
    with pytest.raises(InvalidArgument, match=r"min_scale=0: the smallest loss scale"):
        loss_scale.init(min_scale=0)


@given(flags=st.lists(st.booleans(), max_size=30), interval=st.integers(1, 4))
def test_update_follows_torch_grad_scaler(flags: list[bool], interval: int) -> None:
    """The same scale and count as torch's own update (torch._amp_update_scale_), which has no
    floor: ``min_scale`` below the 2**-18 that 30 overflows reach."""
    state = loss_scale.init(
        2.0**12, growth_factor=2.0, backoff_factor=0.5, growth_interval=interval, min_scale=2.0**-24
    )
    scale, tracker = torch.tensor(2.0**12), torch.tensor(0, dtype=torch.int32)
    for finite in flags:
        state = loss_scale.update(state, finite)
        found_inf = torch.tensor(0.0 if finite else 1.0)
        torch._amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, interval)
        assert state.scale.item() == scale.item()
        assert state.good_steps.item() == tracker.item()


# ------------------------------------------------------------------------------ training
G = torch.Generator().manual_seed(0)
X = torch.randn(64, 8, generator=G)
Y = torch.sin(X @ torch.randn(8, 1, generator=G))
PARAMS = {
    "w1": (torch.randn(16, 8, generator=G) / 8**0.5).to(F16),
    "w2": (torch.randn(1, 16, generator=G) / 4).to(F16),
}


def _loss(p: dict[str, torch.Tensor]) -> torch.Tensor:
    """A float16 MLP with a tiny loss (1e-8 x MSE): its gradients (about 1e-10) are far below
    float16's smallest subnormal, 6e-8. The loss itself is float32."""
    out = torch.tanh(X.to(F16) @ p["w1"].T) @ p["w2"].T
    return 1e-8 * ((out.float() - Y) ** 2).mean()


def _grads(params: dict[str, torch.Tensor], scale: Any) -> tuple[torch.Tensor, Any]:
    leaves, spec = optree.tree_flatten(params)
    live = [t.detach().requires_grad_(True) for t in leaves]
    loss = _loss(optree.tree_unflatten(spec, live))
    grads = torch.autograd.grad(loss_scale.scale_loss(loss, scale), live)
    return loss.detach(), optree.tree_unflatten(spec, list(grads))


def test_float16_gradients_underflow_without_scaling_and_train_with_it() -> None:
    opt = optim.adamw(3e-2, weight_decay=0.0, master_weights=True)
    # without scaling every gradient is 0: nothing can train
    _, grads = _grads(PARAMS, 1.0)
    assert all(not t.any() for t in optree.tree_leaves(grads))

    # the full loop; the first scale, 2**48, is too large on purpose and backs off
    params, opt_state, ls = PARAMS, opt.init(PARAMS), loss_scale.init(2.0**48, growth_interval=10)
    losses, skipped = [], 0
    for _ in range(40):
        loss, grads = _grads(params, ls)
        grads, finite = loss_scale.unscale(grads, ls)
        new = opt.update(grads, opt_state, params)
        params, opt_state = loss_scale.apply_if_finite(finite, new, (params, opt_state))
        ls = loss_scale.update(ls, finite)
        skipped += not bool(finite)
        losses.append(loss.item())
    assert params["w1"].dtype == F16
    assert 1 <= skipped <= 10 and opt_state.step == 40 - skipped
    assert losses[-1] < 0.7 * losses[0]  # measured: 7.27e-9 -> 4.23e-9, 6 steps skipped


# ------------------------------------------------------------------------------ a pipeline
def test_a_pipeline_follows_a_changing_scale() -> None:
    """Pipeline.step(loss_scale=ls.scale) with a scale that changes between steps: gradients
    bitwise those of the scaled loss (scale_loss in the loss function), an unscaled loss, and
    after unscale the reference's."""
    torch.manual_seed(0)
    stages = [
        fp.Stage(lambda p, x: torch.tanh(x @ p["a"]), name="a"),
        fp.Stage(lambda p, h: h @ p["b"], name="b"),
    ]
    params = ({"a": torch.randn(4, 6, dtype=F64)}, {"b": torch.randn(6, 2, dtype=F64)})
    x, y = torch.randn(8, 4, dtype=F64), torch.randn(8, 2, dtype=F64)

    def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out - target) ** 2).mean()

    program = generate("1f1b", ranks=2, microbatches=4)
    pipe = fp.Pipeline(stages, program, loss_fn=mse)  # built once
    ref_loss, ref_grads = fp.reference_step(stages, params, x, mse, targets=y, microbatches=4)
    for scale in (2.0**10, 2.0**3):
        ls = loss_scale.init(scale)
        loss, grads = pipe.step(params, x, y, loss_scale=ls.scale)
        scaled = fp.Pipeline(
            stages, program, loss_fn=lambda out, t, s=ls: loss_scale.scale_loss(mse(out, t), s)
        ).step(params, x, y)
        assert_trees_close(scaled.grads, grads, **EXACT)
        assert_trees_close(scaled.loss / ls.scale, loss, **EXACT)  # the step's loss: unscaled
        grads, finite = loss_scale.unscale(grads, ls)
        assert bool(finite)
        assert_trees_close(loss, ref_loss, rtol=1e-12, atol=0.0)
        assert_trees_close(grads, ref_grads, rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------------------ two ranks
def unscale_rank(rank: int, bad_rank: int) -> bool:
    """Pool job: rank ``bad_rank`` holds an inf; every rank gets the group's answer."""
    import torch.distributed as dist

    grads = (torch.ones(3, dtype=F16), None) if rank else (None, torch.ones(2, dtype=F16))
    if rank == bad_rank:
        held = grads[1 - rank]
        assert held is not None
        held[0] = math.inf
    _, finite = loss_scale.unscale(grads, loss_scale.init(), group=dist.group.WORLD)
    return bool(finite)


@pytest.mark.timeout(120)
def test_the_finite_flag_is_agreed_over_a_group(pool: Any) -> None:
    assert pool(2).run(unscale_rank, 0) == [False, False]
    assert pool(2).run(unscale_rank, 1) == [False, False]
    assert pool(2).run(unscale_rank, -1) == [True, True]


# ------------------------------------------------------------------------------ errors
def test_bad_arguments_are_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"initial=0: the first loss scale"):
        loss_scale.init(0)
    with pytest.raises(InvalidArgument, match=r"growth_factor=1.0: must be a finite number > 1"):
        loss_scale.init(growth_factor=1.0)
    with pytest.raises(InvalidArgument, match=r"backoff_factor=1.5: must be a number in \(0, 1\)"):
        loss_scale.init(backoff_factor=1.5)
    with pytest.raises(InvalidArgument, match=r"growth_interval=0: .* an int >= 1"):
        loss_scale.init(growth_interval=0)
    state = loss_scale.init()
    with pytest.raises(InvalidArgument, match="unscale needs the LossScaleState"):
        loss_scale.unscale({"w": torch.ones(2)}, 2.0**16)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"grads leaf at \('w',\) is tensor\(\[1, 2\]\)"):
        loss_scale.unscale({"w": torch.tensor([1, 2])}, state)
    with pytest.raises(InvalidArgument, match=r"finite=1.0: the flag that unscale"):
        loss_scale.update(state, 1.0)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="new and old must have the same structure"):
        loss_scale.apply_if_finite(True, (1, 2), (1,))
    with pytest.raises(InvalidArgument, match=r"scale=-1.0: a LossScaleState"):
        loss_scale.scale_loss(torch.ones(()), -1.0)
