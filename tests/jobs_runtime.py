"""Models, references and pool jobs shared by the runtime tests (importable by pool workers)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import funcpipe as fp
from funcpipe.pipeline.microbatch import split
from funcpipe.pipeline.pipeline import Pipeline
from funcpipe.schedule.generators import GENERATORS, generate
from funcpipe.schedule.ir import Instr, Program
from funcpipe.stages.stage import Stage, as_inputs
from funcpipe.testing import assert_trees_close

D = 6  # width of the toy models
TRAINING = [name for name in GENERATORS if name != "forward"]  # every training schedule
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]  # device-parameterised tests
F64 = torch.float64


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def accuracy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.argmax(-1) == y.argmax(-1)).double().mean()


def _first(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ params["E"] + params["b"])


def _middle(params: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ params["W"] + params["b"])


def _last(params: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return h @ params["E"].T  # tied with the first stage's E when ties are declared


def toy(
    n: int, *, seed: int = 0, tied: bool = False
) -> tuple[list[Stage], list[dict[str, torch.Tensor]]]:
    """``n`` function stages over width D; with ``tied`` the first and last use an ``E`` each."""
    g = torch.Generator().manual_seed(seed)

    def t(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, dtype=F64) / shape[0] ** 0.5).requires_grad_(False)

    stages: list[Stage] = []
    params: list[dict[str, torch.Tensor]] = []
    for k in range(n):
        if tied and n > 1 and k == 0:
            stages.append(Stage(_first, name="first"))
            params.append({"E": t(D, D), "b": t(D)})
        elif tied and n > 1 and k == n - 1:
            stages.append(Stage(_last, name="last"))
            params.append({"E": params[0]["E"].clone()})
        else:
            stages.append(Stage(_middle, name=f"mid{k}"))
            params.append({"W": t(D, D), "b": t(D)})
    return stages, params


def data(batch: int, *, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, D, generator=g, dtype=F64), torch.randn(
        batch, D, generator=g, dtype=F64
    )


def tied_reference(
    stages: Sequence[Stage],
    params: Sequence[Any],
    x: torch.Tensor,
    y: torch.Tensor,
    m: int,
    ties: dict[str, list[tuple[int, str]]] | None,
) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """reference_step, with the gradients of tied parameters summed (one parameter used twice)."""
    loss, grads = fp.reference_step(stages, params, x, mse, targets=y, microbatches=m)
    grads = [dict(g) for g in grads]
    for members in (ties or {}).values():
        total = sum(grads[s][k] for s, k in members)
        for s, k in members:
            grads[s][k] = total
    return loss, tuple(grads)


def graph_reference(
    program: Program,
    stages: Sequence[Stage],
    params: Sequence[Any],
    batch: dict[str, torch.Tensor],
    y: torch.Tensor,
    side_inputs: dict[int, list[str]],
    loss_fn: Callable[..., torch.Tensor] = mse,
) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """Plain autograd over a stage graph with side inputs, microbatch by microbatch."""
    m = program.microbatches
    leaves = [fp.tree.tree_map(lambda t: t.detach().requires_grad_(), p) for p in params]
    flat = [t for p in leaves for t in fp.tree.tree_leaves(p)]
    grads = [torch.zeros_like(t) for t in flat]
    total = torch.zeros((), dtype=F64)
    mbs, ys = split(batch, m), split(y, m)
    for mb, ym in zip(mbs, ys, strict=True):
        outs: dict[int, Any] = {}
        for s in range(program.n_stages):
            prods = program.producers(s)
            args = (
                as_inputs(mb["inputs"])
                if not prods
                else tuple(a for p in prods for a in as_inputs(outs[p]))
            )
            kw = {k: mb[k] for k in side_inputs.get(s, [])}
            outs[s] = stages[s](leaves[s], *args, **kw)
        loss = loss_fn(outs[program.n_stages - 1], ym)
        total = total + loss.detach()
        for k, g in enumerate(torch.autograd.grad(loss / m, flat, allow_unused=True)):
            if g is not None:
                grads[k] = grads[k] + g
    out, k = [], 0
    for p in params:
        ls, tree = fp.tree.tree_flatten(p)
        out.append(fp.tree.tree_unflatten(tree, grads[k : k + len(ls)]))
        k += len(ls)
    return total / m, tuple(out)


def one_by_one_1f1b() -> Program:
    """2-rank 1F1B lowered with every SEND and RECV posted on its own: gloo runs it, NCCL hangs."""
    program = generate("1f1b", ranks=2, microbatches=4)
    from funcpipe.schedule.ir import Op, recv, send

    ranks: list[list[Instr]] = [[], []]
    for r, instrs in enumerate(program.ranks):
        for i in instrs:
            m = i.microbatch
            if r == 1 and i.op is Op.F:
                ranks[1].append(recv("act", (0, 1), m, 0))
            if r == 0 and i.op is Op.B:
                ranks[0].append(recv("grad", (0, 1), m, 1))
            ranks[r].append(i)
            if r == 0 and i.op is Op.F:
                ranks[0].append(send("act", (0, 1), m, 1))
            if r == 1 and i.op is Op.B:
                ranks[1].append(send("grad", (0, 1), m, 0))
    return program.replace(ranks=tuple(tuple(r) for r in ranks))


def run_pipeline_vs_reference(
    rank: int,
    name: str,
    ranks: int,
    microbatches: int,
    batches: Sequence[int],
    *,
    recompute: bool = False,
    tied: bool = False,
    chunks: int | None = None,
    split_all: bool = False,
    strict: bool = False,
    overlap: bool = False,
) -> float:
    """Train-step ``batches`` (sizes) through ``name`` and compare with the reference; returns
    the largest difference seen (the caller asserts). Runs on 'dist' inside a pool, else 'local'."""
    program = generate(name, ranks=ranks, microbatches=microbatches, chunks=chunks, overlap=overlap)
    if split_all:
        from funcpipe.schedule.passes import split_backward

        program = split_backward(program)
    n = len(set(program.replica_of or ()))
    stages, params = toy(n, tied=tied)
    ties = {"E": [(0, "E"), (n - 1, "E")]} if tied and n > 1 else None
    if strict:  # NCCL's point-to-point rules enforced by the transport
        os.environ["FUNCPIPE_STRICT_P2P"] = "1"
    try:
        pipe = Pipeline(stages, program, loss_fn=mse, ties=ties, recompute=recompute)
    finally:
        os.environ.pop("FUNCPIPE_STRICT_P2P", None)
    worst = 0.0
    for b, size in enumerate(batches):
        x, y = data(size, seed=b + 1)
        loss, grads = pipe.step(params, x, y)
        ref_loss, ref_grads = tied_reference(stages, params, x, y, microbatches, ties)
        assert_trees_close(loss, ref_loss)
        local = tuple(g if g is not None else r for g, r in zip(grads, ref_grads, strict=True))
        assert_trees_close(local, ref_grads)
        worst = max(worst, float((loss - ref_loss).abs()))
    return worst


def raise_in_step(rank: int, bad_rank: int, where: str) -> str:
    """A 2-rank 1F1B step where ``bad_rank`` raises in its forward or backward (a stage fn that
    raises at the right moment)."""
    program = generate("1f1b", ranks=2, microbatches=4)
    stages, params = toy(2)
    calls = {"n": 0}

    def bad(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if where == "forward" and calls["n"] == 3:
            raise ValueError(f"injected failure in the forward of rank {rank}")
        out = _middle(p, h)
        if where == "backward" and out.requires_grad:

            def hook(g: torch.Tensor) -> torch.Tensor:
                raise ValueError(f"injected failure in the backward of rank {rank}")

            out.register_hook(hook)
        return out

    if rank == bad_rank:
        stages[rank] = Stage(bad, name="bad")
    pipe = Pipeline(stages, program, loss_fn=mse)
    x, y = data(8)
    pipe.step(params, x, y)
    return "finished"


def data_parallel_vs_reference(rank: int, name: str, ranks: int, microbatches: int) -> float:
    """World = copies x ranks; each copy trains on its contiguous share of the batch."""
    import torch.distributed as dist

    program = generate(name, ranks=ranks, microbatches=microbatches)
    stages, params = toy(ranks)
    copies = dist.get_world_size() // ranks
    pipe = Pipeline(stages, program, loss_fn=mse)
    x, y = data(4 * copies)
    copy = rank % copies  # world rank = program rank * copies + copy
    shard = slice(copy * 4, (copy + 1) * 4)
    loss, grads = pipe.step(params, x[shard], y[shard])
    ref_loss, ref_grads = fp.reference_step(
        stages, params, x, mse, targets=y, microbatches=microbatches * copies
    )
    local = tuple(g if g is not None else r for g, r in zip(grads, ref_grads, strict=True))
    assert_trees_close(local, ref_grads)
    assert_trees_close(loss, ref_loss)  # the loss of the whole batch, on every rank
    return float(
        max(
            (a - b).abs().max()
            for g, r in zip(local, ref_grads, strict=True)
            for a, b in zip(g.values(), r.values(), strict=True)
        )
    )


def traced_step(rank: int) -> list[float]:
    program = generate("1f1b", ranks=2, microbatches=4)
    stages, params = toy(2)
    x, y = data(8)
    res = Pipeline(stages, program, loss_fn=mse).step(params, x, y, trace=True)
    tl = res.timeline
    assert [len(r) for r in tl.events] == [len(r) for r in tl.program.ranks]
    return [tl.makespan, tl.bubble_fraction]


def tune_agrees_across_ranks(rank: int) -> tuple[int, list[float]]:
    """``funcpipe.measure.tune.fastest`` over gloo: candidate 0 is slow on rank 0 only (0.3 s),
    candidate 1 slow on rank 1 only (0.6 s), candidate 2 a real auto program (milliseconds,
    far below either even on a loaded machine). Every rank must pick by the slowest rank's
    time: candidate 2 everywhere, though rank 0 alone would see candidate 1 as fast as 2.
    Then 0 vs 1 alone: candidate 0 (0.3 s < 0.6 s) on both ranks."""
    import time

    from funcpipe.measure.tune import fastest
    from funcpipe.schedule.auto import auto_candidates

    stages, params = toy(2)
    x, y = data(8)
    cands = auto_candidates(ranks=2, microbatches=4, max_activations=2, count=3)
    pipes = [Pipeline(stages, c, loss_fn=mse, transport="dist") for c in cands]
    delay = {(0, 0): 0.3, (1, 1): 0.6}

    def step(k: int) -> None:
        time.sleep(delay.get((rank, k), 0.0))
        if k == 2:
            pipes[0].step(params, x, y)

    progs = [cands[0].replace(name="slow-on-0"), cands[1].replace(name="slow-on-1"), cands[0]]
    index = {id(p): k for k, p in enumerate(progs)}
    got = fastest(progs, lambda p: step(index[id(p)]), rounds=1, warmup=1)
    pair = fastest(progs[:2], lambda p: step(index[id(p)]), rounds=1, warmup=0)
    return (got.index * 10 + pair.index, list(got.medians))


@contextmanager
def count_left_for_w(counter: Any) -> Iterator[None]:
    """Count in ``counter`` what each I keeps outside autograd's graph for its W (the gradients
    recorded where W starts), from the I until the W, as ``measure_memory`` counts it."""
    from funcpipe.measure.profile import _left_for_w
    from funcpipe.runtime import autodiff

    real_i, real_w = autodiff.backward_input, autodiff.backward_weight
    held: dict[int, list[Any]] = {}

    def backward_input(saved: Any, *args: Any, **kw: Any) -> Any:
        got = real_i(saved, *args, **kw)
        held[id(saved)] = [counter.hold(t) for t in _left_for_w(saved)]
        return got

    def backward_weight(saved: Any, *args: Any, **kw: Any) -> Any:
        for key, t in held.pop(id(saved), []):
            counter.release(key, t)
        return real_w(saved, *args, **kw)

    autodiff.backward_input, autodiff.backward_weight = backward_input, backward_weight
    try:
        yield
    finally:
        autodiff.backward_input, autodiff.backward_weight = real_i, real_w


def auto_bytes_step(rank: int) -> tuple[int, float, float]:
    """An ``auto`` program searched under a limit in bytes (``measure_memory`` of the real
    stages; the last also keeps the loss's inputs), one step over gloo checked against the
    single-device reference, one with every saved byte counted (as ``benchmarks/memory.py``
    does): (measured peak, peak_memory's figure, limit)."""
    from funcpipe.measure.profile import measure_memory
    from funcpipe.runtime.saved import SavedBytes
    from funcpipe.schedule import auto, peak_memory

    stages, params = toy(4)
    x, y = data(16)
    mem = measure_memory(stages, params, x[:2], loss_fn=mse, target=y[:2])
    weights = [max(a, k) for a, k in zip(mem.activation, mem.for_w, strict=True)]
    least = [weights[0] + weights[3], weights[1] + weights[2]]  # V: stages (0, 3) and (1, 2)
    caps = [c + 2 * weights[0] for c in least]
    program = auto(ranks=2, microbatches=8, placement="v", memory=mem, max_memory=caps)
    pipe = Pipeline(stages, program, loss_fn=mse, transport="dist")
    got = pipe.step(params, x, y)
    loss, grads = fp.reference_step(stages, params, x, mse, targets=y, microbatches=8)
    mine = [s for s in range(4) if program.placement[s] == rank]
    assert_trees_close((got.loss, [got.grads[s] for s in mine]), (loss, [grads[s] for s in mine]))
    flat = [t for p in params for t in p.values()]
    with SavedBytes(flat) as counter, count_left_for_w(counter):
        pipe.step(params, x, y)
    figure = peak_memory(program, mem.activation, mem.for_w)[rank]
    return counter.peak, figure, caps[rank]


def value_dependent_width(rank: int, held_everywhere: bool) -> str:
    """Stage 0 keeps the first ``int(keep)`` columns (``.item()``: it cannot run on tensors
    without data, so shape inference runs it on one real microbatch). Rank 1 does not hold stage
    0's parameters unless ``held_everywhere``: it runs it on zeros and would expect 0 columns
    where rank 0 sends 4. Returns "ok" after a step, else the error."""
    program = generate("1f1b", ranks=2, microbatches=2)

    def narrow(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ p["W"])[:, : int(p["keep"].item())]

    def head(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return h.sum(-1, keepdim=True) * p["w"]

    stages = [Stage(narrow, name="narrow"), Stage(head, name="head")]
    first = {"W": torch.randn(D, D, dtype=F64), "keep": torch.tensor(4.0, dtype=F64)}
    if rank == 1 and not held_everywhere:
        first = {k: v.to("meta") for k, v in first.items()}
    params = [first, {"w": torch.ones(1, dtype=F64)}]
    pipe = Pipeline(stages, program, loss_fn=mse, transport="dist")
    x, _ = data(4)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fp.ShapeInferenceWarning)
            pipe.step(params, x, torch.zeros(4, 1, dtype=F64))
    except fp.InvalidArgument as e:
        return str(e)
    finally:
        pipe.close()
    return "ok"


def inference_fails_on_one_rank(rank: int) -> str:
    """Rank 1's copy of stage 0 fails on any input (fake or real); rank 0's works. Both must
    raise (rank 0 must not wait in a collective rank 1 never joins); returns the error."""
    program = generate("1f1b", ranks=2, microbatches=2)

    def broken(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        raise ValueError("this stage cannot run")

    stages, params = toy(2)
    if rank == 1:
        stages[0] = Stage(broken, name="broken")
    pipe = Pipeline(stages, program, loss_fn=mse, transport="dist")
    x, y = data(4)
    try:
        pipe.step(params, x, y)
    except fp.FuncpipeError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        pipe.close()
    return "ok"


def batches_per_rank(rank: int, sizes: Sequence[Sequence[tuple[int, ...]]]) -> str:
    """A 2-rank 1F1B pipeline stepped with ``sizes[step][rank]``, the shape of this rank's
    batch (and targets) at each step without the width: (samples,) or (samples, length).
    Returns "ok" after the last step, else the error."""
    program = generate("1f1b", ranks=2, microbatches=2)
    stages, params = toy(2)
    pipe = Pipeline(stages, program, loss_fn=mse, transport="dist")
    try:
        for step in sizes:
            shape = step[rank]
            x = torch.randn(*shape, D, dtype=F64)
            pipe.step(params, x, torch.randn_like(x))
    except fp.FuncpipeError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        pipe.close()
    return "ok"


def agreement_calls(rank: int, sizes: Sequence[int]) -> list[tuple[str, int]]:
    """A 2-rank 1F1B pipeline stepped with batches of ``sizes`` samples (the same on both
    ranks); the all-gathers and all-reduces each step made (name, elements), counted around
    torch.distributed's functions (the construction's own agreement not counted)."""
    import torch.distributed as dist

    names = ("all_gather", "all_gather_single", "all_gather_into_tensor", "all_reduce")
    real = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
    calls: list[tuple[str, int]] = []

    def counting(name: str) -> Any:
        def counted(*a: Any, **kw: Any) -> Any:
            calls.append((name, a[0].numel() if name == "all_reduce" else a[1].numel()))
            return real[name](*a, **kw)

        return counted

    stages, params = toy(2)
    pipe = Pipeline(
        stages, generate("1f1b", ranks=2, microbatches=2), loss_fn=mse, transport="dist"
    )
    try:
        for n in real:
            setattr(dist, n, counting(n))
        for size in sizes:
            x = torch.randn(size, D, dtype=F64)
            pipe.step(params, x, torch.randn_like(x))
    finally:
        for n, fn in real.items():
            setattr(dist, n, fn)
        pipe.close()
    return calls


def tied_copies_per_rank(rank: int, seeds: Sequence[int]) -> str:
    """2-rank 1F1B with stage 0's and stage 1's ``E`` tied; rank ``r`` makes its params from
    ``seeds[r]`` (each rank seeding its own: the tied copies differ when the seeds do). Returns
    "ok" after a step whose loss and gradients match the reference, else the error."""
    program = generate("1f1b", ranks=2, microbatches=2)
    stages, params = toy(2, seed=seeds[rank], tied=True)
    ties = {"E": [(0, "E"), (1, "E")]}
    pipe = Pipeline(stages, program, loss_fn=mse, ties=ties, transport="dist")
    x, y = data(4)
    try:
        loss, grads = pipe.step(params, x, y)
    except fp.FuncpipeError as e:
        return f"{type(e).__name__}: {e}"
    finally:
        pipe.close()
    ref_loss, ref_grads = tied_reference(stages, params, x, y, 2, ties)
    assert_trees_close(loss, ref_loss)
    assert_trees_close(grads[rank], ref_grads[rank])
    return "ok"


def batch_sizes_differ(rank: int) -> None:
    """Rank 0 steps 8 samples, rank 1 six (the catalogue's row): raises on every rank."""
    stages, params = toy(2)
    with Pipeline(stages, generate("1f1b", ranks=2, microbatches=2), loss_fn=mse) as pipe:
        x, y = data(8 if rank == 0 else 6)
        pipe.step(params, x, y)


def tied_copies_in_one_process(second: torch.Tensor | None = None) -> float:
    """A 2-stage program on one rank, over a process group of this process alone, with stage
    0's ``E`` and stage 1's ``E`` tied; stage 1 holds ``second`` (default: stage 0's value plus
    1e-3: copies that differ). Returns the loss."""
    import torch.distributed as dist

    stages, params = toy(2, tied=True)
    params[1]["E"] = params[0]["E"] + 1e-3 if second is None else second
    x, y = data(4)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with Pipeline(
            stages,
            generate("zbv", ranks=1, microbatches=2),
            loss_fn=mse,
            ties={"E": [(0, "E"), (1, "E")]},
            transport="dist",
        ) as pipe:
            return float(pipe.step(params, x, y).loss)
    finally:
        dist.destroy_process_group()


def _what_it_raises(rank: int) -> tuple[str, str]:
    try:
        batch_sizes_differ(rank)
    except fp.FuncpipeError as e:
        return type(e).__name__, str(e)
    return "", "no error"


def batch_sizes_differ_on_two_processes() -> None:
    """The catalogue's row: :func:`batch_sizes_differ` on two processes (``funcpipe.launch``);
    raises here what each rank raised (the same error on both, as under torchrun)."""
    import funcpipe.errors

    (name, text), other = fp.launch(_what_it_raises, 2, timeout=60)
    assert other == (name, text), other
    raise getattr(funcpipe.errors, name or "FuncpipeError")(text)
