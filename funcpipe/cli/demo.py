"""``funcpipe demo``: train a GPT with pipeline x tensor x data parallelism on local processes.

The job: a byte-level GPT (:mod:`funcpipe.models.gpt`) on text that ships with Python
(:mod:`funcpipe.train.data`), split into pipeline stages that are each tensor-parallel (1D, with
vocabulary-parallel embedding and cross-entropy), trained with the pure AdamW of
:mod:`funcpipe.train.optim` and global-norm clipping across every rank. It evaluates on the validation
split, writes a loss curve, the executed timeline of one step (picture and Chrome trace) and a
checkpoint, and prints a summary with the measured against the simulated bubble.

It starts ``pipeline x tensor x data`` local processes with :func:`funcpipe.launch`: CPU ranks
over gloo, or with ``--device cuda`` one GPU per rank over NCCL (``auto``, the default, takes the
GPUs when there is one per rank); or, under ``torchrun``, runs as one rank of the job torchrun
describes (the same script). ``--size`` picks the model and batch, ``--precision bf16`` runs every
stage under bf16 autocast on float32 parameters (:func:`funcpipe.autocast_stage`), ``--compile``
compiles every stage (:func:`funcpipe.compile_stage`). The summary reports tokens/s over the
steps after the warm-up and, on GPUs of known peak (:data:`funcpipe.train.throughput.PEAK_FLOPS`), the model FLOPs
utilisation: ``tokens/s x`` :func:`funcpipe.models.gpt.flops_per_token` ``/ (peak x GPUs)``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import torch

from funcpipe.errors import InvalidArgument, RankFailed
from funcpipe.runtime.clock import timer
from funcpipe.train.throughput import peak_flops, throughput, warmup_steps

__all__ = [
    "SIZES",
    "DemoOptions",
    "Size",
    "main",
    "parse",
    "resolve_device",
    "run",
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
PRECISIONS = ("fp32", "bf16")
COMPILE_BACKEND = "inductor"  # torch.compile's default; tests pass --compile-backend aot_eager


@dataclass(frozen=True)
class DemoOptions:
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
    resume: bool = False
    stop_after: int = 0  # stop (with a checkpoint) after this many steps: 0 = run to --steps
    timeout: float | None = None  # the job's deadline, s (None: none)
    pg_timeout: float | None = None  # the process group's timeout, s (None: torch's default)
    corpus_bytes: int = 3_000_000
    device: str = "auto"  # "auto": CUDA when this host has a GPU per rank, else the CPU
    size: str = "small"  # the name of the size the model fields came from (a label)
    precision: str = "fp32"  # "bf16": float32 params, the stages under bf16 autocast
    compile: bool = False  # every stage through funcpipe.compile_stage
    compile_backend: str = COMPILE_BACKEND

    @property
    def world(self) -> int:
        return self.pipeline * self.tensor * self.data


def parse(argv: Sequence[str] | None = None) -> DemoOptions:
    """The options of ``argv``: ``--device auto`` resolved to ``cpu`` or ``cuda`` and the
    model's fields filled from ``--size`` (default: ``small`` on CPU, ``large`` on CUDA) where
    they are not given, each given one overriding the size's."""
    d = DemoOptions()
    ap = argparse.ArgumentParser(
        prog="funcpipe demo",
        description="Train a byte-level GPT with pipeline x tensor x data parallelism on local "
        "processes: CPU ranks over gloo, or one GPU per rank over NCCL (--device); or as one "
        "rank under torchrun.",
    )
    ap.add_argument(
        "--pipeline", type=int, default=d.pipeline, help=f"pipeline ranks (default {d.pipeline})"
    )
    ap.add_argument(
        "--tensor", type=int, default=d.tensor, help=f"tensor-parallel size (default {d.tensor})"
    )
    ap.add_argument(
        "--data", type=int, default=d.data, help=f"data-parallel copies (default {d.data})"
    )
    ap.add_argument("--schedule", default=d.schedule, help=f"schedule name (default {d.schedule})")
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
        help="fp32, or bf16: float32 params and optimizer, every stage under bf16 autocast "
        "(default: bf16 on CUDA, fp32 on CPU)",
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
    ap.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
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
    args = vars(ap.parse_args(argv))
    device = resolve_device(
        args["device"], args["pipeline"] * args["tensor"] * args["data"], announce=True
    )
    size = args["size"] or ("large" if device == "cuda" else "small")
    for name in Size._fields:
        if args[name] is None:
            args[name] = getattr(SIZES[size], name)
    args["size"] = size
    args["device"] = device
    args["precision"] = args["precision"] or ("bf16" if device == "cuda" else "fp32")
    opts = DemoOptions(**args)
    _validate(opts)
    return opts


