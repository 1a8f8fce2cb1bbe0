"""Token-weighted losses: a ``loss_fn`` returning ``(sum, count)`` gives exactly the full batch's
mean loss and gradients (float64), whatever the microbatches, the schedule, the data-parallel
copies and their counts; a scalar ``loss_fn`` keeps the mean over microbatches."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import funcpipe as fp
from funcpipe.errors import InvalidArgument
from funcpipe.schedule.generators import generate
from tests import jobs_loss
from tests.jobs_loss import TRAINING, V, batch, full_batch, model, worst

TOL = 1e-12


def ce_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)


@pytest.mark.parametrize("name", TRAINING)
def test_every_schedule_gives_the_full_batch(name: str) -> None:
    """Padding with ignore_index, uneven microbatches (11 samples in 4): the loss and every
    gradient equal the unsplit model's full-batch ``loss.backward()``."""
    program = generate(name, ranks=2, microbatches=4)
    n = len(set(program.replica_of or ())) or program.n_stages
    stages, params = model(n)
    x, labels = batch(11)
    pipe = fp.Pipeline(stages, program, loss_fn=fp.token_cross_entropy)
    loss, grads = pipe.step(params, x, labels)
    ref_loss, ref_grads = full_batch(stages, params, x, labels)
    assert worst(loss, ref_loss) < TOL
    assert worst(grads, ref_grads) < TOL


def test_reference_step_gives_the_full_batch() -> None:
    stages, params = model(3)
    x, labels = batch(10)
    loss, grads = fp.reference_step(
        stages, params, x, fp.token_cross_entropy, targets=labels, microbatches=4
    )
    ref_loss, ref_grads = full_batch(stages, params, x, labels)
    assert worst(loss, ref_loss) < TOL
    assert worst(grads, ref_grads) < TOL


def test_the_mean_of_means_is_what_it_was_and_differs_here() -> None:
    """A scalar loss keeps today's convention: the mean over microbatches of their means, equal
    to reference_step's, and (with uneven counts) not the full batch's: the reason for pairs."""
    program = generate("1f1b", ranks=2, microbatches=4)
    stages, params = model(2)
    x, labels = batch(8)
    loss, grads = fp.Pipeline(stages, program, loss_fn=ce_mean).step(params, x, labels)
    ref = fp.reference_step(stages, params, x, ce_mean, targets=labels, microbatches=4)
    assert worst(loss, ref[0]) < TOL and worst(grads, ref[1]) < TOL
    means = [ce_mean(*_logits_and_labels(stages, params, x, labels, j)) for j in range(4)]
    assert worst(loss, torch.stack(means).mean()) < TOL
    full, _ = full_batch(stages, params, x, labels)
    assert float((loss - full).abs()) > 1e-4


def _logits_and_labels(stages, params, x, labels, j):
    h = x[2 * j : 2 * j + 2]
    for stage, p in zip(stages, params, strict=True):
        h = stage(p, h)
    return h, labels[2 * j : 2 * j + 2]


@pytest.mark.parametrize("copies", [2])
def test_data_copies_with_different_counts_in_one_process(copies: int) -> None:
    """Two data-parallel copies (simulated in one process), the first counting few tokens."""
    program = generate("1f1b", ranks=2, microbatches=3)
    stages, params = model(2)
    x, labels = batch(12, seed=3)
    labels[:5] = -100
    labels[0, 1] = 3
    pipe = fp.Pipeline(stages, program, loss_fn=fp.token_cross_entropy, data=copies)
    loss, grads = pipe.step(params, x, labels)
    ref_loss, ref_grads = full_batch(stages, params, x, labels)
    assert worst(loss, ref_loss) < TOL
    assert worst(grads, ref_grads) < TOL


