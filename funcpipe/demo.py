"""``funcpipe demo``: train a GPT with pipeline x tensor x data parallelism on local processes.

The job: a byte-level GPT (:mod:`funcpipe.models.gpt`) on text that ships with Python
(:mod:`funcpipe.data`), split into pipeline stages that are each tensor-parallel (1D, with
vocabulary-parallel embedding and cross-entropy), trained with the pure AdamW of
:mod:`funcpipe.optim` and global-norm clipping across every rank. It evaluates on the validation
split, writes a loss curve, the executed timeline of one step (picture and Chrome trace) and a
checkpoint, and prints a summary with the measured against the simulated bubble.

It starts ``pipeline x tensor x data`` local gloo processes with :func:`funcpipe.launch`, or,
under ``torchrun``, runs as one rank of the job torchrun describes (the same script).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from funcpipe.errors import InvalidArgument

__all__ = ["DemoOptions", "main", "parse", "run"]


@dataclass(frozen=True)
class DemoOptions:
    pipeline: int = 2
    tensor: int = 2
    data: int = 1
    schedule: str = "1f1b"
    microbatches: int = 4
    steps: int = 150
    batch: int = 8  # sequences per data-parallel rank and step
    context: int = 64
    d_model: int = 64
    layers: int = 4
    heads: int = 4
    lr: float = 3e-3
    eval_every: int = 50
    eval_batches: int = 4
    seed: int = 0
    out: str = "runs/demo"
    resume: bool = False
    stop_after: int = 0  # stop (with a checkpoint) after this many steps: 0 = run to --steps
    timeout: float = 1800.0
    corpus_bytes: int = 3_000_000

    @property
    def world(self) -> int:
        return self.pipeline * self.tensor * self.data


def parse(argv: Sequence[str] | None = None) -> DemoOptions:
    d = DemoOptions()
    ap = argparse.ArgumentParser(
        prog="funcpipe demo",
        description="Train a byte-level GPT with pipeline x tensor x data parallelism on local "
        "CPU processes (gloo), or as one rank under torchrun.",
    )
    ap.add_argument(
        "--pipeline", type=int, default=d.pipeline, help=f"pipeline ranks (default {d.pipeline})"
    )
    ap.add_argument(
        "--tensor", type=int, default=d.tensor, help=f"tensor-parallel size (default {d.tensor})"
    )
    ap.add_argument(
        "--data", type=int, default=d.data, help=f"data-parallel copies (default {d.data})"
    )
    ap.add_argument("--schedule", default=d.schedule, help=f"schedule name (default {d.schedule})")
    ap.add_argument("--microbatches", type=int, default=d.microbatches)
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch", type=int, default=d.batch, help="sequences per data rank per step")
    ap.add_argument("--context", type=int, default=d.context)
    ap.add_argument("--d-model", type=int, default=d.d_model, dest="d_model")
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--heads", type=int, default=d.heads)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--eval-every", type=int, default=d.eval_every, dest="eval_every")
    ap.add_argument("--eval-batches", type=int, default=d.eval_batches, dest="eval_batches")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--out", default=d.out, help="where pictures, traces and checkpoints go")
    ap.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    ap.add_argument(
        "--stop-after",
        type=int,
        default=d.stop_after,
        dest="stop_after",
        help="stop after this many steps, saving a checkpoint (as if interrupted; --resume goes on)",
    )
    ap.add_argument(
        "--timeout", type=float, default=d.timeout, help="seconds before the job is stopped"
    )
    ap.add_argument("--corpus-bytes", type=int, default=d.corpus_bytes, dest="corpus_bytes")
    args = ap.parse_args(argv)
    opts = DemoOptions(**vars(args))
    _validate(opts)
    return opts


def _validate(o: DemoOptions) -> None:
    from funcpipe.models.gpt import GPTConfig
    from funcpipe.parallel.mesh import ParallelConfig
    from funcpipe.schedule.generators import generate

    for name in (
        "pipeline",
        "tensor",
        "data",
        "microbatches",
        "steps",
        "batch",
        "context",
        "eval_batches",
    ):
        value = getattr(o, name)
        if not isinstance(value, int) or value < 1:
            raise InvalidArgument(f"--{name.replace('_', '-')}={value!r}: must be an int >= 1")
    if o.stop_after < 0 or o.stop_after > o.steps:
        raise InvalidArgument(f"--stop-after={o.stop_after}: must be in 0..--steps ({o.steps})")
    if o.eval_every < 0:
        raise InvalidArgument(f"--eval-every={o.eval_every}: must be >= 0 (0: only at the end)")
    ParallelConfig.from_dict({"pipeline": o.pipeline, "tensor": o.tensor}, world_size=o.world)
    program = generate(o.schedule, ranks=o.pipeline, microbatches=o.microbatches)
    cfg = GPTConfig(vocab=256, context=o.context, d_model=o.d_model, heads=o.heads, layers=o.layers)
    cfg.check_tensor(o.tensor)
    if program.n_stages > o.layers + 1 and program.n_stages > 1:
        raise InvalidArgument(
            f"--schedule {o.schedule} places {program.n_stages} stages but the model has "
            f"--layers {o.layers}: use at least {program.n_stages - 1} layers"
        )
    if o.batch < o.microbatches:
        raise InvalidArgument(
            f"--batch {o.batch} < --microbatches {o.microbatches}: every microbatch needs a sequence"
        )


# ------------------------------------------------------------------------------ one rank
def _shard(tree: Any, layouts: Any, place: Any, local: bool) -> Any:
    from funcpipe.parallel.layout import shard_tree
    from funcpipe.tree import tree_map

    sharded = shard_tree(tree, layouts, place)
    return sharded if local else tree_map(lambda t: t.to("meta"), sharded)


def _clip_weights(layouts: Any, n_stages: int, o: DemoOptions) -> Any:
    """Each leaf's share of the global norm: 1/tensor for leaves every tensor rank holds, 1/data
    for the data copies, 1/2 for the two tied copies of the embedding."""
    from funcpipe.parallel.layout import Layout
    from funcpipe.tree import tree_map

    def weight(lay: Layout) -> float:
        sharded = any(lay.dims)
        return (1.0 if sharded else 1.0 / o.tensor) / o.data

    out = []
    for lay in layouts:
        w = tree_map(weight, lay)
        if n_stages > 1 and "wte" in w:
            w = {**w, "wte": w["wte"] * 0.5}
        out.append(w)
    return tuple(out)


def train_rank(rank: int, o: DemoOptions) -> dict[str, Any] | None:
    """Everything one rank does; returns the summary on the first rank."""
    import torch.distributed as dist

    from funcpipe import checkpoint, optim
    from funcpipe.data import load_corpus
    from funcpipe.models import gpt
    from funcpipe.parallel.mesh import build_mesh
    from funcpipe.pipeline import Pipeline
    from funcpipe.schedule.generators import generate, to_eval
    from funcpipe.schedule.simulate import simulate

    torch.manual_seed(o.seed)
    mesh = build_mesh({"pipeline": o.pipeline, "tensor": o.tensor})
    place = mesh.place
    axis = mesh["tensor"]
    prank, drank = place.coords["pipe"], place.coords["data"]
    cfg = gpt.GPTConfig(
        vocab=256, context=o.context, d_model=o.d_model, heads=o.heads, layers=o.layers
    )
    program = generate(o.schedule, ranks=o.pipeline, microbatches=o.microbatches)
    n = program.n_stages
    full = gpt.split(gpt.init(cfg, seed=o.seed), cfg, n)
    layouts = gpt.layouts(cfg, n)
    mine = set(program.stages_on(prank))
    params = tuple(_shard(full[s], layouts[s], place, s in mine) for s in range(n))
    stages = gpt.stages(cfg, n, axis=axis)
    loss = gpt.loss_fn(axis=axis)
    pipe = Pipeline(
        stages,
        program,
        loss_fn=loss,
        ties=gpt.tie_spec(n),
        transport="dist",
        mesh=mesh,
        scatter_gather=o.tensor > 1,  # each tensor rank sends 1/t of every boundary tensor
    )
    evaluate = Pipeline(stages, to_eval(program), loss_fn=loss, transport="dist", mesh=mesh)
    schedule = optim.warmup_cosine(
        o.lr, warmup=max(1, o.steps // 10), total=o.steps, final=o.lr / 10
    )
    opt = optim.adamw(schedule, weight_decay=0.01)
    state = opt.init(params)
    weights = _clip_weights(layouts, n, o)
    corpus = load_corpus(max_bytes=o.corpus_bytes)
    ckpt_dir = os.path.join(o.out, "checkpoint")
    tag = f"tensor{axis.coord}of{o.tensor}"  # tensor shards get keys of their own
    start = 0
    history: dict[str, list[list[float]]] = {"train": [], "val": []}
    # the newest complete checkpoint: `checkpoint`, or the `checkpoint.old-*` a save killed
    # between its two renames left behind (never a half-written `.tmp-` one)
    found = checkpoint.latest(o.out) if o.resume else None
    if found is not None:
        like = {tag: {"params": params, "opt": state}, "step": 0}
        loaded = checkpoint.load(found, like)
        params, state, start = loaded[tag]["params"], loaded[tag]["opt"], int(loaded["step"])
        hist_file = os.path.join(o.out, "history.json")
        if os.path.exists(hist_file):
            with open(hist_file) as f:
                history = json.load(f)
            history = {k: [row for row in v if row[0] < start] for k, v in history.items()}
    first = dist.get_rank() == 0
    tty = first and sys.stdout.isatty()
    tokens_per_step = o.batch * o.data * o.context

    def val_loss() -> float:
        total = 0.0
        for k in range(o.eval_batches):
            x, y = corpus.get_batch(
                "val",
                k,
                batch=o.batch,
                context=o.context,
                seed=o.seed,
                data_rank=drank,
                data_size=o.data,
            )
            total += float(evaluate.step(params, x, y).loss)  # type: ignore[arg-type]
        return total / o.eval_batches

    if start == 0:
        history["val"].append([0, val_loss()])  # where it starts: about ln 256
    t_start = time.perf_counter()
    step_times: list[float] = []
    last = float("nan")
    end = o.stop_after or o.steps
    for step in range(start, end):
        x, y = corpus.get_batch(
            "train",
            step,
            batch=o.batch,
            context=o.context,
            seed=o.seed,
            data_rank=drank,
            data_size=o.data,
        )
        t0 = time.perf_counter()
        result = pipe.step(params, x, y)
        held = tuple(
            w if g is not None else None for w, g in zip(weights, result.grads, strict=True)
        )
        grads, _ = optim.clip_by_global_norm(
            result.grads, 1.0, group=dist.group.WORLD, weights=held
        )
        params, state = opt.update(grads, state, params)
        step_times.append(time.perf_counter() - t0)
        last = float(result.loss)  # type: ignore[arg-type]
        history["train"].append([step, last])
        if o.eval_every and (step + 1) % o.eval_every == 0 and step + 1 < o.steps:
            history["val"].append([step + 1, val_loss()])
        if first:
            recent = step_times[-10:]
            tps = tokens_per_step * len(recent) / sum(recent)
            _progress(step + 1, o.steps, last, tps, tty, history["val"])
    if end < o.steps:  # interrupted on purpose: keep what a resume needs, nothing else
        checkpoint.save(ckpt_dir, {tag: {"params": params, "opt": state}, "step": end})
        if first:
            os.makedirs(o.out, exist_ok=True)
            with open(os.path.join(o.out, "history.json"), "w") as f:
                json.dump(history, f)
        return None
    final_val = val_loss()
    history["val"].append([o.steps, final_val])

    # one traced step: the executed timeline, against the simulator fed its measured costs
    x, y = corpus.get_batch(
        "train",
        o.steps,
        batch=o.batch,
        context=o.context,
        seed=o.seed,
        data_rank=drank,
        data_size=o.data,
    )
    traced = pipe.step(params, x, y, trace=True).timeline
    costs = _measured_costs(traced)
    simulated = simulate(pipe.program, costs)
    checkpoint.save(ckpt_dir, {tag: {"params": params, "opt": state}, "step": o.steps})
    if not first:
        return None
    os.makedirs(o.out, exist_ok=True)
    with open(os.path.join(o.out, "history.json"), "w") as f:
        json.dump(history, f)
    files = _pictures(o, history, traced)
    measured = step_times[len(step_times) // 4 :] or step_times
    summary = {
        "options": asdict(o),
        "steps": o.steps,
        "start_step": start,
        "final_train_loss": _mean_last(history["train"], 10),
        "first_val_loss": history["val"][0][1] if history["val"] else None,
        "final_val_loss": final_val,
        "tokens_per_s": tokens_per_step * len(measured) / sum(measured) if measured else None,
        "wall_s": time.perf_counter() - t_start,
        "bubble_measured": traced.bubble_fraction,
        "bubble_simulated": simulated.bubble_fraction,
        "makespan_measured_ms": traced.makespan * 1e3,
        "makespan_simulated_ms": simulated.makespan * 1e3,
        "files": files,
        "last_loss": last,
        "p2p_bytes_per_step_rank0": pipe.bytes_sent / max(1, o.steps - start + 1),
    }
    with open(os.path.join(o.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _mean_last(rows: list[list[float]], k: int) -> float | None:
    tail = [v for _, v in rows[-k:]]
    return sum(tail) / len(tail) if tail else None


def _measured_costs(timeline: Any) -> Any:
    """Per-stage median F, B (split in I/W halves when only B ran), I and W times of a run."""
    from collections import defaultdict

    from funcpipe.schedule.ir import Op
    from funcpipe.schedule.simulate import Costs

    spans: dict[tuple[Op, int], list[float]] = defaultdict(list)
    for rank in timeline.events:
        for e in rank:
            spans[(e.instr.op, e.instr.stage)].append(e.end - e.start)

    def med(v: list[float]) -> float:
        v = sorted(v)
        return v[len(v) // 2] if v else 0.0

    n = timeline.program.n_stages
    f = [med(spans[(Op.F, s)]) for s in range(n)]
    b, w = [], []
    for s in range(n):
        if spans[(Op.I, s)]:
            b.append(med(spans[(Op.I, s)]))
            w.append(med(spans[(Op.W, s)]))
        else:
            full = med(spans[(Op.B, s)])
            b.append(full / 2)
            w.append(full / 2)
    return Costs(f=f, b=b, w=w)


def _progress(
    step: int, total: int, loss: float, tps: float, tty: bool, val: list[list[float]]
) -> None:
    width = 30
    done = int(width * step / total)
    bar = "=" * done + (">" if done < width else "") + " " * (width - done - 1)
    vtxt = f" | val {val[-1][1]:.3f}" if val else ""
    line = f"step {step:4d}/{total} [{bar}] loss {loss:.3f}{vtxt} | {tps / 1000:.1f}k tok/s"
    if tty:
        print("\r" + line, end="" if step < total else "\n", flush=True)
    elif step == 1 or step % max(1, total // 10) == 0 or step == total:
        print(line, flush=True)


def _pictures(o: DemoOptions, history: dict[str, list[list[float]]], traced: Any) -> dict[str, str]:
    from funcpipe.schedule.render import draw_timeline, write_chrome_trace

    files = {}
    trace_path = os.path.join(o.out, "step_trace.json")
    write_chrome_trace(traced, trace_path)
    files["trace"] = trace_path
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib.figure import Figure
    except ImportError:  # pictures are an optional extra
        return files
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    steps, losses = zip(*history["train"], strict=True) if history["train"] else ((), ())
    ax.plot(steps, losses, lw=0.8, alpha=0.5, label="train (per step)")
    if len(losses) >= 10:
        k = 10
        smooth = [sum(losses[i - k + 1 : i + 1]) / k for i in range(k - 1, len(losses))]
        ax.plot(steps[k - 1 :], smooth, lw=1.6, label="train (mean of 10)")
    if history["val"]:
        vs, vl = zip(*history["val"], strict=True)
        ax.plot(vs, vl, "o-", lw=1.6, label="validation")
    ax.axhline(math.log(256), ls=":", c="grey", lw=0.8, label="uniform over bytes (ln 256)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(
        f"GPT on Python's own sources: pipeline {o.pipeline} x tensor {o.tensor} x data {o.data}, {o.schedule}"
    )
    ax.legend()
    fig.tight_layout()
    curve = os.path.join(o.out, "loss_curve.png")
    fig.savefig(curve, dpi=110)
    files["loss_curve"] = curve
    timeline_png = os.path.join(o.out, "step_timeline.png")
    draw_timeline(
        traced,
        timeline_png,
        title=f"one executed step ({o.schedule}, {o.pipeline} ranks)",
        unit="s",
    )
    files["timeline"] = timeline_png
    return files


# ------------------------------------------------------------------------------ entry
def run(o: DemoOptions) -> dict[str, Any] | None:
    from funcpipe.launcher import launch, under_torchrun

    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != o.world:
            raise InvalidArgument(
                f"torchrun started {world} processes but pipeline x tensor x data = {o.world}; "
                f"pass --nproc-per-node {o.world} (or change the sizes)"
            )
    results = launch(train_rank, o.world, o, timeout=o.timeout)
    summary = next((r for r in results if r is not None), None)
    if summary is not None:
        _print_summary(summary)
    return summary


def _print_summary(s: dict[str, Any]) -> None:
    o = s["options"]
    print()
    print(
        f"pipeline {o['pipeline']} x tensor {o['tensor']} x data {o['data']}, schedule {o['schedule']}, "
        f"{s['steps']} steps ({s['wall_s']:.0f} s)"
    )
    print(f"  train loss (last 10 steps)  {s['final_train_loss']:.3f}")
    print(
        f"  validation loss             {s['first_val_loss']:.3f} -> {s['final_val_loss']:.3f}"
        f"   (uniform over bytes: {math.log(256):.3f})"
    )
    print(f"  throughput                  {s['tokens_per_s'] / 1000:.1f}k tokens/s")
    print(
        f"  one step: makespan {s['makespan_measured_ms']:.1f} ms measured, "
        f"{s['makespan_simulated_ms']:.1f} ms simulated from its own F/B times"
    )
    print(
        f"  bubble                      {100 * s['bubble_measured']:.1f}% measured, "
        f"{100 * s['bubble_simulated']:.1f}% simulated"
    )
    for name, path in s["files"].items():
        print(f"  {name:<28}{path}")


def main(argv: Sequence[str] | None = None) -> int:
    run(parse(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
