"""Pool jobs and a training script for the fault and security tests (importable by pool workers).

Every job that is meant to fail writes what *this* rank saw to ``<report_dir>/rank<r>.json``
before the error leaves the job, so a test can check the view of every rank, not only the
launcher's.

As a script (``python -m tests.jobs_faults train OUT --steps N ...``) it trains a small
pipeline with checkpoints, for the kill-during-save test.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from funcpipe.pipeline.pipeline import Pipeline
from funcpipe.schedule.generators import generate
from funcpipe.stages.stage import Stage
from funcpipe.train import checkpoint, optim
from tests.jobs_runtime import _middle, data, mse, toy


def _report(report_dir: str, rank: int, e: BaseException) -> None:
    Path(report_dir, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "type": type(e).__name__,
                "rank": getattr(e, "rank", None),
                "message": str(e),
                "pid": os.getpid(),
            }
        )
    )


@contextmanager
def _reporting(report_dir: str, rank: int) -> Iterator[None]:
    try:
        yield
    except BaseException as e:
        _report(report_dir, rank, e)
        raise


def _counting(fn: Callable[[int, Any, torch.Tensor], torch.Tensor]) -> Stage:
    """A stage calling ``fn(n, params, h)`` with ``n`` its 0-based count of real calls (in a
    1F1B step the n-th forward of a stage is microbatch n)."""
    calls = {"n": 0}

    def stage(params: Any, h: torch.Tensor) -> torch.Tensor:
        if h.is_meta or is_fake(h):  # shape inference runs without data
            return _middle(params, h)
        n = calls["n"]
        calls["n"] += 1
        return fn(n, params, h)

    return Stage(stage, name="faulty")


# ------------------------------------------------------------------------------ a rank raises
def raise_in(rank: int, bad_rank: int, where: str, report_dir: str) -> str:
    """One step on 2 processes where ``bad_rank`` raises in its ``forward``, its ``backward``, a
    tie reduction (``tie-reduce``) or a data-parallel reduction (``data-reduce``)."""
    from funcpipe.runtime import transport

    message = f"injected failure in the {where} of rank {rank}"
    if where == "data-reduce":  # one program rank, two data-parallel copies
        program = generate("gpipe", ranks=1, microbatches=2)
        stages, params = toy(1)
        ties = None
    else:
        program = generate("1f1b", ranks=2, microbatches=4)
        stages, params = toy(2, tied=where == "tie-reduce")
        ties = {"E": [(0, "E"), (1, "E")]} if where == "tie-reduce" else None
    if rank == bad_rank and where in ("forward", "backward"):

        def bad(n: int, p: Any, h: torch.Tensor) -> torch.Tensor:
            if where == "forward" and n == 2:
                raise ValueError(message)
            out = _middle(p, h)
            if where == "backward" and n == 1:

                def hook(g: torch.Tensor) -> torch.Tensor:
                    raise ValueError(message)

                out.register_hook(hook)
            return out

        stages[rank] = _counting(bad)
    original = transport.DistTransport.all_reduce
    if rank == bad_rank and where.endswith("reduce"):

        def failing(self: Any, tensors: Any, group: str) -> Any:
            raise ValueError(f"{message} (group {group!r})")

        transport.DistTransport.all_reduce = failing  # type: ignore[method-assign]
    try:
        with _reporting(report_dir, rank):
            pipe = Pipeline(stages, program, loss_fn=mse, ties=ties)
            x, y = data(8)
            pipe.step(params, x, y)
    finally:
        transport.DistTransport.all_reduce = original  # type: ignore[method-assign]
    return "finished"


def raise_in_a_pair(rank: int, bad_rank: int, report_dir: str) -> str:
    """One DualPipeV step with pairs at pipeline 2 x expert 2 (MoE stages: every half calls the
    expert all-to-all) where process ``bad_rank`` raises in the forward of its 4th MoE call,
    a paired forward; its expert peer's pair is then waiting in an all-to-all or for its turn."""
    import funcpipe as fp
    from funcpipe.models import moe
    from tests import jobs_experts as E
    from tests.jobs_parallel import mesh_for

    mesh = mesh_for({"pipeline": 2, "expert": 2})
    axis = mesh["expert"]
    program = generate("dualpipev", ranks=2, microbatches=8, overlap=True)
    config = E._config(4)
    full = tuple(moe.init(config, seed=s, dtype=torch.float64) for s in range(4))
    mine = tuple(moe.expert_shard(p, config, axis) for p in full)
    experts = [(s, leaf) for s in range(4) for leaf in ("w_in", "w_out")]
    stages = E._stages(4, config, axis)
    if rank == bad_rank:
        calls = {"n": 0}
        inner = stages[0].fn

        def bad(p: Any, h: torch.Tensor) -> torch.Tensor:
            if not (h.is_meta or is_fake(h)):
                calls["n"] += 1
                if calls["n"] == 4:
                    raise ValueError(f"injected failure in a paired forward of rank {rank}")
            return inner(p, h)

        stages[0] = fp.Stage(bad, name="faulty")
    x, y = E._batch(0, 8)
    pipe = fp.Pipeline(stages, program, loss_fn=E._mse, mesh=mesh, experts=experts)
    with _reporting(report_dir, rank), pipe:
        pipe.step(mine, x, y)
    return "finished"


