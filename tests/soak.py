"""Soak: hundreds of training steps of the demo's GPT over 2 gloo processes, the batch size and
the sequence length changing every step; memory must not grow and the pipeline must not drift
from the single-device reference.

Every step: a 1F1B step of a tiny float64 GPT (2 pipeline stages, tied embedding) on a batch of
a new shape, then each rank broadcasts its stage's gradients (tensors) so that every rank can
apply the same SGD update to the full params. Every ``check_every`` steps every rank also runs
``funcpipe.reference_step`` on the same params and batch and records the largest difference of
the loss and of the gradients. Each rank reports its resident memory (VmRSS) after a warm-up
and at the end, and its peak (VmHWM); and the same two after ``malloc_trim`` (live memory,
without what glibc keeps on its free lists). Memory grows by a few MB while new batch shapes
appear (cached shape inference) and then stays flat (docs/errors.md, "Load: the soak").

Full size (300 steps; the test suite runs 100)::

    .venv/bin/python -m tests.soak --steps 300
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import funcpipe as fp
from funcpipe.models import gpt
from funcpipe.schedule.generators import generate
from funcpipe.tree import tree_flatten, tree_map, tree_unflatten

CFG = gpt.GPTConfig(vocab=32, context=16, d_model=16, heads=2, layers=2, mlp=32)
MICROBATCHES = 4
LR = 0.05


def _memory() -> dict[str, float]:
    """This process's resident memory now and at its peak, in MB (from /proc/self/status)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def _trimmed() -> float:
    """VmRSS after handing freed heap memory back to the OS (glibc ``malloc_trim``): what is
    live, without the allocator's free lists (``nan`` where there is no glibc)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return float("nan")
    return _memory()["VmRSS"]


def batch(step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s tokens: 4..12 sequences of 2..16 tokens (a new shape almost every step)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    rows = int(torch.randint(MICROBATCHES, 13, (), generator=g))
    length = int(torch.randint(2, CFG.context + 1, (), generator=g))
    tokens = torch.randint(0, CFG.vocab, (rows, length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _tied_reference(
    stages: Any, params: Any, x: torch.Tensor, y: torch.Tensor, loss_fn: Any
) -> tuple[torch.Tensor, tuple[Any, ...]]:
    loss, grads = fp.reference_step(
        stages, params, x, loss_fn, targets=y, microbatches=MICROBATCHES
    )
    grads = [dict(g) for g in grads]
    total = grads[0]["wte"] + grads[-1]["wte"]  # one parameter used by two stages
    grads[0]["wte"], grads[-1]["wte"] = total, total
    return loss, tuple(grads)


def _largest_difference(a: Any, b: Any) -> float:
    la, lb = tree_flatten(a)[0], tree_flatten(b)[0]
    return max(float((u - v).abs().max()) for u, v in zip(la, lb, strict=True))


def soak_rank(rank: int, steps: int, check_every: int = 25, warmup: int = 20) -> dict[str, Any]:
    """One rank of the soak; returns its numbers (memory in MB, drift, seconds)."""
    trimmed: dict[str, float] = {}
    import torch.distributed as dist

    torch.manual_seed(0)
    program = generate("1f1b", ranks=2, microbatches=MICROBATCHES)
    n = program.n_stages
    axis = gpt.single_axis()
    stages = gpt.stages(CFG, n, axis=axis)
    loss_fn = gpt.loss_fn(axis=axis)
    params: tuple[Any, ...] = gpt.split(gpt.init(CFG, seed=0, dtype=torch.float64), CFG, n)
    pipe = fp.Pipeline(stages, program, loss_fn=loss_fn, ties=gpt.tie_spec(n), transport="dist")
    owner = {s: program.placement[s] for s in range(n)}
    drift_loss = drift_grads = 0.0
    checks = 0
    shapes = set()
    memory: dict[str, dict[str, float]] = {"start": _memory()}
    t0 = time.perf_counter()
    for step in range(steps):
        if step == warmup:
            memory["after_warmup"] = _memory()
            trimmed["after_warmup"] = _trimmed()
        x, y = batch(step)
        shapes.add(tuple(x.shape))
        loss, grads = pipe.step(params, x, y)
        full = []
        for s in range(n):  # every rank gets every stage's gradients (tensors only)
            _, tree = tree_flatten(params[s])
            mine = grads[s] if grads[s] is not None else tree_map(torch.empty_like, params[s])
            leaves = tree_flatten(mine)[0]
            flat = torch.cat([t.reshape(-1) for t in leaves])
            dist.broadcast(flat, src=owner[s])
            parts, k = [], 0
            for t in leaves:
                parts.append(flat[k : k + t.numel()].view_as(t))
                k += t.numel()
            full.append(tree_unflatten(tree, parts))
        if step % check_every == 0 or step == steps - 1:
            ref_loss, ref_grads = _tied_reference(stages, params, x, y, loss_fn)
            drift_loss = max(drift_loss, float((loss - ref_loss).abs()))  # type: ignore[operator]
            drift_grads = max(drift_grads, _largest_difference(tuple(full), ref_grads))
            checks += 1
        params = tuple(
            tree_map(lambda p, g: p - LR * g, p, g) for p, g in zip(params, full, strict=True)
        )
    seconds = time.perf_counter() - t0
    memory["end"] = _memory()
    trimmed["end"] = _trimmed()
    return {
        "rank": rank,
        "steps": steps,
        "distinct_shapes": len(shapes),
        "checks": checks,
        "max_loss_drift": drift_loss,
        "max_grad_drift": drift_grads,
        "final_loss": float(loss),  # type: ignore[arg-type]
        "seconds": seconds,
        "rss_mb": {k: round(v["VmRSS"], 1) for k, v in memory.items()},
        "peak_rss_mb": round(memory["end"]["VmHWM"], 1),
        "rss_growth_mb": round(memory["end"]["VmRSS"] - memory["after_warmup"]["VmRSS"], 1),
        "trimmed_rss_mb": {k: round(v, 1) for k, v in trimmed.items()},
        "trimmed_growth_mb": round(trimmed["end"] - trimmed["after_warmup"], 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--check-every", type=int, default=25)
    args = ap.parse_args(argv)
    root = str(Path(__file__).resolve().parents[1])
    with fp.Pool(2, timeout=max(120.0, args.steps), pg_timeout=120.0, paths=[root]) as pool:
        results = pool.run(soak_rank, args.steps, args.check_every)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
