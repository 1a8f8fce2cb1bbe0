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
    "expert_parallel",
    "moe_tensor",
)

_MOE_FLAGS = ("top_k", "moe_ffn", "shared_experts", "dense_layers", "moe_tensor")
"""Options that describe a mixture of experts: each needs ``--experts``."""


def register(subparsers: Subparsers) -> None:
    """Add the ``plan`` subcommand to ``subparsers``."""
    from funcpipe.planner.cluster import GPUS

    parser = subparsers.add_parser(
        "plan",
        help="predict step time, MFU and memory per GPU of a transformer on a GPU cluster",
        description="Predict a transformer's training step (time, MFU, hardware TFLOP/s, "
        "tokens/s and model TFLOP/s per GPU, memory per GPU) on N GPUs, dense or a mixture of "
        "experts. With any layout option the layout is priced (options left out default to "
        "1, none, off, 1f1b, zero 0 and data = gpus / (tensor x pipeline)); without them the "
        "best layouts that fit are searched. See docs/planner.md.",
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
    _model_options(parser)
    _layout_options(parser)
    parser.add_argument(
        "--top", type=int, default=1, metavar="K", help="layouts to show when searching (default 1)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(handler=_run)


def _layout_options(parser: argparse.ArgumentParser) -> None:
    """The layout's options (any of them fixes the layout; none: it is searched)."""
    from funcpipe.planner.layout import RECOMPUTE, SCHEDULES, ZERO

    lay = parser.add_argument_group("layout (leave all out to search)")
    for flag in ("--tensor", "--pipeline", "--data", "--microbatch", "--interleave"):
        lay.add_argument(flag, type=int, default=None)
    lay.add_argument(
        "--expert-parallel",
        type=int,
        default=None,
        metavar="EP",
        help="experts split over EP of the data-parallel copies (EP divides data; default 1)",
    )
    lay.add_argument("--recompute", choices=RECOMPUTE, default=None)
    lay.add_argument("--sequence-parallel", action="store_true", default=None)
    lay.add_argument(
        "--moe-tensor",
        choices=("width", "tokens"),
        default=None,
        help="with --tensor > 1, how an MoE block uses it: each expert's width split over it "
        "(width, the default) or its tokens, the experts over expert x tensor ranks (tokens)",
    )
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
    lay.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlapped pairs: a forward beside another microbatch's backward, each hiding its "
        "expert all-to-all behind the other's compute (with --schedule dualpipev or zbv and "
        "--expert-parallel > 1); when searching, --overlap searches only such layouts and "
        "--no-overlap none (default: both where a layout may)",
    )


def _model_options(parser: argparse.ArgumentParser) -> None:
    """The model's optional shape (attention, MLP, precision) and its mixture of experts."""
    from funcpipe.planner.model import MLPS

    shape = parser.add_argument_group("model shape (optional)")
    for flag, what in (
        ("--ffn", "dense MLP width (default 4 x hidden)"),
        ("--kv-heads", "key/value heads, grouped-query attention (default: heads)"),
        ("--head-dim", "head dimension (default hidden / heads)"),
        ("--window", "sliding-window attention of this many tokens"),
        ("--full-every", "with --window: every N-th block keeps full attention (default none)"),
    ):
        shape.add_argument(flag, type=int, default=None, help=what)
    shape.add_argument("--mlp", choices=MLPS, default="gelu", help="MLP kind (default gelu)")
    shape.add_argument(
        "--untied", action="store_true", help="output layer not tied to the embedding"
    )
    shape.add_argument(
        "--precision",
        choices=("bf16", "fp8"),
        default="bf16",
        help="matrix products in bf16 or FP8 (attention, communication, the output layer stay "
        "bf16; default bf16)",
    )
    moe = parser.add_argument_group("mixture of experts (optional)")
    for flag, what in (
        ("--experts", "experts per MoE block"),
        ("--top-k", "experts each token goes through (default 1)"),
        ("--moe-ffn", "width of each expert (default --ffn)"),
        ("--shared-experts", "shared experts every token goes through (default 0)"),
        ("--dense-layers", "the first N blocks keep a dense MLP of width --ffn (default 0)"),
    ):
        moe.add_argument(flag, type=int, default=None, help=what)


def _data(args: argparse.Namespace) -> int:
    t, p = args.tensor or 1, args.pipeline or 1
    if args.data is not None:
        return int(args.data)
    if args.gpus % (t * p):
        raise InvalidArgument(
            f"--gpus {args.gpus} is not a multiple of --tensor x --pipeline = {t * p}"
        )
    return int(args.gpus // (t * p))


def _check_moe(args: argparse.Namespace) -> None:
    """Refuse a mixture-of-experts request that cannot be priced, naming the options, before
    any model or layout is built."""
    given = [f"--{k.replace('_', '-')}" for k in _MOE_FLAGS if getattr(args, k) is not None]
    ep = args.expert_parallel
    if args.experts is None:
        if given or (ep is not None and ep != 1):
            what = ", ".join(given + ([f"--expert-parallel {ep}"] if ep not in (None, 1) else []))
            raise InvalidArgument(
                f"{what}: these describe a mixture of experts; give --experts E too (or leave "
                "them out for a dense model)"
            )
        return
    e, k = args.experts, 1 if args.top_k is None else args.top_k
    if e < 1:
        raise InvalidArgument(f"--experts {e}: a positive integer (leave it out for a dense model)")
    if not 1 <= k <= e:
        raise InvalidArgument(
            f"--top-k {k}: each token goes through top-k of the --experts {e}, so give 1 to {e}"
        )
    if ep is None:
        return
    if ep < 1 or e % ep:
        raise InvalidArgument(
            f"--expert-parallel {ep}: --experts {e} must split evenly over it (each rank holds "
            f"experts / expert-parallel of them); pick a divisor of {e}"
        )
    d = _data(args)
    if d % ep:
        t, p = args.tensor or 1, args.pipeline or 1
        raise InvalidArgument(
            f"--expert-parallel {ep} does not divide the data-parallel copies: data = {d} (--gpus "
            f"{args.gpus} / (--tensor {t} x --pipeline {p}), or --data); the expert axis spans "
            "expert-parallel of the data copies (expert parallelism folded into data "
            f"parallelism, as Megatron-Core does), so pick a divisor of {d}"
        )


def _check_overlap(args: argparse.Namespace, fixed: bool) -> None:
    """``--overlap`` needs a mixture of experts, and in a given layout an expert axis and a
    schedule that pairs."""
    from funcpipe.planner.layout import PAIRING

    if not args.overlap:
        return
    if args.experts is None:
        raise InvalidArgument(
            "--overlap: overlapped pairs hide the expert all-to-all, and the model has no "
            "experts; give --experts E (a mixture of experts) or leave --overlap out"
        )
    if not fixed:
        return
    if args.schedule not in PAIRING:
        raise InvalidArgument(
            f"--overlap with --schedule {args.schedule or '1f1b'}: only "
            f"{' and '.join(PAIRING)} pair a forward with a backward; pass --schedule "
            "dualpipev (or zbv), or leave --overlap out"
        )
    if (args.expert_parallel or 1) == 1:
        raise InvalidArgument(
            "--overlap without --expert-parallel: the pairs hide the expert all-to-all, which "
            "needs an expert axis; pass --expert-parallel EP (EP > 1) or leave --overlap out"
        )


def _check_shape(args: argparse.Namespace) -> None:
    """The model options that need another one, and FP8 on a GPU that has none."""
    from funcpipe.planner.cluster import GPUS

    if args.full_every is not None and args.window is None:
        raise InvalidArgument(
            f"--full-every {args.full_every}: says which blocks skip the sliding window; give "
            "--window too"
        )
    if args.precision == "fp8" and "fp8" not in GPUS[args.gpu].gpu.flops:
        fp8 = ", ".join(name for name, c in GPUS.items() if "fp8" in c.gpu.flops)
        raise InvalidArgument(
            f"--precision fp8 on --gpu {args.gpu}: this GPU has no FP8 tensor cores; use one of "
            f"{fp8}, or --precision bf16"
        )


def _model(args: argparse.Namespace) -> Any:
    from funcpipe.planner import Transformer

    moe: dict[str, Any] = {}
    if args.experts is not None:
        moe = {"experts": args.experts, "top_k": args.top_k or 1, "moe_ffn": args.moe_ffn}
        moe["shared_experts"] = args.shared_experts or 0
        moe["dense_layers"] = args.dense_layers or 0
    return Transformer(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        vocab=args.vocab,
        seq=args.seq,
        ffn=args.ffn,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        mlp=args.mlp,
        tied=not args.untied,
        window=args.window,
        full_every=args.full_every,
        fp8=args.precision == "fp8",
        **moe,
    )


def _layout(args: argparse.Namespace) -> Any:
    from funcpipe.planner.layout import ClusterLayout

    t = args.tensor or 1
    p = args.pipeline or 1
    v = args.interleave or 1
    schedule = args.schedule or ("interleaved" if v > 1 else "1f1b")
    if args.interleave is None and schedule in ("interleaved", "zbv", "dualpipev"):
        v = 2
    d = _data(args)
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
        expert=args.expert_parallel or 1,
        overlap=bool(args.overlap),
        moe_tensor=args.moe_tensor or "width",
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
    from funcpipe.planner import plan

    if args.top < 1:
        raise InvalidArgument(f"--top {args.top}: show at least 1 layout")
    _check_moe(args)
    _check_shape(args)
    fixed = any(getattr(args, k) is not None for k in _LAYOUT_FLAGS)
    _check_overlap(args, fixed)
    model = _model(args)
    space: dict[str, Any] = {}
    if not fixed and args.overlap is not None:  # --overlap / --no-overlap narrow the search
        space["overlap"] = (args.overlap,)
    got = plan(
        model,
        gpus=args.gpus,
        global_batch=args.global_batch,
        gpu=args.gpu,
        layout=_layout(args) if fixed else None,
        top=args.top,
        **space,
    )
    if args.json:
        best = got[0].as_dict()
        best["searched"] = not fixed
        best["gpu"] = args.gpu
        if len(got) > 1:
            best["next"] = [e.as_dict() for e in got[1:]]
        print(json.dumps(best))
        return 0
    _table(args, model, got, fixed)
    return 0


def _table(args: argparse.Namespace, model: Any, got: list[Any], fixed: bool) -> None:
    """The layouts as a table, fastest first."""
    moe = f", {model.experts} experts (top {model.top_k})" if model.experts else ""
    print(
        f"{args.gpus} x {args.gpu}, {model.params() / 1e9:.1f}B parameters{moe}, "
        f"global batch {args.global_batch} x {args.seq} tokens" + ("" if fixed else " (searched)")
    )
    wide = max(44, *(len(e.layout.short()) for e in got))
    head = (
        f"{'#':>2}  {'layout':<{wide}} {'step s':>8} {'MFU':>6} {'HW TF/s':>8} {'TF/s':>7} "
        f"{'tok/s/GPU':>10} {'GiB/GPU':>8}  fits"
    )
    print(head)
    for k, e in enumerate(got, 1):
        print(
            f"{k:>2}  {e.layout.short():<{wide}} {e.step_time_s:8.3f} {e.mfu:6.1%} "
            f"{e.hardware_tflops_per_gpu:8.1f} {e.tflops_per_gpu:7.1f} "
            f"{e.tokens_per_s_per_gpu:10.0f} {e.memory_gib_per_gpu:8.1f}  "
            f"{'yes' if e.fits else 'NO'}"
        )
    _closed_form_note(got)


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
