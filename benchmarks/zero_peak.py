"""The peak bytes inside a training step, per rank, of sharded data parallelism (``zero``
0, 1, and 2 where the Pipeline has it), on CPU gloo processes.

    python benchmarks/zero_peak.py [--size gpt] [--data 2] [--zero-levels 0 1 2] [--json FILE]

The run of :mod:`benchmarks.zero`: the benchmark GPT (fp32) in 2 pipeline stages (1F1B),
``data`` copies (``2 x data`` processes), each copy ``1 / data`` of the global batch, AdamW. On
every rank, after ``--warmup`` training steps, one ``pipe.step`` and then the AdamW update run
under :class:`benchmarks.peak_memory.StorageTracker` (every tensor storage created in the rank's
thread, counted by ``nbytes`` from its creation until it is freed), with what the rank held
before the step tagged first. Each storage is labelled by where it was made or what it became:

- ``params``: the parameters the rank keeps between steps (full, or its shards);
- ``optimizer``: AdamW's ``mu`` and ``nu``; ``batch``: this copy's inputs and targets;
- ``gathered``: the full parameters a sharded step gathers into (``Pipeline.step``);
- ``gradients``: the parameters' gradient sums (``.grad``, relabelled as autograd or a W
  accumulates into them);
- ``activations``: what forwards (and recomputes) make: outputs, tensors saved for backward;
- ``backward``: what B / I / W make besides the gradient sums (input gradients, temporaries);
- ``collectives``: the buffers of the gradient reductions and of the all-gathers (the packed
  pieces, the gathered output, the flattened bucket, the reduced shards), made when an
  instruction starts one or when it finishes; ``p2p``: send and receive buffers;
- ``update``: the new parameters and optimizer state the update makes;
- ``other``: the rest inside the step (the gradients it returns, the per-step agreement).

Not counted (see :mod:`benchmarks.peak_memory`): gloo's own buffers inside a collective (its
threads), scratch a kernel frees before it returns, and the allocator's overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C

MIB = 2**20
LABELS = [
    "params",
    "optimizer",
    "batch",
    "gathered",
    "gradients",
    "activations",
    "backward",
    "collectives",
    "p2p",
    "update",
    "other",
]
# _Rank methods -> the label of what they make (each must exist: a renamed one is an error here,
# not bytes silently counted as "other")
METHOD_LABELS = {
    "forward": "activations",
    "recompute": "activations",
    "backward": "backward",
    "backward_input": "backward",
    "backward_weight": "backward",
    "post": "p2p",
    "reduce": "collectives",
    "scatter": "collectives",
    "gather": "collectives",
}

COLUMNS: list[C.Column] = [
    ("data", "data", "d"),
    ("zero", "zero", "d"),
    ("rank", "rank", "d"),
    ("stage", "stage", "d"),
    ("held_mib", "held before MiB", ".2f"),
    ("step_peak_mib", "step peak MiB", ".2f"),
    ("expected_mib", "expected MiB", ".2f"),
    ("expected_at", "expected at", ""),
    ("ratio", "measured / expected", ".3f"),
    ("at_gathered_mib", "at peak: gathered", ".2f"),
    ("at_gradients_mib", "gradients", ".2f"),
    ("at_activations_mib", "activations + backward", ".2f"),
    ("at_collectives_mib", "collectives", ".2f"),
    ("update_peak_mib", "update peak MiB", ".2f"),
    ("after_mib", "after MiB", ".2f"),
]


def _grads_to(tracker: Any, leaves: Any) -> None:
    for t in leaves:
        if t.grad is not None:
            tracker.tag(t.grad, "gradients")


@contextlib.contextmanager
def instrument(tracker: Any) -> Iterator[None]:
    """Label what the runtime makes, by the instruction making it (:data:`METHOD_LABELS`),
    gradient sums as ``gradients`` once accumulated, and a sharded step's full parameters as
    ``gathered``; the runtime restored on exit."""
    from funcpipe.pipeline import zero as pzero
    from funcpipe.runtime import interpreter as it

    patched: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, wrap: Callable[[Any], Any]) -> None:
        if not hasattr(owner, name):
            raise RuntimeError(
                f"zero_peak: {owner.__name__}.{name} is gone; update the labels "
                "(METHOD_LABELS, instrument) to the runtime"
            )
        patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, wrap(getattr(owner, name)))

    def labelled(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            with tracker.labelled(label):
                got = fn(self, *args, **kwargs)
            for leaves in self.leaves.values():
                _grads_to(tracker, leaves)
            return got

        return wrapper

    def rank_init(real: Callable[..., Any]) -> Callable[..., Any]:
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            real(self, *args, **kwargs)
            for leaves in self.leaves.values():
                for t in leaves:
                    if t.requires_grad:
                        t.register_post_accumulate_grad_hook(lambda p: _grads_to(tracker, [p]))

        return init

    def pending_init(real: Callable[..., Any]) -> Callable[..., Any]:
        def init(self: Any, handle: Any, done: Callable[[], None]) -> None:
            def finish() -> None:
                with tracker.labelled("collectives"):
                    done()

            real(self, handle, finish)

        return init

    def unshard(real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with tracker.labelled("gathered"):
                return real(*args, **kwargs)

        return wrapper

    try:
        for name, label in METHOD_LABELS.items():
            patch(it._Rank, name, functools.partial(labelled, label=label))
        patch(it._Rank, "__init__", rank_init)
        patch(it._Pending, "__init__", pending_init)
        patch(pzero, "pipe_unshard", unshard)
        yield
    finally:
        for owner, name, real in reversed(patched):
            setattr(owner, name, real)


def measure(run: Any, x: Any, y: Any) -> dict[str, Any]:
    """One step and update of ``run`` (a :class:`benchmarks.zero._Run`) under a tracker."""
    from benchmarks.peak_memory import StorageTracker

    run.grads = None
    tracker = StorageTracker()
    with tracker, instrument(tracker):
        held = {  # (the rank's stages only: run.values holds every stage's params)
            "params": tracker.tag([run.values[o] for o in run.mine], "params"),
            "optimizer": tracker.tag(run.states, "optimizer"),
            "batch": tracker.tag((x, y), "batch"),
        }
        tracker.reset_peak()
        _, grads = run.pipe.step(run.values, x, y)
        step = (tracker.peak, dict(tracker.peak_by_label))
        returned = tracker.labels_of(grads)
        tracker.tag([grads[o] for o in run.mine], "gradients")  # (returned: the update's input)
        tracker.reset_peak()
        with tracker.labelled("update"):
            values = list(run.values)
            for o in run.mine:
                values[o], run.states[o] = run.opt.update(grads[o], run.states[o], values[o])
            run.values = tuple(values)
        update = (tracker.peak, dict(tracker.peak_by_label))
        del grads, values
        after = (tracker.current, dict(tracker.by_label))
    return {
        "held": held,
        "step_peak": step[0],
        "step_by_label": step[1],
        "returned_labels": sorted(returned),
        "update_peak": update[0],
        "update_by_label": update[1],
        "after": after[0],
        "after_by_label": after[1],
    }


def job(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from benchmarks import zero
    from funcpipe.measure.profile import measure_memory
    from funcpipe.schedule import peak_memory

    size = C.Size(**cfg["size"])
    data = dist.get_world_size() // 2
    x, y = C.data(size, seed=cfg["seed"] + 1)
    out: dict[str, Any] = {"rank": rank, "data": data, "levels": {}}
    for z in cfg["levels"]:
        run = zero._Run(size, z, cfg["microbatches"], cfg["seed"], cfg["schedule"])
        copy = run.pipe._world.copy  # type: ignore[union-attr]
        share = size.batch // data
        xs = x[copy * share : (copy + 1) * share].clone()  # (storages of their own)
        ys = y[copy * share : (copy + 1) * share].clone()
        if "activation" not in out:  # the schedule's figure of the bytes saved for backward
            n = run.pipe.program.n_stages
            stages, params = C.funcpipe_stages(C.build(size, seed=cfg["seed"]), size, n)
            mb = share // cfg["microbatches"]
            got = measure_memory(stages, params, xs[:mb], loss_fn=C.loss_fn(size), target=ys[:mb])
            out["activation"] = peak_memory(run.pipe.program, got.activation, got.for_w)[
                run.pipe.rank
            ]
        for _ in range(cfg["warmup"]):
            run.train_step(xs, ys)
        dist.barrier()
        out["levels"][z] = measure(run, xs, ys)
        out["copy"], out["stages"] = copy, run.mine
        out["param_bytes"] = sum(zero.nbytes(run.full[o]) for o in run.mine)
        run.pipe.close()
        dist.barrier()
    return out


def expected(r: dict[str, Any], z: int) -> dict[str, float]:
    """The step's peak from arithmetic, in bytes. ``P``: the rank's stage's parameters (full),
    ``d`` copies, ``A``: the schedule's peak of bytes saved for backward (``peak_memory`` with
    each stage's ``measure_memory``), ``held``: the parameters, AdamW state and batch before
    the step (3P or 3P/d, + the batch). Two moments of a step:

    - ``backward``: the activations at their peak beside the gradient sums (P: zero=2's are
      one microbatch's, beside its 1/d accumulator) and, sharded, the gathered parameters (P);
    - ``reduction``: zero=0: the sums and their flattened bucket (P each); sharded: the
      gradients, their packed copy for the reduce-scatter (P each) and the reduced shards
      (P/d; zero=2 adds its accumulator, P/d), beside the gathered parameters.
    """
    p, d, a = r["param_bytes"], r["data"], r["activation"]
    batch = r["levels"][z]["held"]["batch"]
    held = 3 * (p if z == 0 else p / d) + batch
    gathered = 0 if z == 0 else p
    accumulator = p / d if z == 2 else 0
    backward = held + gathered + p + a + accumulator
    reduction = held + 2 * p if z == 0 else held + gathered + 2 * p + p / d + accumulator
    return {
        "held": held,
        "backward": backward,
        "reduction": reduction,
        "peak": max(backward, reduction),
    }


def run(args: argparse.Namespace, pools: C.Pools) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from benchmarks import zero_peak

    size = C.resize(C.SIZES[args.size], layers=args.layers)
    levels = list(args.zero_levels)
    rows: list[dict[str, Any]] = []
    for data in args.data:
        if size.batch % (data * args.microbatches):
            raise SystemExit(
                f"--data {data} --microbatches {args.microbatches}: the global batch of "
                f"{size.batch} sequences must split into data x microbatches"
            )
        cfg = {
            "size": vars(size),
            "microbatches": args.microbatches,
            "warmup": args.warmup,
            "levels": levels,
            "seed": args.seed,
            "schedule": args.schedule,
        }
        pool = pools.get(2 * data)
        got = pool.run(zero_peak.job, cfg, timeout=args.job_timeout)
        for r in sorted(got, key=lambda r: r["rank"]):
            for z in levels:
                rows.append({**row(size.name, r, z), "schedule": args.schedule})
                print(C.table([rows[-1]], COLUMNS).splitlines()[-1], flush=True)
    return rows, {"levels": levels}


def row(size: str, r: dict[str, Any], z: int) -> dict[str, Any]:
    m = r["levels"][z]
    at = m["step_by_label"]
    return {
        "size": size,
        "data": r["data"],
        "zero": z,
        "rank": r["rank"],
        "copy": r["copy"],
        "stage": "+".join(str(s) for s in r["stages"]),
        "param_bytes": r["param_bytes"],
        "activation_figure": r["activation"],
        "held_mib": sum(m["held"].values()) / MIB,
        "step_peak_mib": m["step_peak"] / MIB,
        "update_peak_mib": m["update_peak"] / MIB,
        "after_mib": m["after"] / MIB,
        "expected": (e := expected(r, z)),
        "expected_mib": e["peak"] / MIB,
        "expected_at": "backward" if e["backward"] >= e["reduction"] else "reduction",
        "ratio": m["step_peak"] / e["peak"],
        **{f"at_{k}_mib": at.get(k, 0) / MIB for k in ("gathered", "gradients", "collectives")},
        "at_activations_mib": (at.get("activations", 0) + at.get("backward", 0)) / MIB,
        **m,
    }


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="zero_peak.py",
        description="Peak bytes of live tensors per rank inside a step of Pipeline(zero=0/1/2).",
    )
    ap.add_argument("--size", default="gpt", choices=[n for n, s in C.SIZES.items()])
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument(
        "--data", nargs="+", type=C.int_at_least(2, "sharding needs copies"), default=[2]
    )
    ap.add_argument(
        "--schedule",
        default="1f1b",
        choices=["1f1b", "interleaved", "zbv"],
        help="1f1b: a stage per rank; interleaved, zbv: two (default 1f1b)",
    )
    ap.add_argument("--zero-levels", nargs="+", type=int, default=[0, 1, 2], choices=[0, 1, 2])
    ap.add_argument("--microbatches", type=C.int_at_least(1), default=4, help="per copy")
    ap.add_argument("--warmup", type=C.int_at_least(1), default=1, help="steps before")
    C.pool_options(ap, job_timeout=900.0, contention=False)
    return ap


def main(
    argv: list[str] | None = None, *, pool: C.PoolFactory | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run the benchmark; ``pool(n)`` may supply started pools of ``n`` gloo processes."""
    result: tuple[list[dict[str, Any]], dict[str, Any]] = C.run_main(
        "zero_peak.py", argv, pool, parser, COLUMNS, run
    )
    return result


if __name__ == "__main__":
    main()