def _gpus(world: int) -> tuple[int, int]:
    """(GPUs this host's ranks need, GPUs torch sees): under torchrun only this host's ranks."""
    need = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if _under_torchrun() else world
    return need, torch.cuda.device_count() if torch.cuda.is_available() else 0


def _under_torchrun() -> bool:
    from funcpipe.distributed.launcher import under_torchrun

    return under_torchrun()


def resolve_device(device: str, world: int, *, announce: bool = False) -> str:
    """``"cpu"`` or ``"cuda"`` for ``--device``; ``cuda`` needs one GPU per rank of this host
    (NCCL refuses two ranks of one group on one GPU); ``auto`` is ``cuda`` when that holds."""
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


def _validate(o: DemoOptions) -> None:
    from funcpipe.models.gpt import GPTConfig
    from funcpipe.parallel.mesh import ParallelConfig
    from funcpipe.schedule.generators import generate

    for name in (
        "pipeline",
        "tensor",
        "data",
        "microbatches",
        "steps",
        "batch",
        "context",
        "eval_batches",
    ):
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
    ParallelConfig.from_dict({"pipeline": o.pipeline, "tensor": o.tensor}, world_size=o.world)
    program = generate(o.schedule, ranks=o.pipeline, microbatches=o.microbatches)
    cfg = GPTConfig(vocab=256, context=o.context, d_model=o.d_model, heads=o.heads, layers=o.layers)
    cfg.check_tensor(o.tensor)
    if program.n_stages > o.layers + 1 and program.n_stages > 1:
        raise InvalidArgument(
            f"--schedule {o.schedule} places {program.n_stages} stages but the model has "
            f"--layers {o.layers}: use at least {program.n_stages - 1} layers"
        )
    if o.batch < o.microbatches:
        raise InvalidArgument(
            f"--batch {o.batch} < --microbatches {o.microbatches}: every microbatch needs a sequence"
        )


def _check_out(o: DemoOptions) -> None:
    """``--out`` can be written (found now, not at the final save after the whole run), and
    ``--resume`` has a checkpoint there to resume from (never a silent start from step 0)."""
    probe = os.path.join(o.out, f".funcpipe-write-test-{os.getpid()}")
    try:
        os.makedirs(o.out, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise InvalidArgument(
            f"--out {o.out!r} cannot be written ({type(e).__name__}: {e.strerror or e}): the "
            "run would train and then lose its checkpoint, history and pictures; choose a "
            "writable directory"
        ) from None
    from funcpipe.train import checkpoint

    if o.resume and checkpoint.latest(o.out) is None:
        raise InvalidArgument(
            f"--resume: there is no complete checkpoint in --out {o.out!r} to resume from; "
            "point --out at the run to continue, or drop --resume to start from step 0"
        )


# ------------------------------------------------------------------------------ one rank
def _shard(tree: Any, layouts: Any, place: Any, device: torch.device | None) -> Any:
    """This rank's shard of ``tree`` on ``device`` (``None``: a stage it does not run, meta)."""
    from funcpipe.parallel.layout import shard_tree
    from funcpipe.tree import tree_map

    sharded = shard_tree(tree, layouts, place)
    where = torch.device("meta") if device is None else device
    return tree_map(lambda t: t.to(where), sharded)


def _clip_weights(layouts: Any, n_stages: int, o: DemoOptions) -> Any:
    """Each leaf's share of the global norm: 1/tensor for leaves every tensor rank holds, 1/data
    for the data copies, 1/2 for the two tied copies of the embedding."""
    from funcpipe.parallel.layout import Layout
    from funcpipe.tree import tree_map

    def weight(lay: Layout) -> float:
        sharded = any(lay.dims)
        return (1.0 if sharded else 1.0 / o.tensor) / o.data

    out = []
    for lay in layouts:
        w = tree_map(weight, lay)
        if n_stages > 1 and "wte" in w:
            w = {**w, "wte": w["wte"] * 0.5}
        out.append(w)
    return tuple(out)


def _rank_device(o: DemoOptions) -> torch.device:
    """This rank's device: the CPU, or the GPU the launcher (or its torchrun path) made current
    before the process group started (:func:`funcpipe.distributed.launcher.rank_device`)."""
    if o.device != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.reset_peak_memory_stats(device)
    return device


def _transform(stages: list[Any], o: DemoOptions) -> list[Any]:
    """The stages under ``--precision`` and ``--compile``: autocast inside, compile outside (the
    compiled graph then holds the casts)."""
    from funcpipe.stages.compile import compile_stage
    from funcpipe.stages.precision import autocast_stage

    if o.precision == "bf16":
        stages = [autocast_stage(s, torch.bfloat16) for s in stages]
    if o.compile:
        backend = {} if o.compile_backend == COMPILE_BACKEND else {"backend": o.compile_backend}
        stages = [compile_stage(s, **backend) for s in stages]
    return stages


def _peak_memory(device: torch.device) -> list[int] | None:
    """Every rank's ``torch.cuda.max_memory_allocated`` (bytes) on rank 0; None on the CPU."""
    import torch.distributed as dist

    if device.type != "cuda":
        return None
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, int(torch.cuda.max_memory_allocated(device)))
    return [int(v) for v in out]