# ------------------------------------------------------------------ ranks build different programs
def different_programs(rank: int, what: str, report_dir: str) -> str:
    """Rank 1 builds another pipeline than rank 0: another schedule (``schedule``) or the
    same schedule with recompute (``option``). Every rank must raise at construction."""
    name = "gpipe" if (rank == 1 and what == "schedule") else "1f1b"
    recompute = rank == 1 and what == "option"
    stages, params = toy(2)
    with _reporting(report_dir, rank):
        pipe = Pipeline(
            stages, generate(name, ranks=2, microbatches=4), loss_fn=mse, recompute=recompute
        )
        x, y = data(8)
        pipe.step(params, x, y)
    return "finished"


# ------------------------------------------------------------------------------ a rank is killed
def die_mid_step(rank: int, bad_rank: int, report_dir: str) -> str:
    """``bad_rank`` SIGKILLs itself in the middle of a 1F1B step (its third forward)."""

    def fatal(n: int, p: Any, h: torch.Tensor) -> torch.Tensor:
        if n == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return _middle(p, h)

    stages, params = toy(2)
    if rank == bad_rank:
        stages[rank] = _counting(fatal)
    with _reporting(report_dir, rank):
        pipe = Pipeline(stages, generate("1f1b", ranks=2, microbatches=4), loss_fn=mse)
        x, y = data(8)
        pipe.step(params, x, y)
    return "finished"


# ------------------------------------------------------------------ a rank returns early
def return_early(rank: int, when: str, report_dir: str | None = None) -> str:
    """Rank 1 returns while rank 0 steps: ``before-pipeline`` (it builds nothing),
    ``without-stepping`` (it builds the Pipeline and takes no step) or ``after-one-step`` (it
    takes one step, rank 0 two)."""
    stages, params = toy(2)
    if rank == 1 and when == "before-pipeline":
        return "returned"
    with _reporting(report_dir, rank) if report_dir else _nothing():
        pipe = Pipeline(stages, generate("1f1b", ranks=2, microbatches=4), loss_fn=mse)
        steps = {"without-stepping": 0, "after-one-step": 1}.get(when, 2) if rank == 1 else 2
        x, y = data(8)
        for _ in range(steps):
            pipe.step(params, x, y)
    return "finished"


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def slow_first_step(rank: int, seconds: float, at: int = 0) -> str:
    """Two steps; rank 1 sleeps ``seconds`` before step ``at`` (0: the first), so rank 0 waits
    for it longer than a short process group timeout."""
    import time

    stages, params = toy(2)
    pipe = Pipeline(stages, generate("1f1b", ranks=2, microbatches=4), loss_fn=mse)
    x, y = data(8)
    for step in range(2):
        if rank == 1 and step == at:
            time.sleep(seconds)
        pipe.step(params, x, y)
    return "finished"


