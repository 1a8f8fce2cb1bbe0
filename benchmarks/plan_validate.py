"""The planner against Megatron-LM 2021 Table 1 (docs/planner.md): predicted TFLOP/s per GPU
of each published layout, and the layout the search picks.

``python benchmarks/plan_validate.py [--search] [--json out.json]``; ``--zero-bubble`` prices
the Zero Bubble paper's Table 4 runs instead (``--vocab N`` to try another vocabulary). The
published layouts are priced as Megatron-LM 2021 ran them: unfused attention (``flash=False``), full recompute,
microbatch 1, the data-parallel all-reduce after the pipeline drains (``overlap_grad_reduce=
False``), with the simulator. ``--search`` also searches each row's GPUs and batch over the
same system (all schedules, recompute modes, microbatches) and reports the best layout.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from funcpipe.planner import ClusterLayout, Transformer, cluster, estimate, search
from funcpipe.planner.published import (
    MEGATRON_2021,
    ZERO_BUBBLE_2024_MEMORY_GB,
    ZERO_BUBBLE_2024_MODELS,
    ZERO_BUBBLE_2024_STANDINS,
    ZERO_BUBBLE_2024_SYNCHRONIZED,
    ZERO_BUBBLE_2024_THROUGHPUT,
    zero_bubble_run,
)


def model_of(layers: int, hidden: int, heads: int) -> Transformer:
    return Transformer(layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048,
                       flash=False)  # fmt: skip


def published_layout(size: float, t: int, p: int, gpus: int) -> ClusterLayout:
    v = 2 if size == 145.6 else 1
    return ClusterLayout(tensor=t, pipeline=p, data=gpus // (t * p), microbatch=1, interleave=v,
                  recompute="full", schedule="interleaved" if v > 1 else "1f1b")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--search", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--zero-bubble", action="store_true", help="the Zero Bubble rows instead")
    ap.add_argument("--vocab", type=int, default=None, help="Zero Bubble rows: another vocabulary")
    args = ap.parse_args()
    if args.zero_bubble:
        rows = zero_bubble(args.vocab)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
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
            # only what Megatron-LM had in 2021: no sequence parallelism, selective recompute,
            # zero-bubble schedules or sharded optimizer state
            old = search(model, a100, gpus=gpus, global_batch=batch, overlap_grad_reduce=False,
                         schedules=("1f1b", "interleaved"), recompute=("none", "full"),
                         sequence_parallel=(False,), zero=(0,))[0]  # fmt: skip
            row.update(search_2021_layout=old.layout.short(), search_2021_step_s=old.step_time_s,
                       search_2021_speedup=e.step_time_s / old.step_time_s)  # fmt: skip
            print(f"        2021 techniques: {old.layout.short():<31} {old.step_time_s:8.2f} s "
                  f"({row['search_2021_speedup']:.2f}x)")  # fmt: skip
        rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


def zero_bubble(vocab: int | None = None) -> list[dict[str, object]]:
    """Zero Bubble (Qi et al., ICLR 2024) Table 4: samples per GPU per second of 1F1B, ZB-1p
    and ZB-2p, predicted for the paper's runs (:func:`funcpipe.planner.published.zero_bubble_run`;
    ZB-H1 and ZB-H2 price ZB-1p and ZB-2p) with the simulator, beside the published ones."""
    a100 = cluster("a100-80gb")
    rows: list[dict[str, object]] = []
    print(f"{'model':>6} {'m':>4} {'schedule':<8} {'priced as':<9} {'published':>9} "
          f"{'predicted':>9} {'ratio':>6} {'GB pub':>6} {'GiB pred':>8}")  # fmt: skip
    for name, (*_, p, _b, ms) in ZERO_BUBBLE_2024_MODELS.items():
        for k, m in enumerate(ms):
            base: dict[str, float] = {}
            for sched, standin in ZERO_BUBBLE_2024_STANDINS.items():
                model, lay, batch = zero_bubble_run(name, m, sched)
                if vocab is not None:
                    model = replace(model, vocab=vocab)
                e = estimate(model, a100, lay, global_batch=batch, simulate=True)
                got = batch / e.step_time_s / p
                pub = ZERO_BUBBLE_2024_THROUGHPUT[name][sched][k]
                base.setdefault("pred", got)
                base.setdefault("pub", pub)
                row = {"model": name, "microbatches": m, "schedule": sched, "priced_as": standin,
                       "published": pub, "predicted": got, "ratio": got / pub,
                       "speedup_over_1f1b_published": pub / base["pub"],
                       "speedup_over_1f1b_predicted": got / base["pred"],
                       "memory_gb_published": ZERO_BUBBLE_2024_MEMORY_GB[name][sched],
                       "memory_gib_predicted": e.memory_gib_per_gpu}  # fmt: skip
                rows.append(row)
                print(f"{name:>6} {m:>4} {sched:<8} {standin:<9} {pub:>9.2f} {got:>9.2f} "
                      f"{got / pub:>6.3f} {row['memory_gb_published']:>6.0f} "
                      f"{e.memory_gib_per_gpu:>8.1f}")  # fmt: skip
    ratios = [float(r["ratio"]) for r in rows]  # type: ignore[arg-type]
    print(f"predicted / published: {min(ratios):.3f}-{max(ratios):.3f} over {len(rows)} cells")
    print("ZB-2p with an all-reduce synchronization before the optimizer (Table 7):")
    for name, (m, post, synchronized) in ZERO_BUBBLE_2024_SYNCHRONIZED.items():
        got = next(
            float(r["predicted"])  # type: ignore[arg-type]
            for r in rows
            if r["model"] == name and r["microbatches"] == m and r["schedule"] == "zb-2p"
        )
        rows.append({"model": name, "microbatches": m, "schedule": "zb-2p-synchronized",
                     "priced_as": "zb-h2", "published": synchronized, "predicted": got,
                     "ratio": got / synchronized, "post_validation_published": post})  # fmt: skip
        print(f"{name:>6} {m:>4} synchronized {synchronized:>6.2f} (post-validation {post:.2f}) "
              f"predicted {got:.2f} ratio {got / synchronized:.3f}")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
