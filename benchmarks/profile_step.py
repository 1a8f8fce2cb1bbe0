"""Where a funcpipe step's time goes, per rank, over gloo.

    python benchmarks/profile_step.py [--size small] [--schedule 1f1b] [--ranks 2] [--steps 30]

On each rank of a gloo pool, funcpipe's functions are wrapped (in the benchmark process only;
nothing in funcpipe changes) with timers that add up their wall time per step:

- ``Pipeline.step`` and its phases (``_check_params``, ``_microbatches``: split + shape-inference
  cache, ``_rank_inputs``, ``_dist_scalars``: the loss all-reduce, ``_grads``);
- the interpreter's loop (``_Rank.run``, a generator: timed while it runs, not while
  suspended), each instruction kind (``_Rank.forward``, ``backward``, ``backward_input``,
  ``backward_weight``, ``send``, ``recv`` posting), a B's Linear weight products summed after
  its sends (``weights_after_sends``) and the batched weight sums (``flush_weights``), the
  waits for received data (``_Work.wait``) and for sends to complete
  (``DistTransport.finish``);
- inside them: ``autodiff.forward`` / ``backward`` / ``backward_input`` / ``backward_weight``,
  and the stage function itself (``Stage.__call__``: functional_call + the layers).

Then ``--cprofile-steps`` more steps run under cProfile and the top functions by own time are
printed for each rank. Times are inclusive (a phase contains the calls listed under it).
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import pstats
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C

# (label, dotted owner, attribute): what is timed; the indent shows the nesting
TIMED = [
    ("step", "funcpipe.pipeline:Pipeline", "step"),
    ("  _check_params", "funcpipe.pipeline:Pipeline", "_check_params"),
    ("  _microbatches (split, layouts)", "funcpipe.pipeline:Pipeline", "_microbatches"),
    ("  _rank_inputs", "funcpipe.pipeline:Pipeline", "_rank_inputs"),
    ("  interpreter loop (_Rank.run, not suspended)", "funcpipe.runtime.interpreter:_Rank", "run"),
    ("  F  _Rank.forward", "funcpipe.runtime.interpreter:_Rank", "forward"),
    ("    autodiff.forward", "funcpipe.runtime.autodiff", "forward"),
    ("      Stage.__call__ (stage fn)", "funcpipe.stage:Stage", "__call__"),
    ("  B  _Rank.backward", "funcpipe.runtime.interpreter:_Rank", "backward"),
    ("    autodiff.backward", "funcpipe.runtime.autodiff", "backward"),
    ("  I  _Rank.backward_input", "funcpipe.runtime.interpreter:_Rank", "backward_input"),
    ("    autodiff.backward_input", "funcpipe.runtime.autodiff", "backward_input"),
    ("  W  _Rank.backward_weight", "funcpipe.runtime.interpreter:_Rank", "backward_weight"),
    ("    autodiff.backward_weight", "funcpipe.runtime.autodiff", "backward_weight"),
    (
        "  B's Linear weights after its sends",
        "funcpipe.runtime.interpreter:_Rank",
        "weights_after_sends",
    ),
    ("    linear.weight_batch", "funcpipe.runtime.linear", "weight_batch"),
    ("      linear.add_product", "funcpipe.runtime.linear", "add_product"),
    ("        staging.add", "funcpipe.runtime.staging", "add"),
    ("  staging.settle (staged sums, wherever run)", "funcpipe.runtime.staging", "settle"),
    ("  sums while waiting (_Rank.idle)", "funcpipe.runtime.interpreter:_Rank", "idle"),
    (
        "  batched weight sums (flush_weights)",
        "funcpipe.runtime.interpreter:_Rank",
        "flush_weights",
    ),
    ("  SEND _Rank.send (isend)", "funcpipe.runtime.interpreter:_Rank", "send"),
    ("  RECV _Rank.recv (post irecv)", "funcpipe.runtime.interpreter:_Rank", "recv"),
    ("  RECV wait (_Work.wait)", "funcpipe.runtime.transport:_Work", "wait"),
    ("  RECV wait (sockets)", "funcpipe.runtime.sockets:_Receive", "wait"),
    ("  send completion (finish)", "funcpipe.runtime.transport:DistTransport", "finish"),
    ("  _dist_scalars (loss all-reduce)", "funcpipe.pipeline:Pipeline", "_dist_scalars"),
    ("  _grads", "funcpipe.pipeline:Pipeline", "_grads"),
]


def _owner(path: str) -> Any:
    import importlib

    mod, _, cls = path.partition(":")
    obj = importlib.import_module(mod)
    return getattr(obj, cls) if cls else obj


def _wrap(
    totals: dict[str, float], counts: dict[str, int], label: str, fn: Callable[..., Any]
) -> Callable[..., Any]:
    if inspect.isgeneratorfunction(fn):  # time each resumption, not the time suspended
        return _wrap_generator(totals, counts, label, fn)

    def timed(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            totals[label] += time.perf_counter() - t0
            counts[label] += 1

    return timed


def _wrap_generator(
    totals: dict[str, float], counts: dict[str, int], label: str, fn: Callable[..., Any]
) -> Callable[..., Any]:
    def timed(*a: Any, **k: Any) -> Generator[Any, Any, Any]:
        gen = fn(*a, **k)
        counts[label] += 1
        sent: Any = None
        error: BaseException | None = None
        while True:
            t0 = time.perf_counter()
            try:
                handle = gen.send(sent) if error is None else gen.throw(error)
            except StopIteration as stop:
                return stop.value
            finally:
                totals[label] += time.perf_counter() - t0
            sent, error = None, None
            try:
                sent = yield handle
            except BaseException as e:  # passed on to the wrapped generator
                error = e

    return timed


def job(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import funcpipe as fp

    size = C.Size(**cfg["size"])
    program = C.program_for(
        cfg["schedule"], ranks=dist.get_world_size(), microbatches=size.microbatches
    )
    model = C.mlp(size.width, layers=size.layers, seed=0)
    stages, params = C.funcpipe_stages(model, program.n_stages, kind=cfg["stage_kind"])
    pipe = fp.Pipeline(stages, program, loss_fn=C.mse, transport="dist")
    x, y = C.data(size, seed=1)
    for _ in range(cfg["warmup"]):
        pipe.step(params, x, y)

    # the plain step time, no wrappers
    plain = []
    for _ in range(cfg["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        pipe.step(params, x, y)
        plain.append(time.perf_counter() - t0)

    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    saved = []
    missing = []
    for label, owner, attr in TIMED:
        try:  # funcpipe's internals move: time what exists, say what does not
            obj = _owner(owner)
            orig = obj.__dict__[attr] if isinstance(obj, type) else getattr(obj, attr)
        except (ImportError, AttributeError, KeyError):
            missing.append(label.strip())
            continue
        saved.append((obj, attr, orig))
        setattr(obj, attr, _wrap(totals, counts, label, orig))
    try:
        for _ in range(cfg["steps"]):
            dist.barrier()
            pipe.step(params, x, y)
    finally:
        for obj, attr, orig in reversed(saved):
            setattr(obj, attr, orig)

    buf = io.StringIO()
    if cfg["cprofile_steps"]:
        prof = cProfile.Profile()
        for _ in range(cfg["cprofile_steps"]):
            dist.barrier()
            prof.enable()
            pipe.step(params, x, y)
            prof.disable()
        stats = pstats.Stats(prof, stream=buf)
        stats.sort_stats("tottime").print_stats(cfg["top"])
    n = cfg["steps"]
    return {
        "rank": rank,
        "plain_ms": C.median(plain) * 1e3,
        "instrs": len(pipe.program.ranks[rank]),
        "phases": {k: (totals[k] / n * 1e3, counts[k] / n) for k, _, _ in TIMED},
        "cprofile": buf.getvalue(),
        "missing": missing,
    }


def main(
    argv: list[str] | None = None, *, pool: C.PoolFactory | None = None
) -> list[dict[str, Any]]:
    """Run the profile; ``pool(n)`` may supply started pools of ``n`` gloo processes."""
    from benchmarks import profile_step

    ap = argparse.ArgumentParser(
        prog="profile_step.py", description="Where a funcpipe step's time goes, per rank (gloo)."
    )
    ap.add_argument("--size", default="small", choices=sorted(C.SIZES))
    ap.add_argument("--schedule", default="1f1b", choices=list(C.SCHEDULES))
    ap.add_argument("--ranks", type=C.int_at_least(2, "a pipeline over gloo"), default=2)
    ap.add_argument("--steps", type=C.int_at_least(1), default=30)
    ap.add_argument("--warmup", type=C.int_at_least(0), default=5)
    ap.add_argument(
        "--cprofile-steps", type=C.int_at_least(0), default=10, help="0: no cProfile run"
    )
    ap.add_argument("--top", type=C.int_at_least(1), default=25)
    ap.add_argument("--stage-kind", default="module", choices=["module", "function"])
    ap.add_argument("--no-cprofile", action="store_true", help="print only the timed phases")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = {
        "size": vars(C.SIZES[args.size]),
        "schedule": args.schedule,
        "steps": args.steps,
        "warmup": args.warmup,
        "cprofile_steps": args.cprofile_steps,
        "top": args.top,
        "stage_kind": args.stage_kind,
    }
    with C.Pools(pool) as pools:
        res = pools.get(args.ranks).run(profile_step.job, cfg, timeout=600)
    rows = []
    for label, _, _ in TIMED:
        row: dict[str, Any] = {"phase": label}
        for r in res:
            ms, calls = r["phases"][label]
            row[f"ms{r['rank']}"] = ms
            row[f"calls{r['rank']}"] = calls
            row[f"us_call{r['rank']}"] = ms * 1e3 / calls if calls else None
        rows.append(row)
    cols: list[C.Column] = [("phase", "per step", "")]
    for r in res:
        k = r["rank"]
        cols += [
            (f"ms{k}", f"rank {k} ms", ".3f"),
            (f"calls{k}", "calls", ".0f"),
            (f"us_call{k}", "us/call", ".0f"),
        ]
    print(
        f"{args.size} model, {args.schedule}, {args.ranks} gloo ranks, {args.stage_kind} stages; "
        "plain step (no timers): "
        + ", ".join(f"rank {r['rank']} {r['plain_ms']:.2f} ms ({r['instrs']} instrs)" for r in res)
    )
    print(C.table(rows, cols))
    if res[0]["missing"]:
        print(f"(not found in this funcpipe, so not timed: {', '.join(res[0]['missing'])})")
    if not args.no_cprofile and args.cprofile_steps:
        for r in res:
            print(f"\n=== cProfile, rank {r['rank']}, {args.cprofile_steps} steps ===")
            print(r["cprofile"])
    C.write_json(
        args.json,
        {
            "command": ["profile_step.py", *(argv if argv is not None else sys.argv[1:])],
            "ranks": res,
            "rows": rows,
        },
    )
    return rows


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
