"""Activation memory in bytes: peak_memory by hand and against peak_activations, and
measure_memory against tensors counted by hand."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funcpipe as fp
from funcpipe.errors import InvalidArgument
from funcpipe.measure.profile import measure_memory
from funcpipe.schedule import (
    GENERATORS,
    StageMemory,
    generate,
    parse_program,
    peak_activations,
    peak_memory,
)

TEXT = """
placement 0 1
microbatches 2
rank 0: F s0 m0; F s0 m1; I s0 m0; W s0 m0; I s0 m1; W s0 m1
rank 1: F s1 m0; I s1 m0; F s1 m1; W s1 m0; I s1 m1; W s1 m1
"""


def test_peak_memory_by_hand() -> None:
    program = parse_program(TEXT)
    # rank 0: 5, 10, 10-5+2=7, 5, 2, 0 -> 10; rank 1: 3, 1, 4, 3, 1, 0 -> 4
    assert peak_memory(program, [5, 3], [2, 1]) == (10.0, 4.0)
    # W keeping the whole activation: peak_activations weighted by size
    assert peak_memory(program, [5, 3]) == (10.0, 6.0)
    assert peak_memory(program, 1.0) == tuple(float(c) for c in peak_activations(program))


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(sorted(GENERATORS)),
    ranks=st.sampled_from([2, 4]),
    extra=st.integers(0, 4),
    size=st.integers(1, 1000),
)
def test_whole_activations_are_peak_activations_times_size(
    name: str, ranks: int, extra: int, size: int
) -> None:
    try:
        program = generate(name, ranks=ranks, microbatches=2 * ranks + 2 * extra)
    except InvalidArgument:
        return  # this generator does not take these sizes
    counts = peak_activations(program)
    assert peak_memory(program, size) == tuple(float(c * size) for c in counts)
    # leaving less for W never raises a rank's peak, nor drops it below one activation
    kept = peak_memory(program, size, size // 2)
    for k, c in zip(kept, counts, strict=True):
        assert (size if c else 0) <= k <= c * size


def test_peak_memory_rejects_bad_sizes() -> None:
    program = parse_program(TEXT)
    with pytest.raises(InvalidArgument, match=r"peak_memory\(activation=-1\).*>= 0"):
        peak_memory(program, -1)
    with pytest.raises(InvalidArgument, match="3 values but the program has 2 stages"):
        peak_memory(program, [1, 2, 3])
    with pytest.raises(InvalidArgument, match=r"peak_memory\(for_w=\[1, nan\]\)"):
        peak_memory(program, [5, 3], [1, float("nan")])


def _mlp_stage(width: int, layers: int) -> tuple[fp.Stage, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    params = []
    for _ in range(layers):
        params += [torch.randn(width, width, generator=g), torch.randn(width, generator=g)]

    def fn(ps: list[torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        for k in range(0, len(ps), 2):
            h = torch.nn.functional.gelu(torch.nn.functional.linear(h, ps[k], ps[k + 1]))
        return h

    return fp.Stage(fn), params


def test_measure_memory_counts_an_mlp_by_hand() -> None:
    rows, width, layers = 4, 16, 3
    stage, params = _mlp_stage(width, layers)
    x = torch.randn(rows, width)
    y = torch.randn(rows, width)
    got = measure_memory(
        [stage, stage], [params, params], x, loss_fn=torch.nn.functional.mse_loss, target=y
    )
    one = rows * width * 4  # one float32 activation of one microbatch
    # F: each layer saves its Linear's input and its GELU's input; the loss its two inputs.
    # W keeps what its roots (the Linears, where I met the weights) reach in autograd's graph.
    # Stage 0's input needs no gradient, so its I does nothing: W keeps the whole graph and the
    # output's gradient. Stage 1's I frees the loss and the last GELU; W keeps each Linear's
    # input, the GELU inputs below the last Linear (its input's branch reaches back through
    # them) and the gradient I recorded at each Linear.
    assert got == StageMemory(
        activation=(2 * layers * one, 2 * layers * one + 2 * one),
        for_w=((2 * layers + 1) * one, (layers + (layers - 1) + layers) * one),
    )


def test_measure_memory_general_path() -> None:
    """A parameter outside any Linear: W keeps the graph's branch towards it (here the input
    the product saved) and the gradient I recorded where that branch starts."""
    rows, width = 4, 8

    def fn(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h * p["a"])

    x = torch.randn(rows, width)
    got = measure_memory([fp.Stage(fn)] * 2, [{"a": torch.randn(width)}] * 2, x)
    one = rows * width * 4
    # F saves h (for the product's gradient towards "a") and tanh's output
    assert got.activation == (2 * one, 2 * one)
    # stage 0's input needs no gradient, so its I does nothing: W keeps the whole graph and
    # the output's gradient. Stage 1's I frees tanh's output; W keeps h, still held by the
    # branch towards "a", and the gradient I recorded at the product
    assert got.for_w == (3 * one, 2 * one)


def test_measure_memory_rejects_bad_arguments() -> None:
    stage, params = _mlp_stage(4, 1)
    with pytest.raises(InvalidArgument, match="measure_memory: 1 stage.*2 params"):
        measure_memory([stage], [params, params], torch.zeros(1, 4))
    with pytest.raises(InvalidArgument, match="measure_memory: loss_fn=3 is not callable"):
        measure_memory([stage], [params], torch.zeros(1, 4), loss_fn=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"measure_memory: stages\[0\]"):
        measure_memory([print], [params], torch.zeros(1, 4))
