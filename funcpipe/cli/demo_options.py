"""The demo's options: ``funcpipe demo``'s command line, resolved and checked into :class:`DemoOptions`.

:func:`add_options` puts the options on a parser (the ``demo`` subcommand's, or the one
:func:`parse` builds); :func:`resolve` turns the parsed values into :class:`DemoOptions`
(``--device auto`` resolved, the model filled from ``--size``); :func:`validate` checks them and
returns the program the job runs, built once.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, NamedTuple

from funcpipe.errors import FuncpipeError, InvalidArgument

if TYPE_CHECKING:
    from funcpipe.models.gpt import GPTConfig
    from funcpipe.schedule.ir import Program

__all__ = [
    "COMPILE_BACKEND",
    "DESCRIPTION",
    "DEVICES",
    "PRECISIONS",
    "SIZES",
    "DemoOptions",
    "Size",
    "add_options",
    "gpt_config",
    "parse",
    "resolve",
    "resolve_device",
    "validate",
    "zero_level",
]


class Size(NamedTuple):
    """The model and workload of a ``--size``: the GPT's shape, the batch (sequences per data
    rank and step) in its microbatches, and the peak learning rate."""

    d_model: int
    layers: int
    heads: int
    context: int
    batch: int
    microbatches: int
    lr: float


# "small" is the CPU default (about a minute on two cores); "large" the CUDA default: 302M
# parameters, 1024 tokens of context, 32 x 1024 tokens a step (at pipeline 2 x tensor 2 about
# 1.2 GB of float32 params, grads and AdamW state per rank, activations in bf16 on top).
SIZES: dict[str, Size] = {
    "tiny": Size(16, 2, 2, 16, batch=4, microbatches=2, lr=3e-3),
    "small": Size(64, 4, 4, 64, batch=8, microbatches=4, lr=3e-3),
    "medium": Size(256, 8, 8, 256, batch=16, microbatches=8, lr=1e-3),
    "large": Size(1024, 24, 16, 1024, batch=32, microbatches=8, lr=3e-4),
}
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16", "bf16-autocast")
COMPILE_BACKEND = "inductor"  # torch.compile's default; tests pass --compile-backend aot_eager
DESCRIPTION = (
    "Train a byte-level GPT with pipeline x tensor x data parallelism on local processes: CPU "
    "ranks over gloo, or one GPU per rank over NCCL (--device); or as one rank under torchrun."
)


@dataclass(frozen=True)
class DemoOptions:
    """One demo job: its layout, schedule, model, training, output and device (the command
    line's options, one field each; :func:`parse` fills the model's fields from ``size``)."""

    pipeline: int = 2
    tensor: int = 2
    data: int = 1
    schedule: str = "1f1b"
    microbatches: int = 4
    steps: int = 150
    batch: int = 8  # sequences per data-parallel rank and step
    context: int = 64
    d_model: int = 64
    layers: int = 4
    heads: int = 4
    lr: float = 3e-3
    eval_every: int = 50
    eval_batches: int = 4
    seed: int = 0
    out: str = "runs/demo"
    # True: continue from the newest complete checkpoint in --out (an error if there is none);
    # "auto": from it if there is one, else start at step 0 (the default under torchrun)
    resume: bool | str = False
    stop_after: int = 0  # stop (with a checkpoint) after this many steps: 0 = run to --steps
    checkpoint_every: int = 0  # a checkpoint every N steps, written in the background (0: none)
    keep: int = 2  # the newest K complete checkpoints in --out are kept, older ones deleted
    timeout: float | None = None  # the job's deadline, s (None: none)
    pg_timeout: float | None = None  # the process group's timeout, s (None: torch's default)
    corpus_bytes: int = 3_000_000
    device: str = "auto"  # "auto": CUDA when this host has a GPU per rank, else the CPU
    size: str = "small"  # the name of the size the model fields came from (a label)
    # "bf16": bf16 params, float32 gradient sums and master weights; "bf16-autocast": float32
    # params, the stages under bf16 autocast
    precision: str = "fp32"
    compile: bool = False  # every stage through funcpipe.compile_stage
    compile_backend: str = COMPILE_BACKEND
    # 1: each data copy keeps its shard of the params and optimizer state (ZeRO-1); 2: and each
    # microbatch's gradient is reduce-scattered at once (ZeRO-2); None: 1 when --data > 1 and
    # the schedule allows it, else 0 (:func:`zero_level`)
    zero: int | None = None
    # a mixture of experts: the experts of each MoE block (0: dense MLPs), the experts per
    # token, every moe_every-th block an MoE one, shared experts, and the expert axis: the
    # experts split over that many of the data copies (GPTConfig, ParallelConfig(expert=))
    experts: int = 0
    top_k: int = 2
    moe_every: int = 1
    shared_experts: int = 0
    expert: int = 1
    # how an MoE block uses the tensor axis: each expert's width split over it, or its tokens
    # with the experts over the expert x tensor ranks (GPTConfig(moe_tensor=))
    moe_tensor: str = "width"

    @property
    def world(self) -> int:
        return self.pipeline * self.tensor * self.data


# ------------------------------------------------------------------------------ the command line
def add_options(ap: argparse.ArgumentParser) -> None:
    """Put the demo's options on ``ap`` (their help lists them in this order)."""
    _add_layout_options(ap)
    _add_expert_options(ap)
    _add_training_options(ap)


