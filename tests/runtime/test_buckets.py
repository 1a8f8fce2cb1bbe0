"""Bucketed data-parallel reduction: one all-reduce per ~25 MB bucket of same-dtype gradients,
last leaf first, exactly the per-leaf sums (issue 32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from funcpipe.runtime import buckets
from funcpipe.testing import assert_trees_close
from funcpipe.tree import tree_flatten
from tests import jobs_buckets

DTYPES = [torch.float64, torch.float32, torch.bfloat16]


def test_the_default_cap_is_ddps_25_mb() -> None:
    assert buckets.BUCKET_BYTES == 25 * 2**20


def test_plan_groups_by_dtype_in_order_up_to_the_cap() -> None:
    f64 = [torch.zeros(10, dtype=torch.float64) for _ in range(3)]  # 80 bytes each
    f32 = torch.zeros(4, dtype=torch.float32)
    big = torch.zeros(100, dtype=torch.float64)
    tensors = [f64[0], f32, f64[1], big, f64[2]]
    group = buckets.bucket_indices
    assert group(tensors, cap=1000) == [[0, 2, 3], [1], [4]]  # 960 bytes, then full
    assert group(tensors, cap=160) == [[0, 2], [1], [3], [4]]  # big alone, over the cap
    assert group(tensors, cap=0) == [[0], [1], [2], [3], [4]]  # per leaf
    assert group(tensors) == [[0, 2, 3, 4], [1]]


@given(
    st.lists(st.tuples(st.sampled_from(range(3)), st.integers(0, 40)), max_size=12),
    st.integers(0, 400),
)
def test_buckets_cover_every_tensor_once_and_round_trip(
    specs: list[tuple[int, int]], cap: int
) -> None:
    tensors = [torch.arange(n, dtype=DTYPES[k]) + i for i, (k, n) in enumerate(specs)]
    groups = buckets.bucket_indices(tensors, cap=cap)
    assert sorted(i for b in groups for i in b) == list(range(len(tensors)))
    assert [b[0] for b in groups] == sorted(b[0] for b in groups)
    for b in groups:
        assert b == sorted(b) and len({tensors[i].dtype for i in b}) == 1
        nbytes = sum(tensors[i].numel() * tensors[i].element_size() for i in b)
        assert len(b) == 1 or nbytes <= cap
    before = [t.clone() for t in tensors]
    for bucket in buckets.buckets(tensors, cap):
        bucket.flat.mul_(2)  # what a sum over two equal ranks does
        bucket.unflatten()
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t, b * 2)


CAPS = [0, 400, buckets.BUCKET_BYTES]  # per leaf; two float64 buckets; one per dtype


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("copies", "strict"), [(2, False), (4, False), (2, True)])
def test_bucketed_sums_are_the_per_leaf_sums_and_the_reference(
    pool: Any, copies: int, strict: bool
) -> None:
    out = pool(copies).run(jobs_buckets.data_reduce_under_caps, CAPS, strict)
    _, params = jobs_buckets.mixed_stage()
    names, leaves = ["a", "b", "c", "d"], [params[k] for k in ["a", "b", "c", "d"]]
    assert all(a is b for a, b in zip(tree_flatten(params)[0], leaves, strict=True))  # name order
    for rank in out:
        per_leaf, two, one = rank["runs"]
        # last leaf first: d, c, b, a, one all-reduce each
        assert per_leaf["calls"] == [
            (leaves[i].numel(), str(leaves[i].dtype)) for i in (3, 2, 1, 0)
        ], names
        # 400 bytes: d (288) and b (48) share a bucket, a (288) would overflow it: alone
        assert two["calls"] == [(42, "torch.float64"), (5, "torch.float32"), (36, "torch.float64")]
        # the default: one bucket per dtype, in the order of their first (last) leaf
        assert one["calls"] == [(78, "torch.float64"), (5, "torch.float32")]
        for run in (two, one):
            for k in names:
                got, want = run["grads"][k], per_leaf["grads"][k]
                if copies == 2:  # a + b wherever it sits in the buffer: bit for bit
                    assert torch.equal(got, want), (run["cap"], k)
                else:  # the ring may add the ranks in another order at another offset
                    tol = 1e-12 if got.dtype == torch.float64 else 1e-6
                    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
            assert run["loss"] == per_leaf["loss"]
        ref_loss, ref_grads = rank["reference"]
        assert_trees_close(one["grads"], ref_grads)
        assert one["loss"] == pytest.approx(ref_loss, rel=1e-12)
    for k in names:  # every copy holds the same sums
        assert all(
            torch.equal(r["runs"][2]["grads"][k], out[0]["runs"][2]["grads"][k]) for r in out
        )


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("pipeline", "tensor"), [(2, 1), (1, 2)])
def test_the_gpt_with_ties_and_tensor_parallelism_is_unchanged_by_buckets(
    pool: Any, pipeline: int, tensor: int
) -> None:
    """Four processes, two data-parallel copies: the demo's GPT (tied embeddings across the
    pipeline; or tensor-parallel blocks) gets the same gradients per leaf and in buckets."""
    results = pool(4).run(
        jobs_buckets.gpt_under_caps, pipeline, tensor, [0, 4096, buckets.BUCKET_BYTES]
    )
    for per_leaf, small, default in results:
        for got in (small, default):
            for g, r in zip(got, per_leaf, strict=True):
                if r is None:
                    assert g is None
                    continue
                a, b = tree_flatten(g)[0], tree_flatten(r)[0]
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
