"""What a periodic checkpoint costs the training loop: the demo's steps with a save every
``--every`` steps, written in the background (``checkpoint.save_model_async``, what
``funcpipe demo --checkpoint-every`` does) or on the loop's path (``checkpoint.save_model``),
against no save at all, on CPU gloo processes.

    python benchmarks/checkpoint_save.py [--pipeline 2] [--data 1] [--d-model 256]
        [--layers 4] [--steps 24] [--every 4] [--repeats 3] [--json FILE]

The job is the demo's own (``funcpipe.cli.demo_loop``: the GPT split into pipeline stages,
1F1B, AdamW, global-norm clipping; ``--data 2`` shards the optimizer state, ZeRO-1, so each save
first gathers the full params). Each step is timed on every rank from its start to the end of
the step's save call, if it has one (the call: the whole write for a save on the path; the
gathering of the pieces, and the wait for the previous save, for one in the background); a
step's time is its slowest rank's. The three modes run one after another in the same
processes, ``--repeats`` times in rotated order. Reported per mode: the median step without a
save, the median step with one (``save step``), the step after it, and the time of all the
steps together; ``save step / plain`` says what a save adds to the step it falls in.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C

MODES = ("none", "sync", "async")

COLUMNS: list[C.Column] = [
    ("mode", "mode", ""),
    ("state_mib", "state MiB", ".1f"),
    ("plain_ms", "plain step ms", ".1f"),
    ("save_ms", "save step ms", ".1f"),
    ("after_ms", "step after ms", ".1f"),
    ("save_over_plain", "save step / plain", ".2f"),
    ("total_s", "all steps s", ".2f"),
]


def steps_with_saves(rank: int, o: Any, mode: str, every: int, out: str) -> dict[str, Any]:
    """Pool job: ``o.steps`` demo steps, a save every ``every`` (``mode``); each step's time."""
    import torch
    import torch.distributed as dist

    from funcpipe.cli import demo_loop as L
    from funcpipe.train import checkpoint

    torch.manual_seed(o.seed)
    r, params, state = L._build(o, None)
    if r.zero:
        params = r.pipe.shard(params)
    times: list[float] = []
    pending = None
    for step in range(o.steps):
        x, y = r.batch("train", step)
        dist.barrier()
        t0 = time.perf_counter()
        params, state, _ = L._step(r, params, state, x, y)  # the demo's own step
        if mode != "none" and (step + 1) % every == 0:
            path = os.path.join(out, f"checkpoint-step{step + 1:06d}")
            full = L._full(r, params)
            if mode == "sync":
                checkpoint.save_model(path, full, opt_state=state, naming=r.naming, step=step + 1)
            else:
                if pending is not None:
                    pending.wait()
                pending = checkpoint.save_model_async(
                    path, full, opt_state=state, naming=r.naming, step=step + 1
                )
        times.append(time.perf_counter() - t0)
    if pending is not None:
        pending.wait()
    nbytes = sum(
        t.numel() * t.element_size()
        for t in torch.utils._pytree.tree_leaves((params, state))
        if isinstance(t, torch.Tensor)
    )
    return {"times": times, "bytes": nbytes}


def run(args: Any, pools: C.Pools) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from funcpipe.cli.demo_options import parse

    o = parse(
        [
            "--device", "cpu", "--pipeline", str(args.pipeline), "--tensor", "1",
            "--data", str(args.data), "--d-model", str(args.d_model),
            "--layers", str(args.layers), "--heads", "4", "--steps", str(args.steps),
            "--eval-every", "0",
        ]
    )  # fmt: skip
    o = replace(o, out=tempfile.mkdtemp(prefix="funcpipe-ckbench-"))
    pool = pools.get(o.world)
    runs: dict[str, list[list[float]]] = {m: [] for m in MODES}
    state_bytes = 0
    for rep in range(args.repeats):
        for mode in MODES[rep % 3 :] + MODES[: rep % 3]:
            out = os.path.join(o.out, f"{mode}{rep}")
            got = pool.run(steps_with_saves, o, mode, args.every, out, timeout=args.job_timeout)
            runs[mode].append(C.step_times([g["times"] for g in got]))
            state_bytes = max(g["bytes"] for g in got)
            shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(o.out, ignore_errors=True)
    rows = []
    skip = 2  # the first steps warm up
    for mode in MODES:
        plain, save, after, total = [], [], [], []
        for times in runs[mode]:
            for i, t in enumerate(times):
                if i < skip:
                    continue
                is_save = (i + 1) % args.every == 0
                (save if is_save else after if i % args.every == 0 else plain).append(t)
            total.append(sum(times[skip:]))
        plain_ms = 1e3 * C.median(plain)
        save_ms = 1e3 * C.median(save) if save else float("nan")
        rows.append(
            {
                "mode": mode,
                "state_mib": state_bytes / 2**20,
                "plain_ms": plain_ms,
                "save_ms": save_ms,
                "after_ms": 1e3 * C.median(after) if after else float("nan"),
                "save_over_plain": save_ms / plain_ms,
                "total_s": C.median(total),
                "times": runs[mode],
            }
        )
        print(C.table([rows[-1]], COLUMNS).splitlines()[-1], flush=True)
    return rows, {"every": args.every, "world": o.world}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipeline", type=int, default=2)
    ap.add_argument("--data", type=int, default=1)
    ap.add_argument("--d-model", type=int, default=256, dest="d_model")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--every", type=C.int_at_least(2), default=4)
    ap.add_argument("--repeats", type=int, default=3)
    C.pool_options(ap, seed=False, contention=False)
    return ap


def main(argv: list[str] | None = None, pool: C.PoolFactory | None = None) -> Any:
    return C.run_main("benchmarks/checkpoint_save.py", argv, pool, parser, COLUMNS, run)


if __name__ == "__main__":
    main()