def launched(job: str, *args: Any, **options: Any) -> list[Any]:
    """``funcpipe.launch`` of this module's ``job`` on 2 processes (for the error catalogue).
    A :class:`RankFailed` is raised again without the failed rank's traceback, which holds this
    machine's paths and line numbers: the catalogue's page shows the message above it."""
    import funcpipe as fp
    from funcpipe.errors import RankFailed

    try:
        return fp.launch(globals()[job], 2, *args, **options)
    except RankFailed as e:
        head = str(e).split("\nTraceback (most recent call last)")[0]
        raise RankFailed(head, rank=e.rank, cause=e.cause) from None


# ------------------------------------------------------------------------------ NaN and inf
def non_finite(rank: int, where: str, report_dir: str, via_env: bool) -> str:
    """A NaN in the loss (an inf output of the last stage, microbatch 2) or in a parameter
    gradient of the first stage (microbatch 1), caught by ``check_finite`` (explicit, or from
    ``FUNCPIPE_DEBUG=1`` when ``via_env``)."""
    stages, params = toy(2)

    def inf_output(n: int, p: Any, h: torch.Tensor) -> torch.Tensor:
        out = _middle(p, h)
        return out * float("inf") if n == 2 else out

    def nan_gradient(n: int, p: Any, h: torch.Tensor) -> torch.Tensor:
        out = _middle(p, h)
        if n == 1 and out.requires_grad:
            out.register_hook(lambda g: g * float("nan"))
        return out

    if where == "loss" and rank == 1:
        stages[1] = _counting(inf_output)
    if where == "grad" and rank == 0:
        stages[0] = _counting(nan_gradient)
    saved = os.environ.get("FUNCPIPE_DEBUG")
    if via_env:
        os.environ["FUNCPIPE_DEBUG"] = "1"
    try:
        with _reporting(report_dir, rank):
            pipe = Pipeline(
                stages,
                generate("1f1b", ranks=2, microbatches=4),
                loss_fn=mse,
                check_finite=None if via_env else True,
            )
            x, y = data(8)
            pipe.step(params, x, y)
    finally:
        if saved is None:
            os.environ.pop("FUNCPIPE_DEBUG", None)
        else:
            os.environ["FUNCPIPE_DEBUG"] = saved
    return "finished"


# ------------------------------------------------------------------------------ nothing unpickled
_OBJECT_COLLECTIVES = (
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)


def _refusing_class(cls: type, refused: Callable[..., Any]) -> type:
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        refused()

    return type(cls.__name__, (cls,), {"__init__": init})


