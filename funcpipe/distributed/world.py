"""The processes a :class:`funcpipe.Pipeline` runs on over ``torch.distributed``.

A world of ``ranks x data x tensor`` processes: world rank ``g = (r * data + d) * tensor + c``
runs program rank ``r`` in data-parallel copy ``d`` with tensor-parallel coordinate ``c`` (the
layout of :class:`funcpipe.parallel.ParallelConfig`: pipe outermost, tensor innermost). Messages
go between equal ``(d, c)``; ``data`` reductions between equal ``(r, c)``. :func:`join` creates
the process groups (every process creates every group, as torch requires, so all of them must
build the same Pipeline) and the transport.

Point-to-point messages over ``torch.distributed`` travel on one process group per pair of
program ranks that exchange messages (in each data copy and tensor coordinate), created once by
:func:`join`, on NCCL eagerly for this process's device: every message group of a pair is one
``batch_isend_irecv`` on that pair's group (:class:`funcpipe.runtime.transport.DistTransport`),
so each pair has one communicator and one FIFO stream, the layout
:data:`funcpipe.schedule.p2p.PAIR` the checker proves programs under.

This is the one message path: between CPU processes of one host as between GPUs of many, every
message is a torch.distributed send or receive on its pair's group (gloo on CPU, NCCL on CUDA),
so the CPU tests run the calls a GPU run makes (docs/design.md, "One message path").

``FUNCPIPE_STRICT_P2P=1`` in the environment (every process must see the same value) makes the
transport strict, for tests: messages still travel over gloo, but they complete only
as NCCL's point-to-point rules allow (one FIFO queue per pair of ranks for both directions, groups
posted together per peer, an ungrouped send done only when the peer's receive is at the head of
its side;
:mod:`funcpipe.runtime.nccl_rules`), each rank sharing its side of the queues through the process
group's store. A program that would hang on GPUs then fails within about a second with a
:class:`funcpipe.CommunicationError` naming the ranks and operations that wait for each other.
"""

from __future__ import annotations

import socket
import time
import zlib
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from funcpipe.distributed.failures import Steps, forget_steps
from funcpipe.distributed.groups import Claim
from funcpipe.errors import InvalidArgument
from funcpipe.runtime.drive import drive
from funcpipe.runtime.interpreter import RankResult
from funcpipe.runtime.rank_io import EXPERT_DATA
from funcpipe.runtime.transport import DistTransport, strict_from_env
from funcpipe.runtime.transport_common import Handle
from funcpipe.schedule.check import in_program
from funcpipe.schedule.ir import COLLECTIVE_OPS, Op, Program

__all__ = ["SCALARS", "DistWorld", "gather_times", "join", "sizes"]

SCALARS = "<loss>"  # the transport group of the step's loss and metric reduction


@dataclass
class DistWorld:
    """This process's place in the world and its transport."""

    rank: int  # program rank
    pipe_ranks: list[int]  # world rank of each program rank (this copy and coordinate)
    data: int  # data-parallel copies
    tensor: int  # tensor-parallel size
    transport: DistTransport
    claim: Claim | None = None  # the shared process groups this world uses
    steps: Steps | None = None  # the steps its transport finished
    copy: int = 0  # this process's data-parallel copy

    def drive(self, gen: Generator[Handle, None, RankResult]) -> RankResult:
        """Run this rank's step (:func:`funcpipe.runtime.drive.drive`). A collective that a
        stage called (an expert all-to-all, a tensor-parallel reduction) fails with
        torch.distributed's own error when a peer fails; it is raised as the transport's are,
        naming the rank that failed first (:func:`funcpipe.distributed.records.named`)."""
        from funcpipe.distributed.records import named

        try:
            return drive(gen)
        except Exception as e:
            error = named(e, self.pipe_ranks[self.rank])
            if error is e:
                raise
            raise error from e

    def close(self) -> None:
        """Release the transport (its waiter threads) and the process groups (collective:
        every process closes its worlds in the same order, so the groups are given back even
        when the transport fails to close)."""
        if self.steps is not None:
            forget_steps(self.steps)
        try:
            self.transport.close()
        finally:
            if self.claim is not None:
                self.claim.close()