@pytest.mark.parametrize("zero", [1, 2])
def test_sharded_data_copies_in_one_process(zero: int) -> None:
    """ZeRO in one process with a (sum, count) loss: copy 0's gradient pieces were scaled by the
    count factor twice (max error 1e-1); exact at zero=0 and over processes already."""
    program = generate("1f1b", ranks=2, microbatches=3)
    stages, params = model(2)
    x, labels = batch(12, seed=3)
    labels[:5] = -100
    pipe = fp.Pipeline(stages, program, loss_fn=fp.token_cross_entropy, data=2, zero=zero)
    result = pipe.step(pipe.shard(params), x, labels)
    ref_loss, ref_grads = full_batch(stages, params, x, labels)
    assert worst(result.loss, ref_loss) < TOL
    assert worst(pipe.gather(result.grads), ref_grads) < TOL


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["1f1b", "zbv", "interleaved"])
def test_two_gloo_processes(pool, name: str) -> None:
    """Pipeline over two processes (one copy): the full batch's loss and gradients."""
    worst_seen = pool(2).run(jobs_loss.token_loss_vs_full_batch, name, 2, 4)
    assert max(worst_seen) < TOL


@pytest.mark.timeout(180)
def test_two_copies_of_two_ranks_over_processes(pool) -> None:
    """Data 2 x pipeline 2 over four processes, each copy counting other tokens."""
    worst_seen = pool(4).run(jobs_loss.token_loss_vs_full_batch, "1f1b", 2, 2)
    assert max(worst_seen) < TOL


def test_loss_scale_and_a_metric_pair() -> None:
    """The loss scale still multiplies the gradients only; a metric may be a pair too."""
    program = generate("gpipe", ranks=2, microbatches=3)
    stages, params = model(2)
    x, labels = batch(9, seed=5)

    def accuracy(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keep = y != -100
        return ((logits.argmax(-1) == y) & keep).sum(), keep.sum()

    pipe = fp.Pipeline(stages, program, loss_fn=fp.token_cross_entropy, metric_fn=accuracy)
    res = pipe.step(params, x, labels, loss_scale=8.0)
    ref_loss, ref_grads = full_batch(stages, params, x, labels)
    assert worst(res.loss, ref_loss) < TOL
    assert worst([{k: v / 8 for k, v in g.items()} for g in res.grads], ref_grads) < TOL
    h = x
    for stage, p in zip(stages, params, strict=True):
        h = stage(p, h)
    keep = labels != -100
    assert float(res.metric) == pytest.approx(
        float(((h.argmax(-1) == labels) & keep).sum().double() / keep.sum()), abs=1e-15
    )


def test_an_eval_step_weights_by_counts() -> None:
    program = fp.schedule.to_eval(generate("1f1b", ranks=2, microbatches=4))
    stages, params = model(2)
    x, labels = batch(10, seed=9)
    loss, _ = fp.Pipeline(stages, program, loss_fn=fp.token_cross_entropy).step(params, x, labels)
    ref_loss, _ = full_batch(stages, params, x, labels)
    assert worst(loss, ref_loss) < TOL


def test_a_mix_of_pairs_and_scalars_is_refused() -> None:
    program = generate("1f1b", ranks=2, microbatches=2)
    stages, params = model(2)
    x, labels = batch(4)
    calls = {"n": 0}

    def flaky(logits: torch.Tensor, y: torch.Tensor):
        calls["n"] += 1
        pair = fp.token_cross_entropy(logits, y)
        return pair if calls["n"] % 2 else pair[0] / pair[1]

    with pytest.raises(InvalidArgument, match="one kind"):
        fp.Pipeline(stages, program, loss_fn=flaky).step(params, x, labels)
    calls["n"] = 0
    with pytest.raises(InvalidArgument, match="one kind"):
        fp.reference_step(stages, params, x, flaky, targets=labels, microbatches=2)


def test_nothing_counted_and_bad_counts_are_refused() -> None:
    program = generate("1f1b", ranks=2, microbatches=2)
    stages, params = model(2)
    x, labels = batch(4)
    pipe = fp.Pipeline(stages, program, loss_fn=fp.token_cross_entropy)
    with pytest.raises(InvalidArgument, match="counted 0 items"):
        pipe.step(params, x, torch.full_like(labels, -100))
    bad = fp.Pipeline(
        stages, program, loss_fn=lambda o, y: (fp.token_cross_entropy(o, y)[0], torch.ones(2))
    )
    with pytest.raises(InvalidArgument, match="count of shape"):
        bad.step(params, x, labels)
    three = fp.Pipeline(stages, program, loss_fn=lambda o, y: (*fp.token_cross_entropy(o, y), 1))
    with pytest.raises(InvalidArgument, match=r"\(sum, count\)"):
        three.step(params, x, labels)


@pytest.mark.parametrize("bad", [-3.0, float("inf"), float("nan")], ids=["negative", "inf", "nan"])
@pytest.mark.parametrize("kind", ["tensor", "float"])
def test_a_bad_count_on_one_microbatch_is_refused(bad: float, kind: str) -> None:
    """A count tensor of -3, inf or NaN on one microbatch returned a loss (a negative count
    offsets the others: a silently wrong mean and gradients)."""
    program = generate("1f1b", ranks=2, microbatches=2)
    stages, params = model(2)
    x, labels = batch(4)
    calls = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, object]:
        total, count = fp.token_cross_entropy(out, y)
        calls.append(1)
        if len(calls) % 2:
            return total, count
        return total, (torch.tensor(bad) if kind == "tensor" else bad)

    pipe = fp.Pipeline(stages, program, loss_fn=loss_fn)
    with pytest.raises(InvalidArgument, match="negative, infinite|>= 0 and finite"):
        pipe.step(params, x, labels)


