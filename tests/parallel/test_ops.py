"""1D, vocab, sequence-parallel and ring-attention ops against one device, on gloo.

Every case: forward output, the gradient of every input and every weight, rank by rank and
gathered, equal the single-device computation with the same full weights (float64, 1e-10), and
each rank's traffic equals the op's closed form (tests/jobs_parallel.py). Hypothesis draws a batch
of cases per example; one pool round trip runs the whole batch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from funcpipe.errors import InvalidArgument
from funcpipe.parallel import Axis, ops
from tests import jobs_parallel as J
from tests.parallel.strategies import op_cases, ops_of, run_and_check, scaled

ONE_D = ops_of("1d")
SEQ = ops_of("sequence")


@pytest.mark.timeout(120)
@settings(max_examples=scaled(5))
@given(st.lists(op_cases(ONE_D + SEQ, 2), min_size=6, max_size=10))
def test_1d_and_sequence_ops_on_2_ranks(pool: Any, cases: list[dict[str, Any]]) -> None:
    run_and_check(pool, 2, cases)


@pytest.mark.timeout(120)
@settings(max_examples=scaled(5))
@given(st.lists(op_cases(ONE_D + SEQ, 4, min_size=2), min_size=6, max_size=10))
def test_1d_and_sequence_ops_on_4_ranks(pool: Any, cases: list[dict[str, Any]]) -> None:
    run_and_check(pool, 4, cases)


@pytest.mark.timeout(120)
@settings(max_examples=scaled(2))
@given(st.lists(op_cases(ONE_D + SEQ, 8, min_size=4), min_size=4, max_size=6))
def test_1d_and_sequence_ops_on_8_ranks(pool: Any, cases: list[dict[str, Any]]) -> None:
    run_and_check(pool, 8, cases)


@pytest.mark.timeout(120)
def test_every_op_once_on_4_ranks(pool: Any) -> None:
    """Each op at least once with the largest tensor size, causal attention included."""
    dims = {
        "b": 2,
        "s": 8,
        "i": 4,
        "o": 8,
        "v": 12,
        "d": 3,
        "h": 4,
        "e": 2,
        "f": 8,
        "w": 2,
        "causal": 1,
    }
    cases = [
        {
            "op": name,
            "config": {"tensor": {"size": 4, "mode": J.OPS[name].mode}},
            "dims": dims,
            "seed": k,
        }
        for k, name in enumerate(sorted(ONE_D + SEQ))
    ]
    run_and_check(pool, 4, cases)


# ------------------------------------------------------------------------------ errors (no processes)
AX = Axis("tensor", 4, 0, None)


def test_heads_must_split_evenly() -> None:
    x = torch.zeros(1, 2, 12)
    with pytest.raises(
        InvalidArgument, match="num_heads=6 is not divisible by the tensor axis size 4"
    ):
        ops.parallel_attention(x, {}, axis=AX, num_heads=6)
    with pytest.raises(
        InvalidArgument, match="num_heads=5 must be a positive int dividing the model width d=12"
    ):
        ops.attention_block(
            x, {"norm": {"weight": torch.ones(12), "bias": torch.zeros(12)}}, axis=AX, num_heads=5
        )


def test_cross_entropy_checks_targets() -> None:
    logits = torch.zeros(2, 3, 5)
    with pytest.raises(
        InvalidArgument,
        match=r"target shape \(2,\) must be the logits shape without its last dim, \(2, 3\)",
    ):
        ops.vocab_parallel_cross_entropy(logits, torch.zeros(2, dtype=torch.long), axis=AX)
    with pytest.raises(InvalidArgument, match="integer ids; got torch.float32"):
        ops.vocab_parallel_cross_entropy(logits, torch.zeros(2, 3), axis=AX)


def test_ring_attention_checks_shapes() -> None:
    q = torch.zeros(1, 2, 4, 3)
    with pytest.raises(
        InvalidArgument, match=r"one shape \[..., s/t, e\]; got \(1, 2, 4, 3\), \(1, 2, 4, 2\)"
    ):
        ops.ring_attention(q, q[..., :2], q, axis=AX)


def test_sharded_shapes_are_checked_with_the_pattern() -> None:
    x = torch.zeros(2, 3, 5)
    with pytest.raises(
        InvalidArgument,
        match=r"pattern '\.\.\. i, o i -> \.\.\. o'.*local shapes \[\(2, 3, 5\), \(2, 4\)\]",
    ):
        ops.column_parallel_linear(x, {"weight": torch.zeros(2, 4)}, axis=AX)