def _add_layout_options(ap: argparse.ArgumentParser) -> None:
    """Where the job runs and how: the layout, the schedule, the device, size and precision."""
    d = DemoOptions()
    ap.add_argument(
        "--pipeline", type=int, default=d.pipeline, help=f"pipeline ranks (default {d.pipeline})"
    )
    ap.add_argument(
        "--tensor",
        type=int,
        default=None,
        help=f"tensor-parallel size (default {d.tensor}; 1 with --experts, whose widths it "
        "also splits)",
    )
    ap.add_argument(
        "--data",
        type=int,
        default=None,
        help=f"data-parallel copies (default {d.data}; --expert with it)",
    )
    ap.add_argument("--schedule", default=d.schedule, help=f"schedule name (default {d.schedule})")
    ap.add_argument(
        "--zero",
        type=int,
        default=None,
        choices=(0, 1, 2),
        help="1: each data copy keeps only its shard of the params and AdamW state (ZeRO-1); 2: "
        "and reduce-scatters each microbatch's gradients into its shard at once (ZeRO-2); 0: "
        "full copies (default: 1 when --data > 1, else 0)",
    )
    ap.add_argument(
        "--device",
        default=d.device,
        choices=DEVICES,
        help="cpu: local processes over gloo; cuda: one GPU per rank over NCCL; auto (the "
        "default): cuda when torch sees at least pipeline x tensor x data GPUs, else cpu",
    )
    ap.add_argument(
        "--size",
        default=None,
        choices=list(SIZES),
        help="the model and batch: "
        + "; ".join(
            f"{k}: d_model {v.d_model}, {v.layers} layers, context {v.context}, batch {v.batch}"
            for k, v in SIZES.items()
        )
        + " (default: small on CPU, large on CUDA; --d-model, --layers, ... override it)",
    )
    ap.add_argument(
        "--precision",
        default=None,
        choices=PRECISIONS,
        help="fp32; bf16: bf16 params (no weight cast inside a microbatch), their gradients "
        "summed in float32, float32 master weights and optimizer state; or bf16-autocast: "
        "float32 params, every stage under bf16 autocast (default: bf16 on CUDA, fp32 on CPU)",
    )
    ap.add_argument(
        "--compile",
        action="store_true",
        help="compile every stage with torch.compile (funcpipe.compile_stage; the first steps "
        "compile, and are left out of the throughput)",
    )
    ap.add_argument(
        "--compile-backend",
        default=d.compile_backend,
        dest="compile_backend",
        help=argparse.SUPPRESS,  # tests: aot_eager compiles in a fraction of inductor's time
    )


