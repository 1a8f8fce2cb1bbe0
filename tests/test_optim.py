"""funcpipe.train.optim: the pure optimizers against torch.optim, clipping against clip_grad_norm_,
the schedules, and clipping across two gloo ranks."""

from __future__ import annotations

import math
from typing import Any

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from funcpipe.errors import InvalidArgument
from funcpipe.testing import assert_trees_close
from funcpipe.train import optim
from tests import jobs_train

F64 = torch.float64
SHAPES = {"a": (3, 4), "b": (5,), "c": (2, 3, 2)}
TIGHT = {"rtol": 1e-12, "atol": 1e-12}


def _copy(tree: Any) -> Any:
    return optree.tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, tree)


def _tree(g: torch.Generator, shapes: dict[str, tuple[int, ...]] = SHAPES) -> dict[str, Any]:
    return {k: torch.randn(*s, generator=g, dtype=F64) for k, s in shapes.items()}


def _against_torch(
    make_ours: Any,
    make_torch: Any,
    *,
    steps: int = 10,
    seed: int = 0,
    shapes: dict[str, tuple[int, ...]] = SHAPES,
    lrs: list[float] | None = None,
) -> None:
    """Run ours and torch's optimizer side by side on the same random grads, compare each step."""
    g = torch.Generator().manual_seed(seed)
    params = _tree(g, shapes)
    names = sorted(params)
    tparams = [params[k].clone().requires_grad_(True) for k in names]
    topt = make_torch(tparams)
    opt = make_ours()
    state = opt.init(params)
    for k in range(steps):
        grads = _tree(g, shapes)
        for p, name in zip(tparams, names, strict=True):
            p.grad = grads[name].clone()
        if lrs is not None:
            for group in topt.param_groups:
                group["lr"] = lrs[k]
        topt.step()
        params, state = opt.update(grads, state, params)
        expected = {name: p.detach() for name, p in zip(names, tparams, strict=True)}
        assert_trees_close(params, expected, **TIGHT, msg=f"step {k}")
    assert state.step == steps


# ------------------------------------------------------------------------------ vs torch
@pytest.mark.parametrize(
    ("lr", "betas", "eps", "wd"),
    [
        (1e-2, (0.9, 0.999), 1e-8, 0.01),
        (3e-3, (0.8, 0.95), 1e-6, 0.1),
        (1e-1, (0.0, 0.5), 1e-3, 0.0),
    ],
)
def test_adamw_matches_torch_step_for_step(lr: float, betas: Any, eps: float, wd: float) -> None:
    _against_torch(
        lambda: optim.adamw(lr, betas=betas, eps=eps, weight_decay=wd),
        lambda ps: torch.optim.AdamW(ps, lr=lr, betas=betas, eps=eps, weight_decay=wd),
    )


@pytest.mark.parametrize(
    ("momentum", "nesterov", "wd"),
    [(0.0, False, 0.0), (0.0, False, 0.1), (0.9, False, 0.0), (0.9, True, 0.0), (0.5, True, 0.05)],
)
def test_sgd_matches_torch_step_for_step(momentum: float, nesterov: bool, wd: float) -> None:
    _against_torch(
        lambda: optim.sgd(0.05, momentum=momentum, nesterov=nesterov, weight_decay=wd),
        lambda ps: torch.optim.SGD(
            ps, lr=0.05, momentum=momentum, nesterov=nesterov, weight_decay=wd
        ),
    )


@given(
    lr=st.floats(1e-4, 0.5),
    b1=st.floats(0.0, 0.99),
    b2=st.floats(0.5, 0.9999),
    eps=st.floats(1e-10, 1e-2),
    wd=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**16),
)
def test_adamw_matches_torch_for_any_hyperparameters(
    lr: float, b1: float, b2: float, eps: float, wd: float, seed: int
) -> None:
    _against_torch(
        lambda: optim.adamw(lr, betas=(b1, b2), eps=eps, weight_decay=wd),
        lambda ps: torch.optim.AdamW(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd),
        steps=4,
        seed=seed,
        shapes={"w": (4, 3), "v": (2,)},
    )


def test_a_schedule_gives_the_lr_of_each_step() -> None:
    sched = optim.warmup_cosine(0.05, warmup=3, total=10, final=0.001)
    _against_torch(
        lambda: optim.adamw(sched),
        lambda ps: torch.optim.AdamW(ps, lr=1.0),
        lrs=[sched(k) for k in range(10)],
    )
    _against_torch(
        lambda: optim.sgd(sched, momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=1.0, momentum=0.9),
        lrs=[sched(k) for k in range(10)],
    )


