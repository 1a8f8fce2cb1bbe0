"""Pool jobs of the strict-transport and held-bytes tests (importable by pool workers).

Each job builds its own :class:`DistTransport` and posts groups by hand (``Transport.post``), so
these tests do not depend on how the interpreter groups a program's SENDs and RECVs.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Generator, Sequence
from typing import Any

import torch

from funcpipe.errors import CommunicationError
from funcpipe.runtime.transport import P2P, DistTransport, Handle, LocalTransport

Step = tuple[str, Any]  # ("compute", None) or ("group", [(op, kind, microbatch, peer)])


def one_f_one_b(rank: int, ranks: int, microbatches: int) -> list[Step]:
    """1F1B's communication on ``rank``, grouped as Megatron posts it (NCCL-correct): warm-up
    forwards with their own receives and sends, then per steady step F, [SEND act + RECV grad],
    B, [SEND grad + RECV next act], then the cool-down backwards."""
    first, last = rank == 0, rank == ranks - 1
    warm = min(ranks - rank - 1, microbatches)
    steps: list[Step] = []

    def group(*ops: tuple[str, str, int, int] | None) -> None:
        real = [op for op in ops if op is not None]
        if real:
            steps.append(("group", real))

    def recv_act(m: int) -> tuple[str, str, int, int] | None:
        return None if first else ("recv", "act", m, rank - 1)

    def send_act(m: int) -> tuple[str, str, int, int] | None:
        return None if last else ("send", "act", m, rank + 1)

    def recv_grad(m: int) -> tuple[str, str, int, int] | None:
        return None if last else ("recv", "grad", m, rank + 1)

    def send_grad(m: int) -> tuple[str, str, int, int] | None:
        return None if first else ("send", "grad", m, rank - 1)

    for m in range(warm):
        group(recv_act(m))
        steps.append(("compute", ("F", m)))
        group(send_act(m))
    steady = microbatches - warm
    if steady:
        group(recv_act(warm))
    for i in range(steady):
        steps.append(("compute", ("F", warm + i)))
        group(send_act(warm + i), recv_grad(i))
        steps.append(("compute", ("B", i)))
        if i == steady - 1:
            group(send_grad(i))
        else:
            group(send_grad(i), recv_act(warm + i + 1))
    for m in range(steady, microbatches):
        group(recv_grad(m))
        steps.append(("compute", ("B", m)))
        group(send_grad(m))
    return steps


def run_steps(
    t: DistTransport | LocalTransport, steps: Sequence[Step], numel: int
) -> Generator[Handle, None, None]:
    """Post the groups in order, each receive waited for before the next compute; every message
    is a float32 tensor of ``numel`` elements filled with its microbatch (checked on arrival).
    The rank drops its own reference to a sent tensor right after posting (as the interpreter
    does): only the transport keeps it."""
    for what, arg in steps:
        if what == "compute":
            continue
        ops, checks = [], []
        for op, _kind, m, peer in arg:
            if op == "send":
                ops.append(P2P("send", (torch.full((numel,), float(m)),), peer))
            else:
                buf = torch.empty(numel)
                ops.append(P2P("recv", (buf,), peer))
                checks.append((buf, m))
        handles = t.post(ops)
        del ops
        for h, p in zip(handles, [o for o, *_ in arg], strict=True):
            if p == "recv" and not h.ready():
                yield h
                h.wait()
        for buf, m in checks:
            assert bool((buf == m).all()), f"rank {t.rank}: wrong data for microbatch {m}"


def _transport(rank: int, n: int, strict: bool, key: str) -> DistTransport:
    return DistTransport(rank, list(range(n)), strict=strict, key=f"{key}/strict", timeout=60.0)


def held_bytes_1f1b(
    rank: int, microbatches: int, numel: int, strict: bool, key: str
) -> tuple[int, int]:
    """One hand-posted 1F1B step; (this rank's peak held bytes, held bytes after finish)."""
    import torch.distributed as dist

    n = dist.get_world_size()
    t = _transport(rank, n, strict, key)
    gen = run_steps(t, one_f_one_b(rank, n, microbatches), numel)
    for h in gen:
        h.wait()
    t.finish()
    dist.barrier()
    t.close()
    return t.last_peak_held_bytes, t.held_bytes


def exchange(rank: int, grouped: bool, key: str) -> tuple[str, float]:
    """Both ranks send to each other first, then receive, in strict mode: ungrouped this hangs
    under NCCL (the job returns the error's text), grouped it passes ("ok")."""
    import torch.distributed as dist

    t = _transport(rank, 2, True, key)
    other = 1 - rank
    out = torch.full((1000,), float(rank))
    buf = torch.empty(1000)
    start = time.monotonic()
    try:
        if grouped:
            t.post([P2P("send", (out,), other), P2P("recv", (buf,), other)])[1].wait()
        else:
            t.post([P2P("send", (out,), other)])
            t.post([P2P("recv", (buf,), other)])[0].wait()
        t.finish()
        assert bool((buf == other).all())
        result = "ok"
    except CommunicationError as e:
        result = str(e)
    took = time.monotonic() - start
    dist.barrier()  # the messages themselves went through (gloo buffers)
    t.close()
    return result, took


def forward_vs_reference(rank: int, ranks: int, transport: str = "dist") -> float:
    """An evaluation step of ``forward`` (no rank ever sends to the rank it receives from, so it
    runs under NCCL's rules as the interpreter posts it); its loss minus the reference's."""
    import funcpipe as fp
    from funcpipe.pipeline.pipeline import Pipeline
    from funcpipe.schedule.generators import generate
    from tests.jobs_runtime import data, mse, toy

    m = 4
    stages, params = toy(ranks)
    pipe = Pipeline(
        stages, generate("forward", ranks=ranks, microbatches=m), loss_fn=mse, transport=transport
    )
    x, y = data(8)
    loss = pipe.step(params, x, y).loss
    ref, _ = fp.reference_step(stages, params, x, mse, targets=y, microbatches=m)
    return float((loss - ref).abs())


def strict_pipeline(rank: int) -> tuple[bool, float]:
    """A Pipeline built with FUNCPIPE_STRICT_P2P=1 over the pool: its transport is strict, and
    its evaluation step matches the reference under the rules."""
    import torch.distributed as dist

    from funcpipe.distributed import world

    made: list[DistTransport] = []
    original = world.DistTransport

    def spy(*args: Any, **kwargs: Any) -> DistTransport:
        made.append(original(*args, **kwargs))
        return made[-1]

    os.environ["FUNCPIPE_STRICT_P2P"] = "1"
    world.DistTransport = spy  # type: ignore[misc]
    try:
        worst = forward_vs_reference(rank, dist.get_world_size())
    finally:
        world.DistTransport = original  # type: ignore[misc]
        os.environ.pop("FUNCPIPE_STRICT_P2P", None)
    return len(made) == 1 and made[0].strict is not None, worst


def pipeline_held_bytes(rank: int, microbatches: int, steps: int) -> tuple[list[int], int, int]:
    """``steps`` 1F1B training steps of the toy model through Pipeline over the pool's ranks:
    (peak held bytes of each step, bytes of one boundary tensor, held bytes after the last)."""
    import torch.distributed as dist

    from funcpipe.pipeline.pipeline import Pipeline
    from funcpipe.schedule.generators import generate
    from tests.jobs_runtime import D, data, mse, toy

    n = dist.get_world_size()
    program = generate("1f1b", ranks=n, microbatches=microbatches)
    stages, params = toy(n)
    rows = 8
    pipe = Pipeline(stages, program, loss_fn=mse, transport="dist")
    x, y = data(rows * microbatches)
    peaks = []
    for _ in range(steps):
        pipe.step(params, x, y)
        t = pipe._world.transport  # type: ignore[union-attr]
        peaks.append(t.last_peak_held_bytes)
    return peaks, rows * D * 8, t.held_bytes


def p2p_process_groups(rank: int, names: Sequence[str]) -> dict[str, Any]:
    """A training step of each schedule in ``names`` over the pool's ranks with torch.distributed
    point-to-point (gloo), recording the process group of
    every point-to-point operation at the one place every torch.distributed send and receive
    goes through (``ProcessGroup.send`` / ``recv``). Per schedule: (the largest difference to the
    reference, this rank's peers in the program, [(operation, world ranks of its group)])."""
    import torch.distributed as dist

    from funcpipe.schedule.generators import generate
    from funcpipe.schedule.ir import COMM_OPS
    from funcpipe.schedule.passes import add_communication
    from tests.jobs_runtime import run_pipeline_vs_reference

    pg = dist.ProcessGroup
    seen: list[tuple[str, tuple[int, ...]]] = []
    # the raw descriptors (pybind's instancemethod): a method read with getattr and set back
    # would no longer bind its instance, and every later send of this process would fail
    originals = {m: inspect.getattr_static(pg, m) for m in ("send", "recv", "recv_anysource")}
    own = {m for m in originals if m in vars(pg)}

    def spy(method: str) -> Any:
        original = originals[method]

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append((method, tuple(dist.get_process_group_ranks(self))))
            return original(self, *args, **kwargs)

        return call

    n = dist.get_world_size()
    out: dict[str, Any] = {}
    for method in originals:
        setattr(pg, method, spy(method))
    try:
        for name in names:
            seen.clear()
            program = generate(name, ranks=n, microbatches=2 * n)
            lowered = add_communication(program)
            peers = sorted({i.peer for i in lowered.ranks[rank] if i.op in COMM_OPS})
            worst = run_pipeline_vs_reference(rank, name, n, 2 * n, [4 * n])
            out[name] = (worst, peers, list(seen))
    finally:
        for method, original in originals.items():
            if method in own:
                setattr(pg, method, original)
            else:
                delattr(pg, method)
    return out