def _add_expert_options(ap: argparse.ArgumentParser) -> None:
    """A mixture of experts: the MoE blocks and the expert axis."""
    d = DemoOptions()
    ap.add_argument(
        "--experts",
        type=int,
        default=d.experts,
        help="a mixture of experts: this many experts in each MoE block (default 0: dense)",
    )
    ap.add_argument("--top-k", type=int, default=d.top_k, dest="top_k", help="experts per token")
    ap.add_argument("--moe-every", type=int, default=d.moe_every, dest="moe_every",
                    help="every k-th block is an MoE block (default 1: all)")  # fmt: skip
    ap.add_argument("--shared-experts", type=int, default=d.shared_experts, dest="shared_experts")
    ap.add_argument(
        "--expert",
        type=int,
        default=d.expert,
        help="expert parallelism: the experts split over this many data copies (default 1)",
    )
    ap.add_argument(
        "--moe-tensor",
        choices=("width", "tokens"),
        default=d.moe_tensor,
        dest="moe_tensor",
        help="with --tensor > 1: split each expert's width over the tensor ranks (width, the "
        "default) or the MoE blocks' tokens, the experts over expert x tensor ranks (tokens)",
    )


def _add_training_options(ap: argparse.ArgumentParser) -> None:
    """The model (the size's unless given), the training, evaluation, output and timeouts."""
    d = DemoOptions()
    ap.add_argument("--microbatches", type=int, default=None, help="default: the size's")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument(
        "--batch", type=int, default=None, help="sequences per data rank per step (the size's)"
    )
    ap.add_argument("--context", type=int, default=None, help="tokens per sequence (the size's)")
    ap.add_argument("--d-model", type=int, default=None, dest="d_model", help="the size's")
    ap.add_argument("--layers", type=int, default=None, help="the size's")
    ap.add_argument("--heads", type=int, default=None, help="the size's")
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (the size's)")
    ap.add_argument("--eval-every", type=int, default=d.eval_every, dest="eval_every")
    ap.add_argument("--eval-batches", type=int, default=d.eval_batches, dest="eval_batches")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--out", default=d.out, help="where pictures, traces and checkpoints go")
    ap.add_argument(
        "--resume",
        nargs="?",
        const="yes",
        default=None,
        choices=("yes", "auto", "no"),
        help="continue from the newest complete checkpoint in --out; '--resume auto': from it "
        "if there is one, else start at step 0 (the default under torchrun, so one command "
        "starts a run and resumes it after a restart); '--resume no': start at step 0",
    )
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        dest="checkpoint_every",
        help="save a checkpoint every N steps, written in the background while training goes "
        "on (default 0: only at the end and at --stop-after)",
    )
    ap.add_argument(
        "--keep",
        type=int,
        default=d.keep,
        help=f"keep the newest K complete checkpoints in --out, delete older ones (default {d.keep})",
    )
    ap.add_argument(
        "--stop-after",
        type=int,
        default=d.stop_after,
        dest="stop_after",
        help="stop after this many steps, saving a checkpoint (as if interrupted; --resume goes on)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=d.timeout,
        help="the job's deadline in seconds: stopped, with an error, if still running then "
        "(default: none)",
    )
    ap.add_argument(
        "--pg-timeout",
        type=float,
        default=d.pg_timeout,
        dest="pg_timeout",
        help="the process group's timeout in seconds: how long one collective or message may "
        "wait before gloo raises or NCCL's watchdog aborts the rank (default: torch's, 600 for "
        "NCCL, 1800 for gloo)",
    )
    ap.add_argument("--corpus-bytes", type=int, default=d.corpus_bytes, dest="corpus_bytes")


def resolve(parsed: argparse.Namespace) -> DemoOptions:
    """The options of a parsed command line: ``--device auto`` resolved to ``cpu`` or ``cuda``
    and the model's fields filled from ``--size`` (default: ``small`` on CPU, ``large`` on CUDA)
    where they are not given, each given one overriding the size's. Not yet validated."""
    args = {f.name: getattr(parsed, f.name) for f in fields(DemoOptions)}
    if args["tensor"] is None:  # (with experts the processes go to the expert axis first)
        args["tensor"] = 1 if args["experts"] else DemoOptions.tensor
    if args["data"] is None:  # the expert axis spans data copies: as many as it needs
        args["data"] = max(DemoOptions.data, args["expert"])
    device = resolve_device(
        args["device"], args["pipeline"] * args["tensor"] * args["data"], announce=True
    )
    size = args["size"] or ("large" if device == "cuda" else "small")
    chosen = args["microbatches"] is None
    for name in Size._fields:
        if args[name] is None:
            args[name] = getattr(SIZES[size], name)
    args["size"] = size
    args["device"] = device
    args["resume"] = resume_default(args["resume"])
    args["precision"] = args["precision"] or ("bf16" if device == "cuda" else "fp32")
    opts = DemoOptions(**args)
    if chosen and device == "cuda":
        import torch

        try:
            name = torch.cuda.get_device_name()
        except (AssertionError, RuntimeError):  # no device to ask (a faked count, a broken driver)
            name = ""
        planned = planned_microbatches(opts, name)
        opts = opts if planned is None else replace(opts, microbatches=planned)
    return opts