def train_rank(rank: int, o: DemoOptions) -> dict[str, Any] | None:
    """Everything one rank does; returns the summary on the first rank."""
    import torch.distributed as dist

    from funcpipe.models import gpt
    from funcpipe.parallel.mesh import build_mesh
    from funcpipe.pipeline.pipeline import Pipeline
    from funcpipe.schedule.generators import generate, to_eval
    from funcpipe.schedule.simulate import simulate
    from funcpipe.train import checkpoint, optim
    from funcpipe.train.data import load_corpus

    torch.manual_seed(o.seed)
    device = _rank_device(o)
    now = timer(device)
    mesh = build_mesh({"pipeline": o.pipeline, "tensor": o.tensor})
    place = mesh.place
    axis = mesh["tensor"]
    prank, drank = place.coords["pipe"], place.coords["data"]
    cfg = gpt.GPTConfig(
        vocab=256, context=o.context, d_model=o.d_model, heads=o.heads, layers=o.layers
    )
    program = generate(o.schedule, ranks=o.pipeline, microbatches=o.microbatches)
    n = program.n_stages
    # drawn on the CPU (the same values on every rank and device), each shard then moved
    full = gpt.split(gpt.init(cfg, seed=o.seed), cfg, n)
    layouts = gpt.layouts(cfg, n)
    mine = set(program.stages_on(prank))
    params = tuple(
        _shard(full[s], layouts[s], place, device if s in mine else None) for s in range(n)
    )
    del full
    stages = _transform(gpt.stages(cfg, n, axis=axis), o)
    loss = gpt.loss_fn(axis=axis)
    on_gpu = device if device.type == "cuda" else None  # CPU: where the params are
    pipe = Pipeline(
        stages,
        program,
        loss_fn=loss,
        ties=gpt.tie_spec(n),
        transport="dist",
        mesh=mesh,
        scatter_gather=o.tensor > 1,  # each tensor rank sends 1/t of every boundary tensor
        device=on_gpu,
    )
    evaluate = Pipeline(
        stages, to_eval(program), loss_fn=loss, transport="dist", mesh=mesh, device=on_gpu
    )
    schedule = optim.warmup_cosine(
        o.lr, warmup=max(1, o.steps // 10), total=o.steps, final=o.lr / 10
    )
    opt = optim.adamw(schedule, weight_decay=0.01)
    state = opt.init(params)
    weights = _clip_weights(layouts, n, o)
    corpus = load_corpus(max_bytes=o.corpus_bytes)
    ckpt_dir = os.path.join(o.out, "checkpoint")
    tag = f"tensor{axis.coord}of{o.tensor}"  # tensor shards get keys of their own
    start = 0
    history: dict[str, list[list[float]]] = {"train": [], "val": []}
    # the newest complete checkpoint: `checkpoint`, or the `checkpoint.old-*` a save killed
    # between its two renames left behind (never a half-written `.tmp-` one)
    found = checkpoint.latest(o.out) if o.resume else None
    if found is not None:
        like = {tag: {"params": params, "opt": state}, "step": 0}
        loaded = checkpoint.load(found, like)
        params, state, start = loaded[tag]["params"], loaded[tag]["opt"], int(loaded["step"])
        hist_file = os.path.join(o.out, "history.json")
        if os.path.exists(hist_file):
            with open(hist_file) as f:
                history = json.load(f)
            history = {k: [row for row in v if row[0] < start] for k, v in history.items()}
    first = dist.get_rank() == 0
    tty = first and sys.stdout.isatty()
    tokens_per_step = o.batch * o.data * o.context

    def val_loss() -> float:
        total = 0.0
        for k in range(o.eval_batches):
            x, y = corpus.get_batch(
                "val",
                k,
                batch=o.batch,
                context=o.context,
                seed=o.seed,
                data_rank=drank,
                data_size=o.data,
            )
            total += float(evaluate.step(params, x, y).loss)  # type: ignore[arg-type]
        return total / o.eval_batches

    if start == 0:
        history["val"].append([0, val_loss()])  # where it starts: about ln 256
    t_start = time.perf_counter()
    step_times: list[float] = []
    last = float("nan")
    end = o.stop_after or o.steps
    for step in range(start, end):
        x, y = corpus.get_batch(
            "train",
            step,
            batch=o.batch,
            context=o.context,
            seed=o.seed,
            data_rank=drank,
            data_size=o.data,
        )
        t0 = now()  # on a GPU after its queued work: the step's kernels are timed, not launches
        result = pipe.step(params, x, y)
        held = tuple(
            w if g is not None else None for w, g in zip(weights, result.grads, strict=True)
        )
        grads, _ = optim.clip_by_global_norm(
            result.grads, 1.0, group=dist.group.WORLD, weights=held
        )
        params, state = opt.update(grads, state, params)
        step_times.append(now() - t0)
        last = float(result.loss)  # type: ignore[arg-type]
        history["train"].append([step, last])
        if o.eval_every and (step + 1) % o.eval_every == 0 and step + 1 < o.steps:
            history["val"].append([step + 1, val_loss()])
        if first:
            recent = step_times[-10:]
            tps = tokens_per_step * len(recent) / sum(recent)
            _progress(step + 1, o.steps, last, tps, tty, history["val"])
    if end < o.steps:  # interrupted on purpose: keep what a resume needs, nothing else
        checkpoint.save(ckpt_dir, {tag: {"params": params, "opt": state}, "step": end})
        if first:
            os.makedirs(o.out, exist_ok=True)
            with open(os.path.join(o.out, "history.json"), "w") as f:
                json.dump(history, f)
        return None
    final_val = val_loss()
    history["val"].append([o.steps, final_val])

    # one traced step: the executed timeline, against the simulator fed its measured costs
    x, y = corpus.get_batch(
        "train",
        o.steps,
        batch=o.batch,
        context=o.context,
        seed=o.seed,
        data_rank=drank,
        data_size=o.data,
    )
    traced = pipe.step(params, x, y, trace=True).timeline
    costs = _measured_costs(traced)
    simulated = simulate(pipe.program, costs, p2p=pipe.p2p, layout=pipe.p2p_layout)
    checkpoint.save(ckpt_dir, {tag: {"params": params, "opt": state}, "step": o.steps})
    peak_memory = _peak_memory(device)  # every rank takes part (a gather)
    if not first:
        return None
    os.makedirs(o.out, exist_ok=True)
    with open(os.path.join(o.out, "history.json"), "w") as f:
        json.dump(history, f)
    files = _pictures(o, history, traced)
    skipped = warmup_steps(len(step_times), o.compile)
    speed = throughput(
        step_times[skipped:],
        tokens_per_step=tokens_per_step,
        flops_per_token=gpt.flops_per_token(cfg),
        peak=peak_flops(device, o.precision),
        devices=o.world,
    )
    summary = {
        "options": asdict(o),
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "precision": o.precision,
        "compile": o.compile,
        "size": o.size,
        "params": gpt.matmul_params(cfg) + cfg.context * cfg.d_model,
        "stages": [repr(st) for st in stages],  # shows the autocast / compile wrapping
        "warmup_steps_excluded": skipped,
        **speed,
        "peak_memory_bytes_per_rank": peak_memory,
        "steps": o.steps,
        "start_step": start,
        "final_train_loss": _mean_last(history["train"], 10),
        "first_val_loss": history["val"][0][1] if history["val"] else None,
        "final_val_loss": final_val,
        "wall_s": time.perf_counter() - t_start,
        "bubble_measured": traced.bubble_fraction,
        "bubble_simulated": simulated.bubble_fraction,
        "makespan_measured_ms": traced.makespan * 1e3,
        "makespan_simulated_ms": simulated.makespan * 1e3,
        "files": files,
        "last_loss": last,
        "p2p_bytes_per_step_rank0": pipe.bytes_sent / max(1, o.steps - start + 1),
    }
    with open(os.path.join(o.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _mean_last(rows: list[list[float]], k: int) -> float | None:
    tail = [v for _, v in rows[-k:]]
    return sum(tail) / len(tail) if tail else None


def _measured_costs(timeline: Any) -> Any:
    """Per-stage median F, B (split in I/W halves when only B ran), I and W times of a run."""
    from collections import defaultdict

    from funcpipe.schedule.ir import Op
    from funcpipe.schedule.simulate import Costs

    spans: dict[tuple[Op, int], list[float]] = defaultdict(list)
    for rank in timeline.events:
        for e in rank:
            spans[(e.instr.op, e.instr.stage)].append(e.end - e.start)

    def med(v: list[float]) -> float:
        v = sorted(v)
        return v[len(v) // 2] if v else 0.0

    n = timeline.program.n_stages
    f = [med(spans[(Op.F, s)]) for s in range(n)]
    b, w = [], []
    for s in range(n):
        if spans[(Op.I, s)]:
            b.append(med(spans[(Op.I, s)]))
            w.append(med(spans[(Op.W, s)]))
        else:
            full = med(spans[(Op.B, s)])
            b.append(full / 2)
            w.append(full / 2)
    return Costs(f=f, b=b, w=w)


def _progress(
    step: int, total: int, loss: float, tps: float, tty: bool, val: list[list[float]]
) -> None:
    width = 30
    done = int(width * step / total)
    bar = "=" * done + (">" if done < width else "") + " " * (width - done - 1)
    vtxt = f" | val {val[-1][1]:.3f}" if val else ""
    line = f"step {step:4d}/{total} [{bar}] loss {loss:.3f}{vtxt} | {tps / 1000:.1f}k tok/s"
    if tty:
        print("\r" + line, end="" if step < total else "\n", flush=True)
    elif step == 1 or step % max(1, total // 10) == 0 or step == total:
        print(line, flush=True)


def _pictures(o: DemoOptions, history: dict[str, list[list[float]]], traced: Any) -> dict[str, str]:
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


# ------------------------------------------------------------------------------ entry
def run(o: DemoOptions) -> dict[str, Any] | None:
    from dataclasses import replace

    from funcpipe.distributed.launcher import launch, under_torchrun

    _validate(o)
    _check_out(o)
    o = replace(o, device=resolve_device(o.device, o.world))
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != o.world:
            raise InvalidArgument(
                f"torchrun started {world} processes but pipeline x tensor x data = {o.world}; "
                f"pass --nproc-per-node {o.world} (or change the sizes)"
            )
    backend = "nccl" if o.device == "cuda" else "gloo"
    try:
        results = launch(
            train_rank, o.world, o, backend=backend, timeout=o.timeout, pg_timeout=o.pg_timeout
        )
    except RankFailed as e:
        if o.timeout is None or "job's deadline" not in str(e):
            raise
        raise RankFailed(
            f"{e}\n(funcpipe demo: that deadline is --timeout {o.timeout:g}; leave it out for "
            "none. The process group's timeout is --pg-timeout.)",
            rank=e.rank,
            cause=e.cause,
        ) from e
    summary = next((r for r in results if r is not None), None)
    if summary is not None:
        _print_summary(summary)
    return summary


def _print_summary(s: dict[str, Any]) -> None:
    o = s["options"]
    print()
    print(
        f"pipeline {o['pipeline']} x tensor {o['tensor']} x data {o['data']}, schedule {o['schedule']}, "
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
    for name, path in s["files"].items():
        print(f"  {name:<28}{path}")


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def main(argv: Sequence[str] | None = None) -> int:
    run(parse(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
