"""The GPT with mixture-of-experts blocks (GPTConfig(experts=...)) on one process: its pipeline
step equals reference_step under every kind of schedule, the auxiliary loss reaches the
routers, the expert load counts every assignment, and bad configurations are refused."""

from __future__ import annotations

import pytest
import torch

import funcpipe as fp
from funcpipe.errors import InvalidArgument
from funcpipe.models import gpt, gpt_balance
from funcpipe.schedule import generate

F64 = torch.float64
CFG = gpt.GPTConfig(
    vocab=32, context=8, d_model=16, heads=2, layers=3, experts=4, top_k=2, shared_experts=1
)
ONE = gpt.single_axis()


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32, (8, 8), generator=g), torch.randint(0, 32, (8, 8), generator=g)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zbv", "dualpipev", "chimera"])
def test_the_pipeline_step_equals_the_reference_step(name: str) -> None:
    program = generate(name, ranks=2, microbatches=4)
    n = len(set(program.replica_of or range(program.n_stages)))
    params = gpt.split(gpt.init(CFG, seed=1, dtype=F64), CFG, n)
    stages, loss = gpt.stages(CFG, n, axis=ONE), gpt.loss_fn(axis=ONE)
    x, y = _batch()
    pipe = fp.Pipeline(stages, program, loss_fn=loss, ties=gpt.tie_spec(n), recompute=True)
    got = pipe.step(params, x, y)
    ref = fp.reference_step(
        stages, params, x, loss, targets=y, microbatches=4, ties=gpt.tie_spec(n)
    )
    fp.testing.assert_trees_close((got.loss, got.grads), ref, atol=1e-12, rtol=1e-10)


def test_the_auxiliary_loss_is_in_the_loss_and_reaches_the_routers() -> None:
    program = generate("1f1b", ranks=2, microbatches=2)
    params = gpt.split(gpt.init(CFG, seed=2, dtype=F64), CFG, 2)
    stages = gpt.stages(CFG, 2, axis=ONE)
    x, y = _batch(1)
    steps = {
        w: fp.Pipeline(stages, program, loss_fn=gpt.loss_fn(axis=ONE, aux_weight=w),
                       ties=gpt.tie_spec(2)).step(params, x, y)
        for w in (0.0, 0.01)
    }  # fmt: skip
    # each of the 3 MoE layers' Switch loss is >= 1 (1 exactly under even load and scores)
    extra = float(steps[0.01].loss - steps[0.0].loss)
    assert 0.01 * 3 * 0.99 < extra < 0.01 * 3 * 4
    for s, i in ((0, "0"), (1, "2")):
        with_aux = steps[0.01].grads[s]["blocks"][i]["moe"]["router"]
        without = steps[0.0].grads[s]["blocks"][i]["moe"]["router"]
        assert not torch.allclose(with_aux, without)


def test_the_expert_load_counts_every_assignment() -> None:
    full = gpt.init(CFG, seed=0)
    x, _ = _batch()
    load = gpt.expert_load(full, CFG, x)
    assert load.shape == (3, 4)
    assert load.sum(1).tolist() == [8 * 8 * 2] * 3


def test_moe_every_and_the_expert_paths() -> None:
    c = gpt.GPTConfig(layers=4, experts=8, moe_every=2, d_model=16, heads=2)
    assert c.moe_blocks == (1, 3) and c.expert_ffn == c.mlp
    assert gpt.expert_paths(c, 2) == [
        (0, "blocks.1.moe.w_in"), (0, "blocks.1.moe.w_out"),
        (1, "blocks.3.moe.w_in"), (1, "blocks.3.moe.w_out"),
    ]  # fmt: skip
    full = gpt.init(c)
    assert "mlp" in full["blocks"][0] and full["blocks"][1]["moe"]["w_in"].shape == (8, 16, 128)
    # a token meets the router, 2 of the 8 experts: fewer parameters than the dense model
    dense = gpt.GPTConfig(layers=4, d_model=16, heads=2)
    per_expert = 3 * 16 * 64
    assert gpt.matmul_params(c) - gpt.matmul_params(dense) == 2 * (
        8 * 16 + 2 * per_expert - (64 * 16 + 64 + 16 * 64 + 16)
    )