def test_lr_keyword_overrides_the_schedule_for_one_update() -> None:
    g = torch.Generator().manual_seed(1)
    params, grads = _tree(g), _tree(g)
    scheduled = optim.adamw(optim.constant(0.3))
    fixed = optim.adamw(0.1)
    a, sa = scheduled.update(grads, scheduled.init(params), params, lr=0.1)
    b, sb = fixed.update(grads, fixed.init(params), params)
    assert_trees_close((a, sa), (b, sb), rtol=0, atol=0)


def test_mixed_dtypes_are_updated_per_leaf() -> None:
    g = torch.Generator().manual_seed(2)
    params = {"h": torch.randn(4, generator=g), "d": torch.randn(3, generator=g, dtype=F64)}
    grads = {"h": torch.randn(4, generator=g), "d": torch.randn(3, generator=g, dtype=F64)}
    opt = optim.adamw(1e-2)
    new, _ = opt.update(grads, opt.init(params), params)
    for k in params:
        p = params[k].clone().requires_grad_(True)
        p.grad = grads[k].clone()
        torch.optim.AdamW([p], lr=1e-2).step()
        assert new[k].dtype == params[k].dtype
        assert_trees_close(new[k], p.detach())


# ------------------------------------------------------------------------------ purity
@pytest.mark.parametrize(
    "opt",
    [optim.adamw(1e-2, weight_decay=0.1), optim.adamw(1e-2, weight_decay=0.0),
     optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1), optim.sgd(0.1)],
    ids=["adamw", "adamw-no-decay", "sgd-nesterov", "sgd"],
)  # fmt: skip
def test_update_leaves_its_inputs_untouched(opt: optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(3)
    params = _tree(g)
    state = opt.init(params)
    params, state = opt.update(_tree(g), state, params)  # a non-zero state
    grads = _tree(g)
    before = _copy((params, grads, state))
    new_params, new_state = opt.update(grads, state, params)
    assert_trees_close((params, grads, state), before, rtol=0, atol=0)
    inputs = {
        t.data_ptr() for t in optree.tree_leaves((params, grads, state)) if torch.is_tensor(t)
    }
    outputs = [t for t in optree.tree_leaves((new_params, new_state)) if torch.is_tensor(t)]
    assert not any(t.data_ptr() in inputs for t in outputs)
    assert new_state.step == state.step + 1


def test_stages_without_grads_are_skipped_and_kept() -> None:
    g = torch.Generator().manual_seed(4)
    p0, p1, g0 = _tree(g), _tree(g), _tree(g)
    meta1 = optree.tree_map(lambda t: t.to("meta"), p1)
    opt = optim.adamw(1e-2)
    # (a) the other stage's params are meta placeholders, (b) they are None
    for other in (meta1, None):
        state = opt.init((p0, other))
        new, new_state = opt.update((g0, None), state, (p0, other))
        assert new[1] is other
        assert new_state.mu[1] is state.mu[1]
        full, _ = opt.update(g0, opt.init(p0), p0)
        assert_trees_close(new[0], full, rtol=0, atol=0)
    assert opt.init((p0, None)).mu[1] is None


def test_clip_matches_torch_clip_grad_norm() -> None:
    g = torch.Generator().manual_seed(5)
    for max_norm in (0.5, 1e6):
        grads = _tree(g)
        names = sorted(grads)
        ps = [torch.zeros(grads[k].shape, dtype=F64, requires_grad=True) for k in names]
        for p, k in zip(ps, names, strict=True):
            p.grad = grads[k].clone()
        norm_ref = torch.nn.utils.clip_grad_norm_(ps, max_norm)
        before = _copy(grads)
        clipped, norm = optim.clip_by_global_norm(grads, max_norm)
        assert_trees_close(norm, norm_ref, **TIGHT)
        assert_trees_close(clipped, {k: p.grad for k, p in zip(names, ps, strict=True)}, **TIGHT)
        assert_trees_close(grads, before, rtol=0, atol=0)


def test_clip_keeps_none_and_weights_discount_copies() -> None:
    g = torch.Generator().manual_seed(6)
    a, b = _tree(g), _tree(g)
    clipped, norm = optim.clip_by_global_norm((a, None), 1.0)
    assert clipped[1] is None
    _, ref = optim.clip_by_global_norm(a, 1.0)
    assert_trees_close(norm, ref, rtol=0, atol=0)
    # b counted with weight 0 as a pytree, or through a function of the path
    _, n1 = optim.clip_by_global_norm((a, b), 1.0, weights=({k: 1 for k in a}, {k: 0 for k in b}))
    _, n2 = optim.clip_by_global_norm((a, b), 1.0, weights=lambda path, leaf: path[0] == 0)
    assert_trees_close((n1, n2), (ref, ref), **TIGHT)
    # a copy held twice with weight 1/2 each counts once
    _, n3 = optim.clip_by_global_norm((a, a), 1.0, weights=lambda path, leaf: 0.5)
    assert_trees_close(n3, ref, **TIGHT)


# ------------------------------------------------------------------------------ schedules
def test_schedules() -> None:
    wc = optim.warmup_cosine(1.0, warmup=4, total=14, final=0.1)
    assert [wc(k) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert wc(4) == 1.0 and math.isclose(wc(9), 0.55) and wc(14) == wc(100) == 0.1
    decay = [wc(k) for k in range(4, 15)]
    assert decay == sorted(decay, reverse=True)
    lw = optim.linear_warmup(2.0, warmup=2)
    assert [lw(k) for k in range(4)] == [1.0, 2.0, 2.0, 2.0]
    assert optim.linear_warmup(2.0, warmup=0)(0) == 2.0
    assert optim.constant(0.3)(7) == 0.3
    assert optim.warmup_cosine(1.0, warmup=0, total=0)(0) == 0.0
    assert repr(wc) == "warmup_cosine(1.0, warmup=4, total=14, final=0.1)"
    assert repr(optim.adamw(wc)).startswith("adamw(lr=warmup_cosine(1.0, warmup=4")


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: optim.adamw(-1.0), "lr"),
        (lambda: optim.adamw(float("nan")), "lr"),
        (lambda: optim.adamw("0.1"), "lr"),
        (lambda: optim.sgd(True), "lr"),
        (lambda: optim.adamw(1e-3, betas=(1.0, 0.9)), "betas"),
        (lambda: optim.adamw(1e-3, betas=(0.9,)), "betas"),
        (lambda: optim.adamw(1e-3, eps=0.0), "eps"),
        (lambda: optim.adamw(1e-3, weight_decay=-0.1), "weight_decay"),
        (lambda: optim.sgd(0.1, weight_decay=float("inf")), "weight_decay"),
        (lambda: optim.sgd(0.1, momentum=-0.5), "momentum"),
        (lambda: optim.sgd(0.1, nesterov=True), "nesterov"),
        (lambda: optim.warmup_cosine(1.0, warmup=5, total=3), "total"),
        (lambda: optim.warmup_cosine(1.0, warmup=-1, total=3), "warmup"),
        (lambda: optim.linear_warmup(-1.0, warmup=3), "peak"),
        (lambda: optim.constant(0.1)(-1), "step"),
        (lambda: optim.clip_by_global_norm({"a": torch.ones(2)}, 0.0), "max_norm"),
        (
            lambda: optim.clip_by_global_norm({"a": torch.ones(2)}, 1.0, weights={"a": -1}),
            "weights",
        ),
        (lambda: optim.clip_by_global_norm({"a": torch.ones(2)}, 1.0, weights={"b": 1}), "weights"),
        (lambda: optim.clip_by_global_norm({"a": 1.0}, 1.0), "grads"),
    ],
)
def test_bad_arguments_are_named(make: Any, name: str) -> None:
    with pytest.raises(InvalidArgument, match=name):
        make()