def test_the_gpt_loss_with_ignore_index_gives_the_full_batch() -> None:
    """funcpipe's GPT over two stages (tied embedding), padded targets: gpt.loss_fn(...,
    ignore_index=-100) gives the whole model's F.cross_entropy(..., ignore_index=-100)."""
    from funcpipe.models import gpt

    cfg = gpt.GPTConfig(vocab=16, context=6, d_model=8, heads=2, layers=2, mlp=16)
    axis = gpt.single_axis()
    full = gpt.init(cfg, seed=0, dtype=torch.float64)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, cfg.vocab, (5, cfg.context + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    y[1:4, 2:] = -100  # padded rows: the microbatches count unevenly
    pipe = fp.Pipeline(
        gpt.stages(cfg, 2, axis=axis), generate("1f1b", ranks=2, microbatches=3),
        loss_fn=gpt.loss_fn(axis=axis, ignore_index=-100), ties=gpt.tie_spec(2),
    )  # fmt: skip
    loss, grads = pipe.step(gpt.split(full, cfg, 2), x, y)

    (whole,) = gpt.split(full, cfg, 1)
    leaves, spec = fp.tree.tree_flatten(whole)
    leaves = [t.clone().requires_grad_(True) for t in leaves]
    logits = gpt.stages(cfg, 1, axis=axis)[0](fp.tree.tree_unflatten(spec, leaves), x)
    ref = F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1), ignore_index=-100)
    ref_grads = fp.tree.tree_unflatten(spec, list(torch.autograd.grad(ref, leaves)))
    blocks = [ref_grads["blocks"][str(i)] for i in range(cfg.layers)]
    want = gpt.split({**ref_grads, "blocks": blocks}, cfg, 2)
    assert worst(loss, ref.detach()) < TOL
    assert worst(grads, want) < TOL


@pytest.mark.timeout(180)
def test_the_gpt_at_tensor_two_over_processes(pool) -> None:
    """Pipeline 2 x tensor 2 (four processes): every tensor rank holds the same count, and the
    gradient shards are those of the full batch's mean over its counted tokens."""
    assert max(pool(4).run(jobs_loss.gpt_tensor_parallel_token_loss, 2, 2)) < TOL