def resume_default(given: str | None) -> bool | str:
    """``--resume``'s value as :class:`DemoOptions` holds it: ``"yes"`` True, ``"no"`` False,
    ``"auto"`` as it is; not given, ``"auto"`` under torchrun (whose restarts rerun the same
    command) and False otherwise."""
    if given is None:
        from funcpipe.distributed.launcher import under_torchrun

        return "auto" if under_torchrun() else False
    return {"yes": True, "no": False}.get(given, given)


# ------------------------------------------------------------------- microbatches on a GPU
def planner_gpu(name: str) -> str | None:
    """The planner's preset for a CUDA device name (``torch.cuda.get_device_name``), if any."""
    n = name.upper()
    if "H200" in n:
        return "h200"
    if "H100" in n:
        return "h100-pcie" if "PCIE" in n else "h100-sxm"
    if "A100" in n:
        return "a100-80gb" if "80GB" in n else "a100-40gb"
    return None


def planned_microbatches(o: DemoOptions, gpu_name: str) -> int | None:
    """On a GPU the planner knows: the microbatch count whose predicted step is fastest among
    those the planner says fit in half the GPU's memory (a margin for what its memory model
    leaves out): on one GPU few large microbatches, with pipeline ranks enough to fill the
    pipeline. None for another GPU or when nothing fits: the size's count stays. ``--microbatches``
    overrides it."""
    from funcpipe.planner import ClusterLayout, Transformer, cluster, estimate
    from funcpipe.planner.layout import SCHEDULES

    gpu = planner_gpu(gpu_name)
    if gpu is None:
        return None
    model = Transformer(layers=o.layers, hidden=o.d_model, heads=o.heads, vocab=256, seq=o.context)
    preset = cluster(gpu)
    limit = 0.5 * preset.gpu.memory  # a margin for what the planner's memory model leaves out
    schedule = o.schedule if o.schedule in SCHEDULES and o.pipeline > 1 else "1f1b"
    v = 2 if schedule in ("interleaved", "zbv") else 1
    best = None
    for size in (k for k in range(1, o.batch + 1) if o.batch % k == 0):
        m = o.batch // size
        if m < o.pipeline or (o.pipeline * v > o.layers) or o.layers % (o.pipeline * v):
            continue
        layout = ClusterLayout(
            tensor=o.tensor, pipeline=o.pipeline, data=o.data, microbatch=size,
            interleave=v, schedule=schedule,
        )  # fmt: skip
        try:
            e = estimate(model, preset, layout, global_batch=o.batch * o.data, memory_limit=limit)
        except FuncpipeError:
            continue
        if e.fits and (best is None or e.step_time_s < best[0]):
            best = (e.step_time_s, m)
    return None if best is None else best[1]


def parse(argv: Sequence[str] | None = None) -> DemoOptions:
    """The options of ``argv``, resolved (:func:`resolve`) and validated (:func:`validate`)."""
    ap = argparse.ArgumentParser(prog="funcpipe demo", description=DESCRIPTION)
    add_options(ap)
    opts = resolve(ap.parse_args(argv))
    validate(opts)
    return opts


# ------------------------------------------------------------------------------ the device
def _gpus(world: int) -> tuple[int, int]:
    """(GPUs this host's ranks need, GPUs torch sees): under torchrun only this host's ranks."""
    import torch

    need = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if _under_torchrun() else world
    return need, torch.cuda.device_count() if torch.cuda.is_available() else 0


def _under_torchrun() -> bool:
    from funcpipe.distributed.launcher import under_torchrun

    return under_torchrun()