def test_mismatched_structures_are_named() -> None:
    params = {"w": torch.zeros(3), "b": torch.zeros(2)}
    opt = optim.adamw(1e-3)
    state = opt.init(params)
    with pytest.raises(InvalidArgument, match="params does not have the structure of grads"):
        opt.update({"w": torch.zeros(3), "x": torch.zeros(2)}, state, params)
    with pytest.raises(InvalidArgument, match=r"params\['w'\] has shape \(3,\), grads has \(4,\)"):
        opt.update({"w": torch.zeros(4), "b": torch.zeros(2)}, state, params)
    with pytest.raises(InvalidArgument, match="state.mu"):
        opt.update(params, state._replace(mu={"w": torch.zeros(3)}), params)
    with pytest.raises(InvalidArgument, match="AdamWState"):
        opt.update(params, optim.sgd(0.1).init(params), params)
    with pytest.raises(InvalidArgument, match=r"lr\(step\)"):
        optim.sgd(lambda step: -1.0).update(params, optim.sgd(0.1).init(params), params)


# ------------------------------------------------------------------------------ two ranks
@pytest.mark.timeout(120)
def test_clip_across_two_gloo_ranks_equals_one_process(pool) -> None:
    g = torch.Generator().manual_seed(7)
    grads = (_tree(g), {"u": torch.randn(6, generator=g, dtype=F64)})
    shared = torch.randn(3, generator=g, dtype=F64)
    for max_norm in (0.5, 1e6):
        for with_shared in (False, True):
            whole = (*grads, shared) if with_shared else grads
            ref, ref_norm = optim.clip_by_global_norm(whole, max_norm)
            results = pool(2).run(
                jobs_train.clip_half, grads, max_norm, shared if with_shared else None
            )
            for rank, (clipped, norm) in enumerate(results):
                assert_trees_close(norm, ref_norm, **TIGHT)
                assert_trees_close(clipped[rank], ref[rank], **TIGHT)
                assert clipped[1 - rank] is None
                if with_shared:
                    assert_trees_close(clipped[2], ref[2], **TIGHT)