@pytest.mark.parametrize(
    ("kw", "said"),
    [
        ({"experts": 4, "top_k": 5}, "top_k=5"),
        ({"experts": 4, "moe_every": 9}, "no block of the 4 is an MoE block"),
        ({"experts": -1}, "experts=-1"),
        ({"experts": 4, "top_k": 0}, "top_k=0"),
    ],
)
def test_bad_expert_configurations_are_refused(kw: dict[str, int], said: str) -> None:
    with pytest.raises(InvalidArgument, match=said):
        gpt.GPTConfig(layers=4, **kw)


def test_an_expert_width_the_tensor_axis_does_not_divide_is_refused() -> None:
    """Each expert's width is split over the tensor ranks: a width they do not divide is named
    before anything runs (the dense sizes divide here: only expert_ffn is wrong)."""
    from funcpipe.parallel import Axis

    cfg = gpt.GPTConfig(experts=4, expert_ffn=6, mlp=8, heads=4, vocab=64)
    with pytest.raises(InvalidArgument, match=r"expert_ffn=6\) must be divisible by the tensor"):
        gpt.stages(cfg, 1, axis=Axis("tensor", 4, 0, None))
    gpt.stages(cfg, 1, axis=Axis("tensor", 2, 0, None))  # 6 over 2: accepted


def test_the_routing_bias_goes_in_and_the_step_returns_the_counts() -> None:
    """DeepSeek-V3's balancing as values: the bias is a batch field every microbatch gets
    whole (dim "whole"), it changes which experts are chosen, the step returns each block's
    counts summed over microbatches and in-process copies (a forward's, not a
    recomputation's), equal to the counts of the whole batch on one device; update_route_bias
    moves the bias from them."""
    program = generate("zbv", ranks=2, microbatches=2)
    n = program.n_stages
    full = gpt.init(CFG, seed=3, dtype=F64)
    params = gpt.split(full, CFG, n)
    stages, loss = gpt.stages(CFG, n, axis=ONE), gpt.loss_fn(axis=ONE)
    x, y = _batch(2)
    bias = gpt_balance.route_bias(CFG, dtype=F64)
    bias[:, 0] = 5.0  # every token's first choice: expert 0
    batch, dim = {"inputs": x, "route_bias": bias}, {"inputs": 0, "route_bias": "whole"}
    side = gpt_balance.side_inputs(CFG, n)
    pipe = fp.Pipeline(
        stages, program, loss_fn=loss, ties=gpt.tie_spec(n), side_inputs=side, dim=dim, data=2,
        recompute=True,
    )  # fmt: skip
    got = pipe.step(params, batch, y)
    ref = fp.reference_step(
        stages, params, batch, loss, targets=y, microbatches=4, ties=gpt.tie_spec(n),
        side_inputs=side, dim=dim,
    )  # fmt: skip
    fp.testing.assert_trees_close((got.loss, got.grads), ref, atol=1e-12, rtol=1e-10)
    assert sorted(got.tallies) == [f"blocks.{i}.moe.counts" for i in (0, 1, 2)]
    plain = gpt.expert_load(full, CFG, x)  # without the bias
    for j, i in enumerate((0, 1, 2)):
        counts = got.tallies[f"blocks.{i}.moe.counts"]
        assert counts.sum() == 8 * 8 * 2 and counts[0] == 8 * 8  # every token chose expert 0
        assert counts.tolist() != plain[j].tolist()
    moved = gpt_balance.update_route_bias(bias, got.tallies, CFG, rate=0.5)
    assert (moved[:, 0] == 4.5).all()  # the overloaded expert's bias goes down


