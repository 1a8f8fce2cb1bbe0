"""Draw the step times of ``vs_peer.py --json FILE`` as grouped bars (needs matplotlib).

    python benchmarks/chart.py peer.json --out docs/img/vs_peer.png

One panel per (size, ranks); per schedule a funcpipe bar and a peer bar (median step time,
whiskers from the 25th to the 75th percentile of the step times), and above them the median of
the paired ratios funcpipe / peer.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 4:
        m = statistics.median(xs)
        return m, m, m
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def _describe(row: dict[str, Any]) -> str:
    """The model of a row in a few words."""
    layers, width, batch = row.get("layers", 8), row.get("width"), row.get("batch")
    if row.get("model") == "gpt":
        return f"GPT {layers} x d{width}, {batch} x {row.get('seq')} tokens"
    return f"Linear({width}) x {layers}, batch {batch}"


def draw(rows: list[dict[str, Any]], out: str, *, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("funcpipe_times"):
            panels.setdefault((r["size"], r["ranks"]), []).append(r)
    order = {"gpt": 0, "small": 1, "large": 2}
    keys = sorted(panels, key=lambda k: (order.get(k[0], 3), k[0], k[1]))
    cols = 2 if len(keys) > 1 else 1
    nrows = (len(keys) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6.4 * cols, 3.6 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        group = panels[key]
        names = [r["schedule"] for r in group]
        xs = range(len(group))
        tops = [0.0] * len(group)
        for offset, who, colour in ((-0.2, "funcpipe", "#1f77b4"), (0.2, "peer", "#ff7f0e")):
            lo, mid, hi = [], [], []
            for k, r in enumerate(group):
                times = [t * 1e3 for t in r.get(f"{who}_times") or []]
                q = _quartiles(times) if times else (0.0, 0.0, 0.0)
                lo.append(q[1] - q[0])
                mid.append(q[1])
                hi.append(q[2] - q[1])
                tops[k] = max(tops[k], q[2])
            label = "funcpipe" if who == "funcpipe" else "torch.distributed.pipelining"
            ax.bar(
                [x + offset for x in xs],
                mid,
                width=0.4,
                color=colour,
                label=label,
                yerr=[lo, hi],
                capsize=3,
            )
        ymax = max(tops, default=1.0) * 1.25
        for x, r, top in zip(xs, group, tops, strict=True):
            text = f"{r['ratio']:.2f}x" if r.get("ratio") else "peer failed"
            ax.text(x, top + 0.02 * ymax, text, ha="center", fontsize=8)
        size, ranks = key
        ax.set_title(f"{size} ({_describe(group[0])}), {ranks} ranks", fontsize=10)
        ax.set_xticks(list(xs), names, fontsize=9)
        ax.set_ylabel("step time, ms (median)")
        ax.set_ylim(0, ymax)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    # one legend for the figure, above the panels, so it never covers a bar's ratio
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=2, fontsize=9, bbox_to_anchor=(0.5, 0.955))
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="chart.py", description="Bar chart of vs_peer.py's JSON (funcpipe vs peer step time)."
    )
    ap.add_argument("json", help="the file written by vs_peer.py --json")
    ap.add_argument("--out", default="vs_peer.png", help="PNG (or SVG) to write")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    rows = json.loads(Path(args.json).read_text())["rows"]
    draw(rows, args.out, title=args.title)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