class _TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(11, 6)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 6))
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.wte.weight  # tied, as GPT-2's lm_head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.wte(ids))))


@pytest.mark.parametrize("n", [1, 2])
def test_tie_weights_count_a_tied_parameter_once(n: int) -> None:
    """A tied embedding and head (in one stage, or two): every name holds the total gradient
    after a step, so the plain norm counts it twice; with tie_weights the norm is the unsplit
    model's, as torch.nn.utils.clip_grad_norm_ measures it."""
    import funcpipe as fp

    model = _TiedLM().double()
    ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(0))

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 11), y.reshape(-1))

    parts = fp.split_module(model, n, example=ids[:2])
    ties = fp.find_ties(parts.params)
    assert ties
    _, grads = fp.reference_step(
        parts.stages, parts.params, ids, loss_fn, targets=ids, ties=ties, microbatches=2
    )
    loss_fn(model(ids), ids).backward()
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    assert float(optim.global_norm(grads)) > float(want) * 1.01  # the tie counted twice
    got = optim.global_norm(grads, weights=optim.tie_weights(ties, parts.params))
    assert float(got) == pytest.approx(float(want), rel=1e-12)
    half = optim.tie_weights(ties, parts.params, lambda path, leaf: 0.5)  # other rules compose
    assert float(optim.global_norm(grads, weights=half)) == pytest.approx(
        float(want) * 0.5**0.5, rel=1e-12
    )
    with pytest.raises(InvalidArgument, match="list at least two \\(stage, path\\) pairs"):
        optim.tie_weights({"w": [(0, "a"), "b"]}, parts.params)
    with pytest.raises(InvalidArgument, match="does not name a leaf"):
        optim.tie_weights({"w": [(0, "nope"), (0, "nope2")]}, parts.params)


def test_tie_weights_take_every_path_form_ties_take() -> None:
    """A nested tie named by a tuple, a dotted string or a list index all hit the leaf the
    norm's path names (the dotted form used to match nothing: the tie counted twice)."""
    g = (
        {"blocks": {"0": {"w": torch.ones(2)}}},
        {"blocks": {"1": {"w": torch.ones(2)}}, "h": [torch.ones(3)]},
    )
    for path in (("blocks", "1", "w"), "blocks.1.w"):
        ties = {"w": [(0, ("blocks", "0", "w")), (1, path)]}
        norm = optim.global_norm(g, weights=optim.tie_weights(ties, g))
        assert float(norm) == pytest.approx((2 + 3) ** 0.5)
    listed = {"h": [(1, "h.0"), (0, ("blocks", "0", "w"))]}  # (shapes differ: weights only)
    assert float(optim.global_norm(g, weights=optim.tie_weights(listed, g))) == pytest.approx(
        (2 + 3) ** 0.5  # stage 0's w counted 0: stage 1's w and h
    )
    listed = {"h": [(0, ("blocks", "0", "w")), (1, "h.0")]}
    assert float(optim.global_norm(g, weights=optim.tie_weights(listed, g))) == pytest.approx(
        (2 + 2) ** 0.5  # h (a list's leaf, named "h.0") counted 0
    )