def resolve_device(device: str, world: int, *, announce: bool = False) -> str:
    """``"cpu"`` or ``"cuda"`` for ``--device``; ``cuda`` needs one GPU per rank of this host
    (NCCL refuses two ranks of one group on one GPU); ``auto`` is ``cuda`` when that holds."""
    import torch

    if device not in DEVICES:
        raise InvalidArgument(f"--device {device!r}: use one of {', '.join(DEVICES)}")
    need, have = _gpus(world)
    if device == "cpu" or (device == "auto" and have == 0):
        return "cpu"
    if device == "auto" and have < need:
        if announce and int(os.environ.get("RANK", "0")) == 0:
            print(
                f"funcpipe demo: {need} ranks but {have} GPU{'s' if have != 1 else ''} here: "
                "running on the CPU (pass --device cuda with --pipeline x --tensor x --data "
                f"<= {have} to train on the GPUs)",
                file=sys.stderr,
            )
        return "cpu"
    if have == 0:
        raise InvalidArgument(
            f"--device cuda, but torch.cuda.is_available() is False here (torch "
            f"{torch.__version__}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): use --device cpu (or auto), or "
            "install a CUDA build of torch on a machine with a GPU"
        )
    if have < need:
        raise InvalidArgument(
            f"--device cuda: pipeline x tensor x data = {need} ranks on this host, one GPU "
            f"each, but torch sees {have} GPU{'s' if have != 1 else ''}: lower --pipeline, "
            f"--tensor or --data to a product <= {have}, or use --device cpu"
        )
    return "cuda"


# ------------------------------------------------------------------------------ validation
def validate(o: DemoOptions) -> Program:
    """Check ``o`` (an :class:`InvalidArgument` naming the option otherwise) and return the
    program its schedule generates: the one the ranks run."""
    _check_values(o)
    return _check_model(o)


