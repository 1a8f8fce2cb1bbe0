"""The planner against Megatron-LM 2021 Table 1 (docs/planner.md): predicted TFLOP/s per GPU
of each published layout, and the layout the search picks.

``python benchmarks/plan_validate.py [--search] [--json out.json]``. The published layouts are
priced as Megatron-LM 2021 ran them: unfused attention (``flash=False``), full recompute,
microbatch 1, the data-parallel all-reduce after the pipeline drains (``overlap_grad_reduce=
False``), with the simulator. ``--search`` also searches each row's GPUs and batch over the
same system (all schedules, recompute modes, microbatches) and reports the best layout.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from funcpipe.plan import Layout, Transformer, cluster, estimate, search
from funcpipe.plan.published import MEGATRON_2021


def model_of(layers: int, hidden: int, heads: int) -> Transformer:
    return Transformer(layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048,
                       flash=False)  # fmt: skip


def published_layout(size: float, t: int, p: int, gpus: int) -> Layout:
    v = 2 if size == 145.6 else 1
    return Layout(tensor=t, pipeline=p, data=gpus // (t * p), microbatch=1, interleave=v,
                  recompute="full", schedule="interleaved" if v > 1 else "1f1b")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--search", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--zero-bubble", action="store_true", help="only the zero-bubble rows")
    args = ap.parse_args()
    if args.zero_bubble:
        return
    a100 = cluster("a100-80gb")
    rows = []
    print(f"{'model':>7} {'layout':<34} {'published':>9} {'predicted':>9} {'ratio':>6} {'GiB':>5}")
    for size, layers, hidden, heads, t, p, gpus, batch, pub in MEGATRON_2021:
        model = model_of(layers, hidden, heads)
        lay = published_layout(size, t, p, gpus)
        e = estimate(model, a100, lay, global_batch=batch, simulate=True, overlap_grad_reduce=False)
        row = {"size_b": size, "published_tflops": pub, "layout": lay.short(),
               "predicted_tflops": e.hardware_tflops_per_gpu, "ratio": e.hardware_tflops_per_gpu / pub,
               "step_time_s": e.step_time_s, "memory_gib": e.memory_gib_per_gpu}  # fmt: skip
        print(f"{size:>6}B {lay.short():<34} {pub:>9.0f} {e.hardware_tflops_per_gpu:>9.1f} "
              f"{row['ratio']:>6.3f} {e.memory_gib_per_gpu:>5.1f}")  # fmt: skip
        if args.search:
            t0 = time.perf_counter()
            best = search(model, a100, gpus=gpus, global_batch=batch, overlap_grad_reduce=False)[0]
            row.update(search_layout=best.layout.short(), search_step_s=best.step_time_s,
                       search_seconds=time.perf_counter() - t0,
                       search_speedup=e.step_time_s / best.step_time_s)  # fmt: skip
            print(f"        search: {best.layout.short():<40} {best.step_time_s:8.2f} s vs "
                  f"{e.step_time_s:8.2f} s published ({row['search_speedup']:.2f}x, "
                  f"{row['search_seconds']:.1f} s to search)")  # fmt: skip
            # only what Megatron-LM had in 2021: no sequence parallelism, selective recompute
            # or zero-bubble schedules
            old = search(model, a100, gpus=gpus, global_batch=batch, overlap_grad_reduce=False,
                         schedules=("1f1b", "interleaved"), recompute=("none", "full"),
                         sequence_parallel=(False,))[0]  # fmt: skip
            row.update(search_2021_layout=old.layout.short(), search_2021_step_s=old.step_time_s,
                       search_2021_speedup=e.step_time_s / old.step_time_s)  # fmt: skip
            print(f"        2021 techniques: {old.layout.short():<31} {old.step_time_s:8.2f} s "
                  f"({row['search_2021_speedup']:.2f}x)")  # fmt: skip
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def zero_bubble() -> list[dict[str, object]]:
    """Illustrative only (docs/planner.md): 1F1B against ZB-H1 / ZB-H2 on an 8-GPU pipeline of a
    1.5B-class GPT (not the paper's exact configuration, which could not be confirmed)."""
    model = Transformer(layers=24, hidden=2304, heads=24, vocab=51200, seq=1024)
    a100 = cluster("a100-80gb")
    out = []
    for m in (24, 32, 64):
        times = {}
        for sched in ("1f1b", "zb-h1", "zb-h2"):
            lay = Layout(pipeline=8, schedule=sched)
            times[sched] = estimate(model, a100, lay, global_batch=m, simulate=True).step_time_s
        row = {"microbatches": m, **{k: m / v for k, v in times.items()}}
        out.append(row)
        print(f"m={m}: samples/s 1F1B {m / times['1f1b']:.2f}, ZB-H1 {m / times['zb-h1']:.2f} "
              f"({times['1f1b'] / times['zb-h1'] - 1:+.1%}), ZB-H2 {m / times['zb-h2']:.2f} "
              f"({times['1f1b'] / times['zb-h2'] - 1:+.1%})")  # fmt: skip
    return out


if __name__ == "__main__":
    main()
    zero_bubble()
