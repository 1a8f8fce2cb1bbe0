"""funcpipe.train.data: the offline corpus and its deterministic, rank-disjoint batches."""

from __future__ import annotations

import sysconfig

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from funcpipe.errors import InvalidArgument
from funcpipe.train import data
from funcpipe.train.data import load_corpus

SMALL = 60_000


@pytest.fixture(scope="module")
def corpus() -> data.Corpus:
    return load_corpus(max_bytes=SMALL)


def test_the_default_corpus_is_stdlib_source_split_90_10() -> None:
    c = load_corpus()
    assert c.source == "stdlib" and c.vocab_size == 256
    assert c.train.dtype == c.val.dtype == torch.uint8
    total = c.train.numel() + c.val.numel()
    assert 2_000_000 < total <= 3_000_000
    assert c.val.numel() == int(total * 0.1)
    assert list(c.files) == sorted(c.files) and all(f.endswith(".py") for f in c.files)
    assert not any(f.startswith(("site-packages/", "test/")) for f in c.files)
    assert "def " in c.decode(c.train[:20_000])
    assert "Corpus(source='stdlib'" in repr(c)


def test_the_corpus_is_deterministic_and_seeded() -> None:
    a = load_corpus(max_bytes=SMALL, seed=1)
    data._stdlib_text.cache_clear()
    b = load_corpus(max_bytes=SMALL, seed=1)
    assert a.fingerprint == b.fingerprint and torch.equal(a.train, b.train)
    assert load_corpus(max_bytes=SMALL, seed=2).fingerprint != a.fingerprint
    a.train[0] = 0  # each call returns its own tensors
    assert not torch.equal(a.train, load_corpus(max_bytes=SMALL, seed=1).train)


def test_generated_text_when_the_stdlib_sources_are_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": "/nonexistent"})
    data._stdlib_text.cache_clear()
    try:
        c = load_corpus(max_bytes=5000)
        assert c.source == "generated" and c.files == ()
        assert c.train.numel() + c.val.numel() == 5000
        assert c.fingerprint == load_corpus(max_bytes=5000, source="generated").fingerprint
        with pytest.raises(InvalidArgument, match="source='stdlib'"):
            load_corpus(max_bytes=5000, source="stdlib")
    finally:
        data._stdlib_text.cache_clear()


def test_targets_are_the_tokens_shifted_by_one(corpus: data.Corpus) -> None:
    x, y = corpus.get_batch("train", 3, batch=5, context=32, seed=0)
    assert x.shape == y.shape == (5, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.min()) >= 0 and int(x.max()) < corpus.vocab_size


def test_batches_are_a_function_of_seed_and_step(corpus: data.Corpus) -> None:
    get = corpus.get_batch
    a = get("train", 7, batch=4, context=16, seed=0)
    assert all(
        torch.equal(u, v)
        for u, v in zip(a, get("train", 7, batch=4, context=16, seed=0), strict=True)
    )
    assert not torch.equal(a[0], get("train", 8, batch=4, context=16, seed=0)[0])
    assert not torch.equal(a[0], get("train", 7, batch=4, context=16, seed=1)[0])
    # the iterator yields get_batch step after step, and resumes at any step
    it = list(corpus.batches("val", batch=2, context=8, seed=3, steps=5))
    resumed = list(corpus.batches("val", batch=2, context=8, seed=3, start=2, steps=3))
    for k, (x, y) in enumerate(it):
        ex, ey = get("val", k, batch=2, context=8, seed=3)
        assert torch.equal(x, ex) and torch.equal(y, ey)
    assert all(torch.equal(r[0], i[0]) for r, i in zip(resumed, it[2:], strict=True))


def test_targets_follow_the_window_starts(corpus: data.Corpus) -> None:
    kw = {"batch": 3, "context": 16, "seed": 2}
    x, y = corpus.get_batch("val", 4, **kw)
    text = corpus.val.to(torch.int64)
    for s, row, target in zip(corpus.window_starts("val", 4, **kw).tolist(), x, y, strict=True):
        assert torch.equal(row, text[s : s + 16]) and torch.equal(target, text[s + 1 : s + 17])


@given(
    data_size=st.integers(1, 4),
    batch=st.integers(1, 6),
    context=st.integers(4, 64),
    step=st.integers(0, 500),
)
def test_data_ranks_get_disjoint_shares_of_one_global_batch(
    corpus: data.Corpus, data_size: int, batch: int, context: int, step: int
) -> None:
    kw = {"batch": batch, "context": context, "seed": 0, "data_size": data_size}
    shares = [corpus.get_batch("train", step, data_rank=r, **kw) for r in range(data_size)]
    whole = corpus.get_batch("train", step, batch=batch * data_size, context=context, seed=0)
    assert torch.equal(torch.cat([x for x, _ in shares]), whole[0])
    assert torch.equal(torch.cat([y for _, y in shares]), whole[1])
    # no two windows of the step overlap, so no two ranks share a token position
    starts = torch.cat(
        [corpus.window_starts("train", step, data_rank=r, **kw) for r in range(data_size)]
    )
    gaps = (starts[:, None] - starts[None, :]).abs() + context * torch.eye(
        len(starts), dtype=torch.int64
    )
    assert bool((gaps >= context).all())


def test_one_epoch_visits_each_window_once(corpus: data.Corpus) -> None:
    context, batch, size = 64, 4, 2
    kw = {"batch": batch, "context": context, "seed": 5, "data_size": size}
    steps = corpus.steps_per_epoch("train", batch=batch, context=context, data_size=size)
    windows = corpus.windows("train", context=context)
    assert steps == windows // (batch * size) > 10
    starts = torch.cat(
        [
            corpus.window_starts("train", k, data_rank=r, **kw)
            for k in range(steps)
            for r in range(size)
        ]
    )
    assert starts.unique().numel() == steps * batch * size
    assert len({int(s) % context for s in starts}) == 1  # one grid per epoch
    assert int(starts.max()) + context + 1 <= corpus.train.numel()
    # the next epoch has its own order (and grid)
    nxt = corpus.window_starts("train", steps, **kw)
    assert not torch.equal(nxt, corpus.window_starts("train", 0, **kw))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"split": "test"}, "split"),
        ({"step": -1}, "step"),
        ({"batch": 0}, "batch"),
        ({"context": 0}, "context"),
        ({"data_rank": 2, "data_size": 2}, "data_rank"),
        ({"data_size": 0}, "data_size"),
        ({"seed": 1.5}, "seed"),
        ({"batch": 10_000, "context": 64}, "batch"),
    ],
)
def test_bad_batch_arguments_are_named(corpus: data.Corpus, kwargs: dict, name: str) -> None:
    args = {"split": "train", "step": 0, "batch": 2, "context": 8, "seed": 0} | kwargs
    split, step = args.pop("split"), args.pop("step")
    with pytest.raises(InvalidArgument, match=name):
        corpus.get_batch(split, step, **args)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_bytes": 10}, "max_bytes"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"source": "web"}, "source"),
        ({"seed": "0"}, "seed"),
    ],
)
def test_bad_corpus_arguments_are_named(kwargs: dict, name: str) -> None:
    with pytest.raises(InvalidArgument, match=name):
        load_corpus(**kwargs)