def initialised() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def sizes(n_ranks: int, mesh: Any) -> tuple[int, int]:
    """(data-parallel copies, tensor-parallel size) of the world for a program of ``n_ranks``."""
    if mesh is not None:
        return mesh.config.data, mesh.config.tensor
    import torch.distributed as dist

    return max(1, dist.get_world_size() // n_ranks), 1


def join(program: Program, *, mesh: Any = None, scatter_gather: bool = False) -> DistWorld:
    """Create this program's process groups and transport (every process calls this)."""
    import torch.distributed as dist

    if not initialised():
        raise InvalidArgument(
            "transport='dist' needs torch.distributed initialised (use funcpipe.launch, "
            "or torchrun and dist.init_process_group)"
        )
    world, me = dist.get_world_size(), dist.get_rank()
    n = program.n_ranks
    if mesh is not None and mesh.config.pipeline != n:
        raise InvalidArgument(
            f"mesh has pipeline={mesh.config.pipeline} but the program has {n} ranks; "
            "generate the schedule with ranks equal to the mesh's pipeline size"
        )
    if world % n:
        raise InvalidArgument(
            f"the world has {world} processes but the program has {n} ranks; the world size "
            f"must be a multiple of {n} (ranks x data x tensor)"
        )
    copies, tp = sizes(n, mesh)
    if n * copies * tp != world:
        raise InvalidArgument(
            f"ranks ({n}) x data ({copies}) x tensor ({tp}) != world size {world}"
        )

    def g(r: int, d: int, c: int) -> int:
        return (r * copies + d) * tp + c

    rank, rest = divmod(me, copies * tp)
    copy, coord = divmod(rest, tp)
    pipe_ranks = [g(r, copy, coord) for r in range(n)]
    everywhere = [(d, c) for d in range(copies) for c in range(tp)]

    # groups are shared with every other world of the same layout (funcpipe.distributed.groups)
    claim = Claim()
    subgroups = claim.subgroups

    # the loss and metric sums: every process of the world, a group of their own (each rank
    # posts it after its last instruction, whatever else is still in flight)
    groups: dict[str, Any] = {SCALARS: claim.group(range(world), use="scalars")}
    names = sorted({i.group for r in program.ranks for i in r if i.op in COLLECTIVE_OPS})
    if copies > 1 and "data" not in names:  # (an evaluation's tallies sum over it too)
        names.append("data")
    holders: dict[str, set[int]] = {}  # Chimera: replica:<o> over the ranks holding o's replicas
    replica_of = program.replica_of or ()
    for r in range(n):
        for s in program.stages_on(r) if replica_of else ():
            holders.setdefault(f"replica:{replica_of[s]}", set()).add(r)
    names += sorted(k for k, v in holders.items() if len(v) > 1 and k not in names)
    for name in names:
        if not in_program(name):  # over the data-parallel copies of this rank and coord
            lists = [[g(r, d, c) for d in range(copies)] for r in range(n) for c in range(tp)]
            groups[name] = subgroups(lists)
            continue
        members = sorted(
            {r for r, instrs in enumerate(program.ranks) for i in instrs if i.group == name}
            | holders.get(name, set())
        )
        pg = subgroups([[g(r, d, c) for r in members] for d, c in everywhere])
        if rank in members and len(members) > 1:
            groups[name] = pg
    ep = 1 if mesh is None else mesh.config.expert
    if ep > 1 and copies > ep:
        # expert leaves sum over the copies that hold the same experts (copy % ep: the mesh's
        # expert coordinate; funcpipe.parallel.mesh), dense ones over all of them
        lists = [
            [g(r, d, c) for d in range(e, copies, ep)]
            for r in range(n)
            for c in range(tp)
            for e in range(ep)
        ]
        groups[EXPERT_DATA] = subgroups(lists)
    pairs = _pair_groups(claim, program, rank, g, everywhere, copy, coord)
    from funcpipe.distributed.records import failure_handler

    split = None
    if scatter_gather and tp > 1 and mesh is not None:
        tensor_axis = mesh["tensor"]
        split = (tensor_axis.group, tp, tensor_axis.coord)
    steps = Steps()
    on_error = failure_handler(steps.current)
    strict: dict[str, Any] = {}
    if strict_from_env():
        n = _EXCHANGES["strict"] = _EXCHANGES.get("strict", 0) + 1
        strict = {
            "strict": True,
            "store": dist.distributed_c10d._get_default_store(),
            "key": f"funcpipe/strict/{n}",
            "timeout": _pg_timeout(),
        }
    transport = DistTransport(
        rank,
        pipe_ranks,
        groups=groups,
        on_error=on_error,
        split=split,
        pairs=pairs,
        **strict,
    )
    steps.attach(transport)
    return DistWorld(rank, pipe_ranks, copies, tp, transport, claim, steps, copy)


def transport_device(device: torch.device | None) -> torch.device:
    """Where collectives of this world's backend take their tensors."""
    import torch.distributed as dist

    if device is not None:
        return device
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_times(
    program: Program,
    world: DistWorld,
    times: list[float],
    spans: list[tuple[str, float, float]],
) -> tuple[list[list[float]], list[list[tuple[str, float, float]]]]:
    """Every program rank's instruction times (of this rank's copy and coordinate) and the
    collectives its stages called (``spans``: name, start, end), in this process's
    ``time.perf_counter`` seconds.

    Each rank's times are ``perf_counter`` readings (on CUDA, events anchored to one:
    :mod:`funcpipe.runtime.clock`). Processes of one machine share that clock and their times
    are taken as they are. A process on another machine has a clock of its own: its times are
    moved through the wall clock (each process sends ``time.time() - perf_counter()`` with its
    times), so they are as good as the machines' clock synchronisation (NTP: about a
    millisecond).
    """
    import torch.distributed as dist

    longest = 2 * max(len(r) for r in program.ranks)
    mine = torch.full((longest + 2,), float("nan"), dtype=torch.float64)
    mine[: len(times)] = torch.tensor(times, dtype=torch.float64)
    mine[-2] = float(zlib.crc32(_host_id().encode()))  # which machine (exact in a float64)
    mine[-1] = time.time() - time.perf_counter()
    dev = transport_device(None)  # NCCL: this rank's current GPU; gloo: the CPU
    everyone = [torch.empty_like(mine, device=dev) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine.to(dev))
    rows = torch.stack(everyone).cpu()  # one copy back
    calls = _gather_spans(spans, dev)
    shift = [0.0 if row[-2] == mine[-2] else float(row[-1] - mine[-1]) for row in rows]
    return [
        _on_my_clock(rows[g], mine, 2 * len(program.ranks[r]))
        for r, g in enumerate(world.pipe_ranks)
    ], [[(n, a + shift[g], b + shift[g]) for n, a, b in calls[g]] for g in world.pipe_ranks]


def _gather_spans(
    spans: list[tuple[str, float, float]], dev: torch.device
) -> list[list[tuple[str, float, float]]]:
    """Every process's ``spans``, as tensors (the names as UTF-8 bytes: nothing is pickled)."""
    import torch.distributed as dist

    n = dist.get_world_size()
    names = "\x1f".join(name for name, _, _ in spans).encode()
    sizes = torch.tensor([len(spans), len(names)], dtype=torch.int64, device=dev)
    every = [torch.empty_like(sizes) for _ in range(n)]
    dist.all_gather(every, sizes)
    counts = [(int(t[0]), int(t[1])) for t in every]
    most, longest = max(c for c, _ in counts), max(b for _, b in counts)
    times = torch.zeros(max(1, 2 * most), dtype=torch.float64)
    flat = [t for _, a, b in spans for t in (a, b)]
    times[: len(flat)] = torch.tensor(flat, dtype=torch.float64)
    text = torch.zeros(max(1, longest), dtype=torch.uint8)
    text[: len(names)] = torch.tensor(list(names), dtype=torch.uint8)
    all_times = [torch.empty_like(times, device=dev) for _ in range(n)]
    all_text = [torch.empty_like(text, device=dev) for _ in range(n)]
    dist.all_gather(all_times, times.to(dev))
    dist.all_gather(all_text, text.to(dev))
    out = []
    for (c, b), ts, tx in zip(counts, all_times, all_text, strict=True):
        got = bytes(tx[:b].cpu().tolist()).decode().split("\x1f") if c else []
        vals = ts.cpu().tolist()
        out.append([(got[k], vals[2 * k], vals[2 * k + 1]) for k in range(c)])
    return out


def _on_my_clock(row: torch.Tensor, mine: torch.Tensor, n: int) -> list[float]:
    """The first ``n`` times of a gathered ``row`` (``[times..., machine, wall - perf_counter]``)
    on the clock of the process that sent ``mine``."""
    ts = row[:n]
    if row[-2] != mine[-2]:  # another machine: its perf_counter -> wall clock -> ours
        ts = ts + (row[-1] - mine[-1])
    return ts.tolist()


_EXCHANGES: dict[str, int] = {}  # strict transports built by this process (their store keys)


def _host_id() -> str:
    """This machine (and boot): ranks with equal ids share one ``perf_counter`` clock."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _pg_timeout() -> float:
    """The default process group's timeout in seconds (the strict transport's waits give up
    after it too)."""
    from funcpipe.distributed.timeouts import job_timeout

    limit = job_timeout()
    return 1800.0 if limit is None else limit.total_seconds()


def _message_pairs(program: Program) -> list[tuple[int, int]]:
    """The pairs of program ranks (low, high) that exchange messages, sorted."""
    return sorted(
        {
            (min(r, i.peer), max(r, i.peer))
            for r, instrs in enumerate(program.ranks)
            for i in instrs
            if i.op in (Op.SEND, Op.RECV) and i.peer is not None
        }
    )


def _pair_groups(
    claim: Claim,
    program: Program,
    rank: int,
    g: Callable[[int, int, int], int],
    everywhere: Sequence[tuple[int, int]],
    copy: int,
    coord: int,
) -> dict[int, Any]:
    """Peer program rank -> the process group of this rank and that peer (every process calls
    this: it creates every pair's group of every copy and coordinate not created before, in one
    order). A pair's group is shared through ``claim`` with every other world that uses it (and
    destroyed when the last of them closes: funcpipe.distributed.groups); on NCCL it is bound to this
    process's device, so its communicator is created now (eagerly) rather than by its first
    message."""
    device = _eager_device()
    mine: dict[int, Any] = {}
    for a, b in _message_pairs(program):
        for d, c in everywhere:
            ga, gb = g(a, d, c), g(b, d, c)
            group = claim.group([ga, gb], use="p2p", device_id=device)
            if (d, c) == (copy, coord) and rank in (a, b):
                mine[b if rank == a else a] = group
    return mine


def _eager_device() -> torch.device | None:
    """The device a new NCCL process group is bound to (so it connects at once): the default
    group's, else this process's current CUDA device; None off NCCL."""
    import torch.distributed as dist

    if "nccl" not in str(dist.get_backend()) or not torch.cuda.is_available():
        return None
    bound = getattr(dist.group.WORLD, "bound_device_id", None)
    return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())