def step_without_unpickling(rank: int) -> dict[str, Any]:
    """Build a Pipeline and run traced training and evaluation steps (ties, a new batch shape)
    with every way to unpickle data patched to raise: ``pickle.loads``/``load``/``Unpickler``,
    ``torch.load`` and torch.distributed's object collectives."""
    import pickle

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from funcpipe.schedule.generators import to_eval

    calls: list[str] = []

    def refuse(name: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            raise AssertionError(f"{name} was called during a pipeline step")

        return refused

    targets: list[tuple[Any, str]] = [(pickle, n) for n in ("loads", "load", "Unpickler")]
    targets += [(torch, "load")]
    targets += [(dist, n) for n in _OBJECT_COLLECTIVES if hasattr(dist, n)]
    targets += [(c10d, n) for n in (*_OBJECT_COLLECTIVES, "_tensor_to_object", "_unpickler")]
    targets = [(mod, n) for mod, n in targets if hasattr(mod, n)]
    saved = [(mod, n, getattr(mod, n)) for mod, n in targets]
    for mod, n, value in saved:
        name = f"{mod.__name__}.{n}"
        if isinstance(value, type):  # an Unpickler class: a subclass that refuses to be built
            setattr(mod, n, _refusing_class(value, refuse(name)))
        else:
            setattr(mod, n, refuse(name))
    try:
        program = generate("1f1b", ranks=2, microbatches=4)
        stages, params = toy(2, tied=True)
        ties = {"E": [(0, "E"), (1, "E")]}
        pipe = Pipeline(stages, program, loss_fn=mse, ties=ties)
        losses = []
        for size in (8, 6):  # a second microbatch shape: shapes are re-inferred, never sent
            x, y = data(size)
            res = pipe.step(params, x, y, trace=True)
            losses.append(float(res.loss))  # type: ignore[arg-type]
        evaluate = Pipeline(stages, to_eval(program), loss_fn=mse)
        val = float(evaluate.step(params, *data(8)).loss)  # type: ignore[arg-type]
    finally:
        for mod, n, value in saved:
            setattr(mod, n, value)
    return {
        "losses": losses,
        "val": val,
        "patched": sorted(f"{m.__name__}.{n}" for m, n in targets),
        "calls": calls,
    }


def listening_sockets(rank: int) -> list[tuple[str, int]]:
    """``(address, port)`` of every socket this process listens on (from /proc/net)."""
    return listening(os.getpid())


def listening(pid: int) -> list[tuple[str, int]]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                out.append((_address(address), int(port, 16)))
    return out


def _address(hex_address: str) -> str:
    """The text form of a /proc/net/tcp{,6} address (little-endian 32-bit words)."""
    import ipaddress

    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(words)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


# ------------------------------------------------------------------------------ train and resume
def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return data(8, seed=1000 + step)


def train(
    out: str | None, *, steps: int, save_every: int = 0, pause: tuple[int, str] | None = None
) -> list[tuple[int, float]]:
    """Train the toy 3-stage pipeline for ``steps`` steps (resuming from the newest checkpoint
    in ``out`` if there is one); save to ``out/ck`` every ``save_every`` steps, appending
    ``{"step", "loss"}`` lines to ``out/losses.jsonl`` as it goes. ``pause=(k, point)`` arms
    ``FUNCPIPE_TEST_CHECKPOINT_PAUSE`` for the save after step ``k`` only. Returns the
    ``(step, loss)`` pairs this run computed."""
    torch.set_num_threads(1)
    stages, plist = toy(3)
    params: Any = tuple(plist)
    pipe = Pipeline(stages, generate("1f1b", ranks=3, microbatches=4), loss_fn=mse)
    opt = optim.adamw(optim.warmup_cosine(3e-2, warmup=2, total=steps), weight_decay=0.1)
    state = opt.init(params)
    start = 0
    found = checkpoint.latest(out) if out is not None else None
    if found is not None:
        loaded = checkpoint.load(found, {"params": params, "opt": state, "step": 0})
        params, state, start = loaded["params"], loaded["opt"], loaded["step"]
    done = []
    for step in range(start, steps):
        x, y = _batch(step)
        loss, grads = pipe.step(params, x, y)
        params, state = opt.update(grads, state, params)
        done.append((step, float(loss)))
        if out is None:
            continue
        with open(os.path.join(out, "losses.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, "loss": float(loss), "pid": os.getpid()}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if save_every and (step + 1) % save_every == 0:
            if pause is not None and pause[0] == step + 1:
                os.environ["FUNCPIPE_TEST_CHECKPOINT_PAUSE"] = f"{pause[1]}:600"
            checkpoint.save(
                os.path.join(out, "ck"),
                {"params": params, "opt": state, "step": step + 1},
                step=step + 1,
            )
            os.environ.pop("FUNCPIPE_TEST_CHECKPOINT_PAUSE", None)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.jobs_faults")
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train with checkpoints (resumes from the newest one)")
    t.add_argument("out")
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--save-every", type=int, default=2)
    t.add_argument("--pause-at", type=int, default=0, help="arm the save pause after this step")
    t.add_argument("--pause", default="written", choices=["written", "aside"])
    r = sub.add_parser("return-early", help="launch return_early (e.g. under torchrun)")
    r.add_argument("when", choices=["before-pipeline", "without-stepping", "after-one-step"])
    r.add_argument("--pg-timeout", type=float, default=None)
    args = ap.parse_args(argv)
    if args.command == "return-early":
        import funcpipe as fp

        fp.launch(return_early, 2, args.when, pg_timeout=args.pg_timeout)
        return 0
    pause = (args.pause_at, args.pause) if args.pause_at else None
    train(args.out, steps=args.steps, save_every=args.save_every, pause=pause)
    return 0


if __name__ == "__main__":
    sys.exit(main())
