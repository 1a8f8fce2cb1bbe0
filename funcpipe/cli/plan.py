"""``funcpipe plan``: predict a layout's step on a GPU cluster, or search for the best."""

from __future__ import annotations

import argparse
import json
from typing import Any

from funcpipe.cli.args import Subparsers
from funcpipe.errors import InvalidArgument

__all__ = ["register"]

_LAYOUT_FLAGS = (
    "tensor",
    "pipeline",
    "data",
    "microbatch",
    "interleave",
    "recompute",
    "stage_layers",
    "sequence_parallel",
    "schedule",
    "zero",
)


def register(subparsers: Subparsers) -> None:
    """Add the ``plan`` subcommand to ``subparsers``."""
    from funcpipe.planner.cluster import GPUS
    from funcpipe.planner.layout import RECOMPUTE, SCHEDULES, ZERO

    parser = subparsers.add_parser(
        "plan",
        help="predict step time, MFU and memory per GPU of a transformer on a GPU cluster",
        description="Predict a transformer's training step (time, MFU, hardware TFLOP/s, memory "
        "per GPU) on N GPUs. With any layout option the layout is priced (options left out "
        "default to 1, none, off, 1f1b, zero 0 and data = gpus / (tensor x pipeline)); without "
        "them the best layouts that fit are searched. See docs/planner.md.",
    )
    need = parser.add_argument_group("model and cluster")
    for flag, what in (
        ("--layers", "transformer blocks"),
        ("--hidden", "hidden size"),
        ("--heads", "attention heads"),
        ("--vocab", "vocabulary size"),
        ("--seq", "sequence length"),
        ("--global-batch", "sequences per step"),
        ("--gpus", "GPU count"),
    ):
        need.add_argument(flag, type=int, required=True, help=what)
    need.add_argument("--gpu", choices=tuple(GPUS), required=True, help="GPU preset")
    lay = parser.add_argument_group("layout (leave all out to search)")
    for flag in ("--tensor", "--pipeline", "--data", "--microbatch", "--interleave"):
        lay.add_argument(flag, type=int, default=None)
    lay.add_argument("--recompute", choices=RECOMPUTE, default=None)
    lay.add_argument("--sequence-parallel", action="store_true", default=None)
    lay.add_argument(
        "--stage-layers",
        default=None,
        metavar="N,N,...",
        help="blocks per stage, pipeline x interleave of them (default: an even split), "
        "e.g. 2,3,3,3,3,3,3,2",
    )
    lay.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=None,
        metavar="NAME",
        help=f"one of {', '.join(SCHEDULES)}",
    )
    lay.add_argument(
        "--zero",
        type=int,
        choices=ZERO,
        default=None,
        help="sharding over data: 0 none, 1 ZeRO-1 (optimizer state and parameters), "
        "2 ZeRO-2 (gradients too, reduce-scattered every microbatch); searched when left out",
    )
    parser.add_argument(
        "--top", type=int, default=1, metavar="K", help="layouts to show when searching (default 1)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=_run)


def _layout(args: argparse.Namespace) -> Any:
    from funcpipe.planner.layout import ClusterLayout

    t = args.tensor or 1
    p = args.pipeline or 1
    v = args.interleave or 1
    schedule = args.schedule or ("interleaved" if v > 1 else "1f1b")
    if args.interleave is None and schedule in ("interleaved", "zbv"):
        v = 2
    if args.data is None:
        if args.gpus % (t * p):
            raise InvalidArgument(
                f"--gpus {args.gpus} is not a multiple of --tensor x --pipeline = {t * p}"
            )
        d = args.gpus // (t * p)
    else:
        d = args.data
    if args.zero and d == 1:
        raise InvalidArgument(
            f"--zero {args.zero}: ZeRO shards over the data-parallel copies, and this layout has "
            f"one (data = --gpus / (--tensor x --pipeline) = {args.gpus} / {t * p}, or --data 1); "
            "give more --gpus or a smaller --tensor x --pipeline, or --zero 0"
        )
    return ClusterLayout(
        tensor=t,
        pipeline=p,
        data=d,
        microbatch=args.microbatch or 1,
        interleave=v,
        recompute=args.recompute or "none",
        sequence_parallel=bool(args.sequence_parallel),
        schedule=schedule,
        stage_layers=_stage_layers(args.stage_layers),
        zero=args.zero or 0,
    )


def _stage_layers(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise InvalidArgument(
            f"--stage-layers {text!r}: write the blocks of each stage as integers separated by "
            "commas, e.g. 2,3,3,3,3,3,3,2"
        ) from None


def _run(args: argparse.Namespace) -> int:
    from funcpipe.planner import Transformer, plan

    model = Transformer(
        layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq=args.seq
    )
    fixed = any(getattr(args, k) is not None for k in _LAYOUT_FLAGS)
    if args.top < 1:
        raise InvalidArgument(f"--top {args.top}: show at least 1 layout")
    got = plan(
        model,
        gpus=args.gpus,
        global_batch=args.global_batch,
        gpu=args.gpu,
        layout=_layout(args) if fixed else None,
        top=args.top,
    )
    if args.json:
        best = got[0].as_dict()
        best["searched"] = not fixed
        best["gpu"] = args.gpu
        if len(got) > 1:
            best["next"] = [e.as_dict() for e in got[1:]]
        print(json.dumps(best))
        return 0
    print(
        f"{args.gpus} x {args.gpu}, {model.params() / 1e9:.1f}B parameters, "
        f"global batch {args.global_batch} x {args.seq} tokens" + ("" if fixed else " (searched)")
    )
    wide = max(44, *(len(e.layout.short()) for e in got))
    head = (
        f"{'#':>2}  {'layout':<{wide}} {'step s':>8} {'MFU':>6} {'HW TF/s':>8} {'GiB/GPU':>8}  fits"
    )
    print(head)
    for k, e in enumerate(got, 1):
        print(
            f"{k:>2}  {e.layout.short():<{wide}} {e.step_time_s:8.3f} {e.mfu:6.1%} "
            f"{e.hardware_tflops_per_gpu:8.1f} {e.memory_gib_per_gpu:8.1f}  "
            f"{'yes' if e.fits else 'NO'}"
        )
    _closed_form_note(got)
    return 0


def _closed_form_note(got: list[Any]) -> None:
    """Say which rows were priced with the closed form: their programs are too long to simulate."""
    from funcpipe.planner.pipeline import MAX_SIMULATED

    rows = [k for k, e in enumerate(got, 1) if e.layout.pipeline > 1 and not e.simulated]
    if rows:
        print(
            f"#{', #'.join(map(str, rows))}: priced with the closed form, not simulated: the "
            f"program (pipeline x microbatches x interleave) is longer than the "
            f"{MAX_SIMULATED:,} the simulator runs in seconds"
        )