def _check_values(o: DemoOptions) -> None:
    """Each option on its own: counts >= 1, names among the choices, lr and timeouts > 0."""
    for name in ("pipeline", "tensor", "data", "top_k", "moe_every", "expert", "microbatches",
                 "steps", "batch", "context", "eval_batches"):  # fmt: skip
        value = getattr(o, name)
        if not isinstance(value, int) or value < 1:
            raise InvalidArgument(f"--{name.replace('_', '-')}={value!r}: must be an int >= 1")
    for name, allowed in (("device", DEVICES), ("size", tuple(SIZES)), ("precision", PRECISIONS)):
        if getattr(o, name) not in allowed:
            raise InvalidArgument(f"--{name} {getattr(o, name)!r}: use one of {', '.join(allowed)}")
    if not isinstance(o.compile, bool):
        raise InvalidArgument(f"compile={o.compile!r}: True or False")
    if not (isinstance(o.lr, (int, float)) and o.lr > 0):
        raise InvalidArgument(f"--lr {o.lr!r}: a learning rate > 0")
    if o.stop_after < 0 or o.stop_after > o.steps:
        raise InvalidArgument(f"--stop-after={o.stop_after}: must be in 0..--steps ({o.steps})")
    if o.resume not in (True, False, "auto"):
        raise InvalidArgument(f"resume={o.resume!r}: True, False or 'auto'")
    if not isinstance(o.checkpoint_every, int) or o.checkpoint_every < 0:
        raise InvalidArgument(
            f"--checkpoint-every={o.checkpoint_every!r}: a step count >= 1 (0: no periodic saves)"
        )
    if not isinstance(o.keep, int) or o.keep < 1:
        raise InvalidArgument(f"--keep={o.keep!r}: how many checkpoints to keep, an int >= 1")
    if o.zero not in (None, 0, 1, 2):
        raise InvalidArgument(
            f"--zero {o.zero!r}: 0 (full copies), 1 (sharded params and optimizer state: "
            "ZeRO-1) or 2 (and gradients reduce-scattered per microbatch: ZeRO-2)"
        )
    if o.zero and o.data < 2:
        raise InvalidArgument(
            f"--zero {o.zero} shards over the data-parallel copies and --data is {o.data}: use "
            "--data >= 2, or --zero 0"
        )
    if not isinstance(o.experts, int) or o.experts < 0 or o.shared_experts < 0:
        raise InvalidArgument(
            f"--experts={o.experts!r} --shared-experts={o.shared_experts!r}: ints >= 0"
        )
    if o.expert > 1 and not o.experts:
        raise InvalidArgument(
            f"--expert {o.expert} splits the experts over {o.expert} data copies, but the model "
            "has none: add --experts E (a multiple of --expert), or drop --expert"
        )
    tokens = bool(o.experts) and o.moe_tensor == "tokens" and o.tensor > 1  # (ep x t ranks)
    spread = o.expert * (o.tensor if tokens else 1)
    if o.experts and o.experts % spread:
        over = f"--expert {o.expert}" + (f" x --tensor {o.tensor} (--moe-tensor tokens)" * tokens)
        raise InvalidArgument(
            f"--experts {o.experts} do not divide over {over}: each expert rank holds experts / "
            f"{spread} of them; use a multiple of {spread}"
        )
    if tokens and (o.batch // o.microbatches * o.context) % o.tensor:
        raise InvalidArgument(
            f"--moe-tensor tokens: a microbatch's {o.batch // o.microbatches} x {o.context} "
            f"tokens do not divide over --tensor {o.tensor}; pick a --context or --batch they do"
        )
    if o.eval_every < 0:
        raise InvalidArgument(f"--eval-every={o.eval_every}: must be >= 0 (0: only at the end)")
    for name in ("timeout", "pg_timeout"):
        value = getattr(o, name)
        if value is not None and not (
            isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
        ):
            raise InvalidArgument(
                f"--{name.replace('_', '-')}={value!r}: seconds > 0 (leave it out for the default)"
            )


def _check_model(o: DemoOptions) -> Program:
    """The options together: the layout, the schedule's program, the model against both."""
    from funcpipe.cli.schedule import MAX_PAIRS
    from funcpipe.parallel.mesh import ParallelConfig
    from funcpipe.schedule.generators import generate

    ParallelConfig.from_dict(
        {"pipeline": o.pipeline, "tensor": o.tensor, "expert": o.expert}, world_size=o.world
    )
    if o.batch < o.microbatches:  # (before the program is built: a huge one takes minutes)
        raise InvalidArgument(
            f"--batch {o.batch} < --microbatches {o.microbatches}: every microbatch needs a sequence"
        )
    if o.pipeline * o.microbatches > MAX_PAIRS:
        raise InvalidArgument(
            f"--pipeline {o.pipeline} x --microbatches {o.microbatches} = "
            f"{o.pipeline * o.microbatches:,} (stage, microbatch) pairs a step: more than the "
            f"{MAX_PAIRS:,} a program builds in seconds (funcpipe schedule refuses it too); use "
            f"fewer microbatches, e.g. --microbatches {max(1, MAX_PAIRS // o.pipeline)}"
        )
    program = generate(o.schedule, ranks=o.pipeline, microbatches=o.microbatches)
    gpt_config(o).check_tensor(o.tensor)
    if o.zero and (why := _unshardable(program)):
        raise InvalidArgument(f"--zero {o.zero}: {why}")
    n = len(set(program.replica_of or range(program.n_stages)))  # model stages (Chimera: fewer)
    if n > o.layers + 1 and n > 1:
        raise InvalidArgument(
            f"--schedule {o.schedule} places {n} model stages but the model has "
            f"--layers {o.layers}: use at least {n - 1} layers"
        )
    return program


def _unshardable(program: Program) -> str:
    """Why sharded data parallelism cannot run ``program`` ("" when it can)."""
    from funcpipe.schedule.zero import shard_data

    try:
        shard_data(program)
    except InvalidArgument as e:
        return str(e)
    return ""


def zero_level(o: DemoOptions, program: Program) -> tuple[int, str]:
    """``--zero`` as the ranks run it, and a note when the default had to give way: given, it
    stands (:func:`validate` checked it); by default 1 with ``--data`` > 1, unless the program
    cannot be sharded (Chimera with one microbatch: then 0, and the note says why)."""
    if o.zero is not None:
        return o.zero, ""
    if o.data < 2:
        return 0, ""
    if why := _unshardable(program):
        return 0, f"zero 0: {why}"
    return 1, ""


def gpt_config(o: DemoOptions) -> GPTConfig:
    """The demo's model: a byte-level GPT of ``o``'s shape, with ``o``'s experts."""
    from funcpipe.models.gpt import GPTConfig

    return GPTConfig(
        vocab=256, context=o.context, d_model=o.d_model, heads=o.heads, layers=o.layers,
        experts=o.experts, top_k=o.top_k, moe_every=o.moe_every,
        shared_experts=o.shared_experts, moe_tensor=o.moe_tensor,
    )  # fmt: skip
