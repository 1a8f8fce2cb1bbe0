"""The planner's model of the benchmark GPT on this CPU, beside its measured steps.

The measured steps are docs/benchmarks.md's (``benchmarks/results/vs_peer_gpt.json``: funcpipe,
the benchmark GPT, float32, 2 and 4 ranks on 2 cores). The planner needs a "GPU" for the CPU:
this script measures one (one thread: float32 matrix products at the GPT's own shapes, fitted
to ``time = flops / peak + overhead``; an add over 64 MiB for the memory bandwidth) and prices
the same steps with :func:`funcpipe.planner.estimate` and the simulator. 4 ranks share 2 cores,
which the planner is told by halving each rank's peak and bandwidth. Nothing here reads the
measured step times before predicting. ``python benchmarks/plan_demo.py [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from funcpipe.planner import GPU, Calibration, Cluster, ClusterLayout, Link, Transformer, estimate

ROOT = Path(__file__).resolve().parent
SCHEDULES = {"GPipe": ("gpipe", 1), "1F1B": ("1f1b", 1), "interleaved 1F1B": ("interleaved", 2),
             "ZB-V": ("zbv", 2)}  # fmt: skip


def _timed(fn, tries: int = 60) -> float:  # type: ignore[no-untyped-def]
    """The fastest of ``tries`` single calls: on a loaded machine the minimum is the call that
    ran without being preempted."""
    fn()
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_cpu() -> tuple[float, float, float]:
    """(peak FLOP/s, per-product overhead s, bandwidth bytes/s) of one thread, float32."""
    torch.set_num_threads(1)
    pts = []
    for m, n, k in ((256, 768, 256), (256, 256, 256), (256, 1024, 256), (256, 256, 1024),
                    (256, 256, 256 * 4), (128, 256, 256), (512, 1024, 256)):  # fmt: skip
        a, b = torch.randn(m, k), torch.randn(k, n)
        pts.append((2.0 * m * n * k, _timed(lambda a=a, b=b: a @ b)))
    # least squares of time = flops / peak + overhead
    n = len(pts)
    sx = sum(x for x, _ in pts)
    sy = sum(y for _, y in pts)
    sxx = sum(x * x for x, _ in pts)
    sxy = sum(x * y for x, y in pts)
    slope = (n * sxy - sx * sy) / (n * sxx - sx * sx)
    overhead = max((sy - slope * sx) / n, 0.0)
    x, y, z = torch.randn(2**24), torch.randn(2**24), torch.empty(2**24)
    bw = 3 * 4 * 2**24 / _timed(lambda: torch.add(x, y, out=z), tries=10)
    return 1.0 / slope, overhead, bw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    peak, overhead, bw = measure_cpu()
    model = Transformer(layers=8, hidden=256, heads=4, vocab=256, seq=128, tied=False,
                        dtype="fp32", flash=False)  # fmt: skip
    cal = Calibration(matmul=1.0, matmul_overhead=overhead, elementwise=1.0, norm=1.0,
                      softmax=1.0, workspace_bytes=0.0)  # fmt: skip
    measured = json.loads((ROOT / "results" / "vs_peer_gpt.json").read_text())["rows"]
    out = {"cpu_peak_flops": peak, "matmul_overhead_s": overhead, "bandwidth": bw, "rows": []}
    print(f"one thread: {peak / 1e9:.1f} GFLOP/s float32, {overhead * 1e6:.1f} us per product, "
          f"{bw / 1e9:.1f} GB/s")  # fmt: skip
    print(
        f"{'ranks':>5} {'schedule':<17} {'predicted ms':>12} {'measured ms':>11} {'pred/meas':>9}"
    )
    for row in measured:
        if row["schedule"] not in ("gpipe", "1f1b", "interleaved", "zbv"):
            continue
        ranks = row["ranks"]
        share = 2 / max(ranks, 2)  # 4 ranks on 2 cores: half a core each
        cpu = Cluster(GPU("cpu", {"fp32": peak * share}, 24e9, bw * share), gpus_per_node=ranks,
                      intra=Link(2e9, 50e-6))  # fmt: skip
        v = 2 if row["schedule"] in ("interleaved", "zbv") else 1
        lay = ClusterLayout(pipeline=ranks, microbatch=2, interleave=v, schedule=row["schedule"])
        if model.layers % (ranks * v):
            continue
        e = estimate(model, cpu, lay, global_batch=16, calibration=cal, simulate=True)
        pred = e.step_time_s * 1e3
        meas = row["funcpipe_ms"]
        out["rows"].append({"ranks": ranks, "schedule": row["schedule"], "predicted_ms": pred,
                            "measured_ms": meas})  # fmt: skip
        print(f"{ranks:>5} {row['schedule']:<17} {pred:12.1f} {meas:11.1f} {pred / meas:9.3f}")
        if ranks == 2 and row["schedule"] == "1f1b":
            print("     ", {k: round(x * 1e3, 2) for k, x in e.breakdown.items()})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