def test_whole_leaves_reach_every_microbatch_and_a_batch_must_have_a_split_one() -> None:
    bias = torch.arange(3.0)
    pieces = fp.split({"x": torch.arange(6.0), "b": bias}, 3, dim={"x": 0, "b": "whole"})
    assert [p["x"].tolist() for p in pieces] == [[0, 1], [2, 3], [4, 5]]
    assert all(p["b"] is bias for p in pieces)
    with pytest.raises(InvalidArgument, match="at least one leaf must carry the batch"):
        fp.split({"b": bias}, 2, dim={"b": "whole"})
    with pytest.raises(InvalidArgument, match="or 'whole'"):
        fp.split({"b": bias}, 2, dim={"b": "all"})


EVERY = ("gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "zb-h2", "zbv", "dualpipev",
         "chimera")  # fmt: skip


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("name", EVERY)
def test_the_batch_switch_loss_is_exact_under_every_schedule(name: str, recompute: bool) -> None:
    """The auxiliary loss over the whole batch (every microbatch and both in-process copies):
    a counting pass (an evaluation step) gives each block's load, the training step takes it
    as "route_load", and its loss and every gradient equal the one-device model's
    cross-entropy + 0.01 x the batch's Switch loss, computed on the batch as one piece, in
    float64. Without the load (each microbatch's own), they differ."""
    from funcpipe.schedule.generators import to_eval

    program = generate(name, ranks=2, microbatches=2)
    n = len(set(program.replica_of or range(program.n_stages)))
    params = gpt.split(gpt.init(CFG, seed=4, dtype=F64), CFG, n)
    stages, loss = gpt.stages(CFG, n, axis=ONE), gpt.loss_fn(axis=ONE)
    x, y = _batch(3)
    side = gpt_balance.side_inputs(CFG, n, fields=("route_load",))
    dim = {"inputs": 0, "route_load": "whole"}
    even = torch.full((3, 4), 0.25, dtype=F64)  # (the counting pass reads no load)
    kw = {"loss_fn": loss, "side_inputs": side, "dim": dim, "data": 2, "ties": gpt.tie_spec(n)}
    counted = fp.Pipeline(stages, to_eval(program), **kw).step(
        params, {"inputs": x, "route_load": even}, y
    )
    load = gpt_balance.batch_load(counted.tallies, CFG, dtype=F64)
    train = fp.Pipeline(stages, program, recompute=recompute, **kw)
    got = train.step(params, {"inputs": x, "route_load": load}, y)
    whole = {"inputs": x, "route_load": load}
    ref = fp.reference_step(
        stages, params, whole, loss, targets=y, microbatches=1, side_inputs=side, dim=dim,
        ties=gpt.tie_spec(n),
    )  # fmt: skip
    fp.testing.assert_trees_close((got.loss, got.grads), ref, atol=1e-12, rtol=1e-10)
    # the reference's load is its own batch's: the one-piece forward counts the same
    assert torch.equal(
        gpt.expert_load(gpt.init(CFG, seed=4, dtype=F64), CFG, x).to(F64) / 128, load
    )
    own = fp.Pipeline(stages, program, loss_fn=loss, data=2, ties=gpt.tie_spec(n)).step(
        params, x, y
    )
    assert not torch.allclose(own.loss, got.loss, atol=1e-9, rtol=0)


def test_a_routing_bias_or_load_of_another_shape_is_refused() -> None:
    fn = gpt.stages(CFG, 1, axis=ONE)[0]
    params = gpt.split(gpt.init(CFG, seed=0), CFG, 1)[0]
    x, _ = _batch()
    for name, shape in (("route_bias", (2, 4)), ("route_load", (3, 5)), ("route_bias", (4,))):
        with pytest.raises(InvalidArgument, match=f"{name} has shape .*: \\(3, 4\\)"):
            fn(params, x, **{name: torch.zeros(shape)})
