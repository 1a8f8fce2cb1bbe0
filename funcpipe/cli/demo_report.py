"""The demo's report: progress lines while it trains, then the summary, its pictures and printout.

:func:`summary` gathers what the first rank knows after the run into the JSON-able dict
``summary.json`` holds and ``funcpipe.cli.demo.run`` returns; :func:`pictures` writes the step's
Chrome trace, the loss curve and the step's timeline; :func:`print_summary` prints the summary.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from typing import Any

from funcpipe.cli.demo_options import DemoOptions

__all__ = ["mean_last", "pictures", "print_summary", "progress", "summary"]

History = dict[str, list[list[float]]]  # "train" and "val": [step, loss] rows


def mean_last(rows: list[list[float]], k: int) -> float | None:
    """The mean loss of the last ``k`` rows (None when there are none)."""
    tail = [v for _, v in rows[-k:]]
    return sum(tail) / len(tail) if tail else None


def progress(
    step: int, total: int, loss: float, tps: float, tty: bool, val: list[list[float]]
) -> None:
    """One progress line: redrawn in place on a terminal, else about every tenth step."""
    width = 30
    done = int(width * step / total)
    bar = "=" * done + (">" if done < width else "") + " " * (width - done - 1)
    vtxt = f" | val {val[-1][1]:.3f}" if val else ""
    line = f"step {step:4d}/{total} [{bar}] loss {loss:.3f}{vtxt} | {tps / 1000:.1f}k tok/s"
    if tty:
        print("\r" + line, end="" if step < total else "\n", flush=True)
    elif step == 1 or step % max(1, total // 10) == 0 or step == total:
        print(line, flush=True)


def summary(
    o: DemoOptions,
    *,
    device: str,
    params: int,
    stages: list[str],
    speed: dict[str, Any],
    skipped: int,
    peak_memory: list[int] | None,
    start: int,
    history: History,
    final_val: float,
    wall_s: float,
    traced: Any,
    simulated: Any,
    files: dict[str, str],
    last: float,
    bytes_sent: int,
) -> dict[str, Any]:
    """The run's summary (``summary.json``): the options, the device, the throughput, the
    losses, and one step's executed timeline against the simulator's."""
    return {
        "options": asdict(o),
        "device": device,
        "precision": o.precision,
        "compile": o.compile,
        "size": o.size,
        "params": params,
        "stages": stages,  # shows the autocast / compile wrapping
        "warmup_steps_excluded": skipped,
        **speed,
        "peak_memory_bytes_per_rank": peak_memory,
        "steps": o.steps,
        "start_step": start,
        "final_train_loss": mean_last(history["train"], 10),
        "first_val_loss": history["val"][0][1] if history["val"] else None,
        "final_val_loss": final_val,
        "wall_s": wall_s,
        "bubble_measured": traced.bubble_fraction,
        "bubble_simulated": simulated.bubble_fraction,
        "makespan_measured_ms": traced.makespan * 1e3,
        "makespan_simulated_ms": simulated.makespan * 1e3,
        "files": files,
        "last_loss": last,
        "p2p_bytes_per_step_rank0": bytes_sent / max(1, o.steps - start + 1),
    }


def pictures(o: DemoOptions, history: History, traced: Any) -> dict[str, str]:
    """Write the traced step's Chrome trace and, with matplotlib, the loss curve and the step's
    timeline under ``--out``; returns what was written where."""
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


def print_summary(s: dict[str, Any]) -> None:
    """Print the summary :func:`summary` made: losses, device, throughput, memory, bubble."""
    o = s["options"]
    print()
    print(
        f"pipeline {o['pipeline']} x tensor {o['tensor']} x data {o['data']}"
        + (f" (expert {o['expert']})" if o.get("expert", 1) > 1 else "")
        + f", schedule {o['schedule']}, "
        f"{s['steps']} steps ({s['wall_s']:.0f} s)"
    )
    print(f"  train loss (last 10 steps)  {s['final_train_loss']:.3f}")
    print(
        f"  validation loss             {s['first_val_loss']:.3f} -> {s['final_val_loss']:.3f}"
        f"   (uniform over bytes: {math.log(256):.3f})"
    )
    mfu = f"MFU {100 * s['mfu']:.1f}%" if s["mfu"] is not None else "MFU n/a (no peak known)"
    print(
        f"  device                      {s['device']}, {s['precision']}"
        + (", compiled" if s["compile"] else "")
        + f", {_count(s['params'])} params ({s['size']})"
    )
    first, last = s["warmup_steps_excluded"] + 1, s["warmup_steps_excluded"] + s["timed_steps"]
    if s["tokens_per_s"] is None:
        print("  throughput                  n/a (no step ran in this run)")
    else:
        print(
            f"  throughput                  {s['tokens_per_s'] / 1000:.1f}k tokens/s, {mfu} "
            f"(steps {first}-{last} of this run)"
        )
    if s["peak_memory_bytes_per_rank"]:
        gib = ", ".join(f"{b / 2**30:.2f}" for b in s["peak_memory_bytes_per_rank"])
        print(f"  peak memory per rank        {gib} GiB (torch.cuda.max_memory_allocated)")
    print(
        f"  one step: makespan {s['makespan_measured_ms']:.1f} ms measured, "
        f"{s['makespan_simulated_ms']:.1f} ms simulated from its own F/B times"
    )
    print(
        f"  bubble                      {100 * s['bubble_measured']:.1f}% measured, "
        f"{100 * s['bubble_simulated']:.1f}% simulated"
    )
    if o["data"] > 1:
        level = s.get("zero")
        how = f"sharded over the data copies (ZeRO-{level})" if level else "a full copy each"
        note = f" ({s['zero_note']})" if s.get("zero_note") else ""
        print(f"  params and optimizer state  {how}{note}")
    for k, (block, load) in enumerate(s.get("expert_load", {}).items()):
        if k == 0:
            print("  expert load, validation batch 0  tokens per expert (max / mean; at init)")
        was = s["expert_load_init"][block]
        ratio = f"{max(load) * len(load) / sum(load):.2f}; {max(was) * len(was) / sum(was):.2f}"
        print(f"    block {block:<22}{' '.join(map(str, load))} ({ratio})")
    for name, path in s["files"].items():
        print(f"  {name:<28}{path}")


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"
