"""What exporting a checkpoint to one safetensors file costs, and that it streams: a synthetic
model of ``--tensors`` float32 tensors of ``--mib`` MiB each, saved by
``checkpoint.save_model``, exported by ``checkpoint.export`` at several ``batch_bytes`` (how
much of it is read and written at a time) and, for comparison, read whole by
``checkpoint.consolidate`` (every tensor in memory at once, as torch's ``dcp_to_torch_save``
does). Each runs in a fresh process; reported: its wall time and its peak resident memory
above the same process's before the call (sampled every 2 ms from /proc/self/statm: Linux).

    python benchmarks/checkpoint_export.py [--tensors 16] [--mib 32] [--batch-mib 64 1024]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C

COLUMNS: list[C.Column] = [
    ("how", "how", ""),
    ("model_mib", "model MiB", ".0f"),
    ("batch_mib", "batch MiB", ""),
    ("seconds", "seconds", ".2f"),
    ("peak_mib", "peak RSS above start MiB", ".0f"),
]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--mib", type=float, default=32.0, help="MiB per tensor")
    ap.add_argument("--batch-mib", type=float, nargs="+", default=[64.0, 1024.0])
    ap.add_argument("--json", default=None)
    return ap


def _rss() -> int:
    """This process's resident bytes now (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(how: str, ck: str, out: str, batch: int) -> dict[str, Any]:
    """In a fresh process: export (or consolidate), sampling the resident memory every 2 ms."""
    import threading

    from funcpipe.train import checkpoint

    start, peak, done = _rss(), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    if how == "export":
        checkpoint.export(ck, out, batch_bytes=batch)
    else:
        whole = checkpoint.consolidate(ck)
        peak[0] = max(peak[0], _rss())
        del whole
    seconds = time.perf_counter() - t0
    done.set()
    watcher.join()
    return {"seconds": seconds, "peak_mib": (peak[0] - start) / 2**20}


def _measure(how: str, ck: str, out: str, batch: int) -> dict[str, Any]:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); "
        "from benchmarks.checkpoint_export import _child; "
        "print(json.dumps(_child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(C.ROOT), how, ck, out, str(batch)],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    import torch

    from funcpipe.train import checkpoint

    args = parser().parse_args(argv)
    n = int(args.mib * 2**20) // 4
    work = tempfile.mkdtemp(prefix="fp-export-")
    rows: list[dict[str, Any]] = []
    try:
        g = torch.Generator().manual_seed(0)
        params = ({f"layer{k}.weight": torch.randn(n, generator=g) for k in range(args.tensors)},)
        ck = checkpoint.save_model(os.path.join(work, "ck"), params, step=1)
        model_mib = args.tensors * n * 4 / 2**20
        del params
        print(C.table([], COLUMNS), flush=True)
        runs = [("export", int(b * 2**20), f"{b:g}") for b in args.batch_mib]
        runs.append(("consolidate", 0, "all"))
        for how, batch, label in runs:
            out = os.path.join(work, f"model-{label}.safetensors")
            got = _measure(how, ck, out, batch)
            rows.append({"how": how, "model_mib": model_mib, "batch_mib": label, **got})
            print(C.table(rows[-1:], COLUMNS).splitlines()[-1], flush=True)
            if os.path.exists(out):
                os.remove(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(C.table(rows, COLUMNS))
    command = ["benchmarks/checkpoint_export.py", *(argv if argv is not None else sys.argv[1:])]
    C.write_json(args.json, {"command": command, "machine": C.machine(), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
