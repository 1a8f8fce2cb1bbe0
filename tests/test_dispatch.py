"""The ops a GPT block dispatches, pinned as a ceiling (a ratchet: a change may lower these
numbers, never silently raise them). Counts are deterministic for one torch version; the times
they cost on a GPU are in benchmarks/dispatch.py and docs/benchmarks.md, not here."""

from __future__ import annotations

import pytest
import torch

from benchmarks import dispatch

# funcpipe's block (attention + MLP, forward + backward, tensor size 1) at dispatch.TINY: at most
# this many ATen ops / casts. The independent nanoGPT-style block, measured beside it, is the aim.
CEILING = {"fp32-autocast": (219, 31), "bf16": (188, 0), "fp32": (188, 0)}
STEP_CEILING = (
    43013  # Pipeline.step of the demo's large size (24 blocks x 8 microbatches, tiny width)
)


@pytest.mark.parametrize("precision", dispatch.PRECISIONS)
def test_a_blocks_ops_do_not_grow(precision: str) -> None:
    torch.set_num_threads(1)
    got = dispatch.count_block("funcpipe", dispatch.TINY, precision)
    ops, casts = CEILING[precision]
    assert got.ops <= ops and got.casts <= casts, (
        f"funcpipe's GPT block now dispatches {got.ops} ATen ops ({got.casts} casts) in "
        f"{precision}, over the ceiling of {ops} ({casts}): {dict(got.by_op.most_common(8))}"
    )


@pytest.mark.parametrize("precision", dispatch.PRECISIONS)
def test_a_block_is_within_a_tenth_of_the_nanogpt_block(precision: str) -> None:
    """Issue 41's target: ATen ops and non-matmul bytes (the demo's shapes) <= 1.1x those of the
    independent nanoGPT-style block, in the same precision."""
    torch.set_num_threads(1)
    ours, ref = (dispatch.count_block(b, dispatch.TINY, precision) for b in ("funcpipe", "nanogpt"))
    assert ours.ops <= 1.1 * ref.ops, (ours.ops, ref.ops)
    ours, ref = (
        dispatch.count_block(b, dispatch.LARGE, precision, fake=True)
        for b in ("funcpipe", "nanogpt")
    )
    assert ours.nonmatmul_bytes <= 1.1 * ref.nonmatmul_bytes, (
        ours.nonmatmul_bytes,
        ref.nonmatmul_bytes,
    )


def test_the_counter_sees_forward_and_backward() -> None:
    step = dispatch.block_step("nanogpt", dispatch.TINY, "fp32")
    step()
    with dispatch.OpCounter() as counter:
        step()
    c = counter.count
    assert c.by_op["native_layer_norm"] == 2 and c.by_op["native_layer_norm_backward"] == 2
    assert c.by_op["gelu"] == 1 and c.by_op["gelu_backward"] == 1
    assert c.casts == 0 and c.ops == sum(c.by_op.values())


def test_fake_tensors_count_the_bytes_of_the_real_shapes() -> None:
    """At the demo's shapes the float32 MLP's GELU alone reads and writes its [b, s, 4d] input
    and output: the non-matmul bytes are at least that, and no real memory is used."""
    got = dispatch.count_block("nanogpt", dispatch.LARGE, "fp32", fake=True)
    s = dispatch.LARGE
    gelu = 2 * s.batch * s.seq * 4 * s.d_model * 4
    assert got.nonmatmul_bytes > gelu and got.by_op["gelu"] == 1


def test_a_pipeline_steps_ops_do_not_grow() -> None:
    torch.set_num_threads(1)
    got = dispatch.count_pipeline_step("large")
    assert got["ops"] <= STEP_CEILING, got
