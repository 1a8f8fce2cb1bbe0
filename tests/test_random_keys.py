"""Random keys (issue 43): dropout in a pipeline draws the masks reference_step draws.

Every (stage, microbatch) call runs under ``stage_key(seed, stage, microbatch)``, so a model
with dropout left on gives the reference's loss and gradients exactly under every schedule, with
recomputation, over data-parallel copies and over processes; the user's generators are left as
they were but for the one draw of a seed. The GPT's residual dropout is the same on every tensor
rank and its attention dropout differs per rank.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import funcpipe as fp
from funcpipe.models import gpt
from funcpipe.schedule import generate
from funcpipe.schedule.generators import GENERATORS
from funcpipe.schedule.ir import pairs
from funcpipe.stages import keys
from tests import jobs_keys as J

TRAINING = [g for g in GENERATORS if g != "forward"]
M = 2


@functools.cache
def _split(n: int, rows: int = 4) -> fp.ModuleSplit:
    x, _ = J.data()
    return fp.split_module(J.dropout_model(), n, example=x[:rows])


def _assert_equal(a: Any, b: Any) -> None:
    a, b = (tuple(t) if hasattr(t, "grads") else t for t in (a, b))  # a StepResult: (loss, grads)
    fa, fb = fp.tree.tree_flatten(a)[0], fp.tree.tree_flatten(b)[0]
    assert len(fa) == len(fb)
    for u, v in zip(fa, fb, strict=True):
        torch.testing.assert_close(u, v, rtol=0, atol=1e-12)


def _reference(part: fp.ModuleSplit, seed: int | None, microbatches: int = M) -> Any:
    x, y = J.data()
    return fp.reference_step(
        part.stages, part.params, x, J.mse, targets=y, microbatches=microbatches, seed=seed
    )


# ------------------------------------------------------------------------------ the keys
def test_keys_are_deterministic_distinct_and_restore_the_generator() -> None:
    k = keys.stage_key(7, 1, 3)
    assert k == keys.stage_key(7, 1, 3) and 0 <= k < 2**63
    assert len({keys.stage_key(7, s, m) for s in range(4) for m in range(4)}) == 16
    assert keys.current_key() is None
    before = torch.get_rng_state()
    with keys.keyed(k):
        assert keys.current_key() == k
        a = torch.rand(3)
        with keys.sharded(0):
            s0 = torch.rand(3)
        with keys.sharded(1):
            s1 = torch.rand(3)
        b = torch.rand(3)  # as if the sharded blocks drew nothing
    with keys.keyed(k):
        assert torch.equal(torch.rand(3), a) and torch.equal(torch.rand(3), b)
    assert not torch.equal(s0, s1)
    assert torch.equal(torch.get_rng_state(), before) and keys.current_key() is None
    with keys.sharded(1) as none:  # outside a keyed call: nothing
        assert none is None


# ------------------------------------------------------------------------------ one process
@pytest.mark.parametrize("overlap", [False, True], ids=["alone", "pairs"])
@pytest.mark.parametrize("schedule", TRAINING)
def test_split_module_dropout_matches_reference_under_every_schedule(
    schedule: str, overlap: bool
) -> None:
    """``pairs``: overlapped pairs (a forward with another microbatch's backward on a second
    thread) draw the masks their halves draw alone."""
    m = 4 if overlap else M  # (at 2 microbatches DualPipeV and ZB-V have no pair to make)
    program = generate(schedule, ranks=2, microbatches=m, overlap=overlap)
    # (looped-bfs has none to make: its F and B meet only at one microbatch's turn)
    assert not overlap or schedule == "looped-bfs" or any(pairs(r) for r in program.ranks)
    part = _split(len(set(program.replica_of or range(program.n_stages))), 8 // m)
    x, y = J.data()
    ref = _reference(part, 123, m)
    for recompute in (False, True):
        pipe = fp.Pipeline(part.stages, program, loss_fn=J.mse, recompute=recompute)
        loss, grads = pipe.step(part.params, x, y, seed=123)
        _assert_equal((loss, grads), ref)


def test_dropout_changes_the_result_and_seeds_differ() -> None:
    part = _split(2)
    x, y = J.data()
    pipe = fp.Pipeline(part.stages, generate("1f1b", ranks=2, microbatches=M), loss_fn=J.mse)
    a, b = pipe.step(part.params, x, y, seed=1), pipe.step(part.params, x, y, seed=2)
    assert not torch.equal(a.loss, b.loss)
    _assert_equal(pipe.step(part.params, x, y, seed=1), a)  # the same seed: the same step


def test_from_module_stages_with_dropout_match_reference() -> None:
    model = J.dropout_model(blocks=2)
    pieces = [fp.from_module(block) for block in model.blocks]
    stages, params = [s for s, _ in pieces], [p for _, p in pieces]
    x, y = J.data()
    program = generate("zb-h1", ranks=2, microbatches=M)
    pipe = fp.Pipeline(stages, program, loss_fn=J.mse, recompute=True)
    ref = fp.reference_step(stages, params, x, J.mse, targets=y, microbatches=M, seed=9)
    _assert_equal(pipe.step(params, x, y, seed=9), ref)


def test_data_copies_match_the_reference_over_the_whole_batch() -> None:
    part = _split(2, rows=2)
    x, y = J.data()
    pipe = fp.Pipeline(
        part.stages, generate("1f1b", ranks=2, microbatches=M), loss_fn=J.mse, data=2
    )
    _assert_equal(pipe.step(part.params, x, y, seed=4), _reference(part, 4, 2 * M))


def test_seed_none_draws_once_from_torchs_generator() -> None:
    part = _split(2)
    x, y = J.data()
    pipe = fp.Pipeline(part.stages, generate("zb-h2", ranks=2, microbatches=M), loss_fn=J.mse)
    torch.manual_seed(42)
    step = pipe.step(part.params, x, y)
    after = torch.get_rng_state()
    torch.manual_seed(42)
    keys.draw_seed()
    assert torch.equal(after, torch.get_rng_state())  # one draw; stage calls restore the rest
    torch.manual_seed(42)
    _assert_equal(step, _reference(part, None))
    torch.manual_seed(42)
    _assert_equal(step, _reference(part, keys.draw_seed()))


def test_seed_must_be_an_int() -> None:
    part = _split(2)
    x, y = J.data()
    pipe = fp.Pipeline(part.stages, generate("1f1b", ranks=2, microbatches=M), loss_fn=J.mse)
    with pytest.raises(fp.InvalidArgument, match=r"seed=1\.5: an int"):
        pipe.step(part.params, x, y, seed=1.5)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ the GPT
GPT_DROP = gpt.GPTConfig(
    vocab=16, context=8, d_model=16, heads=4, layers=2, mlp=32, dropout=0.2, attn_dropout=0.0
)


def test_gpt_dropout_zero_adds_nothing_and_is_checked() -> None:
    assert J.CFG.dropout == 0.0 and J.CFG.attn_dropout == 0.0
    assert gpt.GPTConfig(dropout=0.1).attn_dropout == 0.1
    with pytest.raises(fp.InvalidArgument, match="dropout=1.0"):
        gpt.GPTConfig(dropout=1.0)


def test_gpt_dropout_only_under_a_key() -> None:
    axis = gpt.single_axis()
    (stage,) = gpt.stages(GPT_DROP, 1, axis=axis)
    (params,) = gpt.split(J.gpt_params(False), GPT_DROP, 1)
    x, _ = J.gpt_batch()
    plain = gpt.stages(J.CFG, 1, axis=axis)[0](params, x)
    assert torch.equal(stage(params, x), plain)  # no key: no dropout (evaluation, sampling)
    with keys.keyed(3):
        assert not torch.equal(stage(params, x), plain)


# ------------------------------------------------------------------------------ processes
@pytest.mark.parametrize("schedule", ["dualpipev", "zbv"])
def test_dropout_with_overlapped_pairs_over_processes_matches_reference(
    pool, schedule: str
) -> None:
    """Each pair's forward draws its masks on the process's thread while another microbatch's
    backward runs on a second one, under the strict (NCCL-rules) transport: the masks, loss and
    every gradient of the reference."""
    program = generate(schedule, ranks=2, microbatches=4, overlap=True)
    assert all(pairs(r) for r in program.ranks)
    part = _split(program.n_stages, 2)
    ref_loss, ref_grads = _reference(part, 77, 4)
    got = pool(2).run(J.split_dropout, schedule, 77, 1, 4, True, timeout=300)
    for loss, grads in got:
        assert loss == pytest.approx(float(ref_loss), abs=1e-12)
        for g, r in zip(grads, ref_grads, strict=True):
            if g is not None:
                _assert_equal(g, r)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_dropout_over_processes_matches_reference(pool, schedule: str) -> None:
    program = generate(schedule, ranks=2, microbatches=M)
    part = _split(program.n_stages)
    ref_loss, ref_grads = _reference(part, 77)
    for loss, grads in pool(2).run(J.split_dropout, schedule, 77, timeout=300):
        assert loss == pytest.approx(float(ref_loss), abs=1e-12)
        for g, r in zip(grads, ref_grads, strict=True):
            if g is not None:
                _assert_equal(g, r)


def test_seed_none_over_processes_seeded_alike(pool) -> None:
    part = _split(2)
    torch.manual_seed(11)
    ref_loss, _ = _reference(part, None)
    for loss, _ in pool(2).run(J.split_dropout, "1f1b", None, timeout=300):
        assert loss == pytest.approx(float(ref_loss), abs=1e-12)


def test_processes_seeded_differently_take_process_0s_seed(pool) -> None:
    part = _split(2)
    torch.manual_seed(11)  # process 0's generator
    ref_loss, _ = _reference(part, None)
    for loss in pool(2).run(J.seeds_disagree, False, timeout=300):
        assert loss == pytest.approx(float(ref_loss), abs=1e-12)


def test_explicit_seeds_that_differ_are_refused(pool) -> None:
    for text in pool(2).run(J.seeds_disagree, True, timeout=300):
        assert "step(seed=...) differs between the processes" in text


def test_gpt_tensor2_residual_dropout_matches_tensor1(pool) -> None:
    ref_loss, ref_grads = J.gpt_reference(GPT_DROP, 5)
    plain_loss, _ = J.gpt_reference(J.CFG, 5)
    assert ref_loss != plain_loss  # dropout did something
    results = pool(2).run(J.gpt_tensor2, GPT_DROP, False, 5, timeout=300)
    for r in results:
        assert r["loss"] == pytest.approx(ref_loss, abs=1e-12)
    # replicated leaves (norms, positions) hold the reference's gradient on both ranks
    for r in results:
        _assert_equal(r["grads"]["wpe"], ref_grads["wpe"])
        _assert_equal(r["grads"]["norm"], ref_grads["norm"])


def test_gpt_tensor2_attention_dropout_differs_per_rank(pool) -> None:
    """Heads 2, 3 twins of heads 0, 1: the two ranks' qkv gradients are equal unless their
    attention masks differ (they must), and equal with residual dropout only (same masks)."""
    attn = gpt.GPTConfig(
        vocab=16, context=8, d_model=16, heads=4, layers=2, mlp=32, dropout=0.0, attn_dropout=0.3
    )

    def qkv(cfg: gpt.GPTConfig) -> list[torch.Tensor]:
        rs = sorted(pool(2).run(J.gpt_tensor2, cfg, True, 5, timeout=300), key=lambda r: r["coord"])
        return [r["grads"]["blocks"]["0"]["attn"]["qkv"]["weight"] for r in rs]

    a, b = qkv(attn)
    assert not torch.allclose(a, b)
    a, b = qkv(GPT_DROP)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def _gpt_dropout_pipes(backend: str) -> tuple[Any, Any, Any, Any]:
    from funcpipe.models.gpt import single_axis

    cfg = gpt.GPTConfig(vocab=64, context=8, d_model=16, heads=2, layers=2, dropout=0.2)
    params = gpt.split(gpt.init(cfg, seed=0), cfg, 2)
    stages = gpt.stages(cfg, 2, axis=single_axis())
    compiled = [fp.compile_stage(s, backend=backend) for s in stages]
    program = generate("1f1b", ranks=2, microbatches=2)
    loss_fn = gpt.loss_fn(axis=single_axis())
    eager = fp.Pipeline(stages, program, loss_fn=loss_fn)
    pipes = [fp.Pipeline(compiled, program, loss_fn=loss_fn, recompute=r) for r in (False, True)]
    g = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 64, (4, 8), generator=g), torch.randint(0, 64, (4, 8), generator=g))
    return params, eager, pipes, batch


# dynamo, resuming after the key's graph break, reads .grad of the block's activations while
# tracing (torch 2.13): a UserWarning, which this suite turns into an error
QUIET_DYNAMO = pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor")


@QUIET_DYNAMO
def test_compiled_gpt_dropout_draws_the_eager_masks() -> None:
    """torch.compile'd GPT stages with dropout (aot_eager: the same ATen ops, so the same
    masks) give eager's loss and gradients under each seed, with recomputation too, and a new
    seed compiles nothing new (the key is read, not baked into a guard). The key's ContextVar
    is a graph break under dynamo (dropout 0 reads no key: no break)."""
    from torch._dynamo.utils import counters

    params, eager, (plain, rec), (x, y) = _gpt_dropout_pipes("aot_eager")
    for seed in (1, 2, 3):
        want = eager.step(params, x, y, seed=seed)
        for pipe in (plain, rec):
            got = pipe.step(params, x, y, seed=seed)
            fp.testing.assert_trees_close(
                (got.loss, got.grads), (want.loss, want.grads), atol=1e-6, rtol=1e-5
            )
        if seed == 1:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
@QUIET_DYNAMO
def test_inductor_gpt_dropout_is_keyed_and_recomputes_its_masks() -> None:
    """Under inductor the masks are its own (philox, seeded from the keyed generator), so they
    differ from eager's, but a seed gives the same step every time and R redraws F's masks."""
    params, _, (plain, rec), (x, y) = _gpt_dropout_pipes("inductor")
    a, b, c = (p.step(params, x, y, seed=5) for p in (plain, rec, plain))
    fp.testing.assert_trees_close((a.loss, a.grads), (c.loss, c.grads), atol=0, rtol=0)
    fp.testing.assert_trees_close((a.loss, a.grads), (b.loss, b.grads), atol=1e-6, rtol=1e-5)
    assert float(plain.step(params, x, y, seed=6).loss) != float(a.loss)


@pytest.mark.parametrize("how", ["split_module", "partition", "compiled"])
def test_an_evaluation_over_a_model_in_training_mode_draws_nothing(how: str) -> None:
    """Before: the eval program kept dropout on (two evaluations differed, and the loss was
    not the model's in eval mode); a training step still drops, under its key."""
    import torch.nn as nn

    from funcpipe.schedule.generators import generate

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 2)
    ).train()
    x, y = torch.randn(8, 8), torch.randn(8, 2)
    if how == "split_module":
        got = fp.split_module(model, ["2"], example=x[:2])
    else:
        got = fp.partition(model, 2)
    stages, params = got.stages, got.params
    if how == "compiled":  # (the mode switched outside the compiled function)
        stages = [fp.compile_stage(s, backend="aot_eager") for s in stages]

    def mse(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((o - t) ** 2).mean()

    evaluate = fp.Pipeline(stages, generate("forward", ranks=2, microbatches=4), loss_fn=mse)
    first, second = evaluate.step(params, x, y).loss, evaluate.step(params, x, y).loss
    with torch.no_grad():
        expected = mse(model.eval()(x), y)
    model.train()
    assert torch.equal(first, second)
    torch.testing.assert_close(first, expected)
    train = fp.Pipeline(stages, generate("1f1b", ranks=2, microbatches=4), loss_fn=mse)
    a, b = train.step(params, x, y, seed=3).loss, train.step(params, x, y, seed=3).loss
    assert torch.equal(a, b) and not torch.allclose(a, expected)
    assert model.training and all(m.training for m in model.modules())  # its mode as it was


class _Attention(torch.nn.Module):
    """Self-attention with dropout on its weights (transformers' sdpa with attention_dropout),
    and an alpha dropout and a feature dropout: every dropping op split_module replaces."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(8, 24), torch.nn.Linear(8, 8)
        self.alpha, self.feature = torch.nn.AlphaDropout(0.3), torch.nn.Dropout1d(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).unbind(2)
        p = 0.5 if self.training else 0.0
        att = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=p
        )
        h = self.out(att.transpose(1, 2).reshape(x.shape))
        return self.feature(self.alpha(h))


def test_attention_and_other_dropouts_draw_in_a_training_step_only() -> None:
    """Before: the traced scaled_dot_product_attention kept its dropout_p outside a training
    step (a Llama split in training mode with attention_dropout=0.1 evaluated 0.21 apart from
    one run to the next), and alpha and feature dropout were replaced by plain dropout."""
    from funcpipe.schedule.generators import generate

    torch.manual_seed(0)
    model = torch.nn.Sequential(_Attention(), _Attention()).train()
    x, y = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    got = fp.split_module(model, ["1"], example=x[:1])

    def mse(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((o - t) ** 2).mean()

    evaluate = fp.Pipeline(got.stages, generate("forward", ranks=2, microbatches=4), loss_fn=mse)
    first, second = evaluate.step(got.params, x, y).loss, evaluate.step(got.params, x, y).loss
    with torch.no_grad():
        expected = mse(model.eval()(x), y)
    model.train()
    assert torch.equal(first, second)
    torch.testing.assert_close(first, expected)
    train = fp.Pipeline(got.stages, generate("1f1b", ranks=2, microbatches=4), loss_fn=mse)
    a, b = train.step(got.params, x, y, seed=3).loss, train.step(got.params, x, y, seed=3).loss
    assert torch.equal(a, b) and not torch.allclose(a, expected)
    ops = {getattr(n.target, "__name__", "") for s in got.stages for n in s.fn.gm.graph.nodes}
    assert {"keyed_attention", "keyed_alpha_dropout", "keyed_feature_dropout"} <= ops, ops


# ------------------------------------------------------------------ pairs and torch.utils.checkpoint
def _checkpointed(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    def block(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(torch.tanh(x @ params["W"]), 0.3)

    return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)


def test_a_paired_backward_that_draws_is_no_longer_refused() -> None:
    """torch.utils.checkpoint around dropout recomputes the masks inside the backward: under
    pairs (once refused) loss and every gradient equal reference_step's and the unpaired
    program's. These stages call no collective, so the turn never changes hands here; the
    generator state kept across turns is tested where it does (tests/test_experts.py
    ``test_pairs_over_stages_that_checkpoint_their_dropout_equal_one_device``,
    tests/runtime/test_turns.py)."""
    from funcpipe.stages.stage import Stage

    g = torch.Generator().manual_seed(0)
    params = [{"W": torch.randn(6, 6, generator=g, dtype=torch.float64) / 3} for _ in range(2)]
    stages = [Stage(_checkpointed, name=f"s{k}") for k in range(2)]
    x, y = J.data()
    paired = generate("1f1b", ranks=2, microbatches=4, overlap=True)
    assert any(pairs(r) for r in paired.ranks)
    loss, grads = fp.Pipeline(stages, paired, loss_fn=J.mse).step(params, x, y, seed=1)
    alone = generate("1f1b", ranks=2, microbatches=4)
    ref_loss, ref_grads = fp.Pipeline(stages, alone, loss_fn=J.mse).step(params, x, y, seed=1)
    assert torch.equal(loss, ref_loss)
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.equal(a["W"], b["W"])
    want, want_grads = fp.reference_step(
        stages, params, x, J.mse, targets=y, microbatches=4, seed=1
    )
    torch.testing.assert_close(loss, want)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a["W"], b["W"])


@pytest.mark.parametrize("schedule", TRAINING)
def test_stages_that_checkpoint_their_own_dropout_match_the_reference(schedule: str) -> None:
    """torch.utils.checkpoint (non-reentrant) inside a stage, around dropout, recomputes in the
    backward, split into I and W too: loss and every gradient equal reference_step's. It used
    to fail in every schedule ("a different number of tensors was saved during the original
    forward and recomputation": the first stage's batch was made not to require grad after its
    forward, so the recomputation saved one tensor less)."""
    from funcpipe.stages.stage import Stage

    program = generate(schedule, ranks=2, microbatches=4)
    n = len(set(program.replica_of or range(program.n_stages)))
    g = torch.Generator().manual_seed(0)
    params = [{"W": torch.randn(6, 6, generator=g, dtype=torch.float64) / 3} for _ in range(n)]
    stages = [Stage(_checkpointed, name=f"s{k}") for k in range(n)]
    x, y = J.data()
    ref = fp.reference_step(stages, params, x, J.mse, targets=y, microbatches=4, seed=1)
    _assert_equal(fp.Pipeline(stages, program, loss_fn=J.mse).step(params, x, y, seed=1), ref)


def test_a_reentrant_checkpoint_inside_a_stage_is_named_with_the_fix() -> None:
    """torch refuses a reentrant checkpoint in a backward with inputs= (funcpipe's): its error
    gets a note naming the stage and saying to checkpoint with use_reentrant=False."""
    from funcpipe.stages.stage import Stage

    def reentrant(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(
            lambda x: torch.tanh(x @ params["W"]), x, use_reentrant=True
        )

    def plain(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ params["W"])

    params = [{"W": torch.eye(6, dtype=torch.float64)} for _ in range(2)]
    # (the second stage: a reentrant checkpoint whose inputs need no gradient warns first)
    stages = [Stage(plain, name="s0"), Stage(reentrant, name="s1")]
    x, y = J.data()
    program = generate("1f1b", ranks=2, microbatches=4)
    with pytest.raises(RuntimeError, match="use_reentrant=True") as e:
        fp.Pipeline(stages, program, loss_fn=J.mse).step(params, x, y)
    notes = " ".join(getattr(e.value, "__notes__", []))
    assert "backward (B) of stage 1 ('s1'), microbatch 0" in notes, notes
    assert "use_reentrant=False" in notes and "Pipeline(recompute=...)" in notes
