"""Shared pieces of the benchmarks: the models, the schedules, timing, tables and JSON.

Two models, each a flat ``nn.Sequential`` that funcpipe (``funcpipe.stages.partition``) and
torch.distributed.pipelining (a ``PipelineStage`` of each slice) cut at the same places:

- ``gpt`` (the headline): :mod:`benchmarks.gpt`, a GPT of ``layers`` pre-LayerNorm blocks
  (d_model ``width``, ``heads`` heads, ``seq`` tokens, a byte vocabulary), cross-entropy on
  next-token targets; ``batch`` sequences of int64 token ids. Size ``gpt``: d_model 256,
  8 blocks, 4 heads, 128 tokens, 16 sequences in 8 microbatches of 2; ``gpt-tiny`` for tests.
- ``mlp``: ``layers`` x (Linear(width, width) + GELU) trained with a mean-squared error against
  a random target. ``small`` is the toy model of earlier rounds (width 512, batch 64),
  ``large`` a compute-heavier one (width 1024, batch 256); ``tiny`` for tests.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/x.py` puts benchmarks/ first, not the root
    sys.path.insert(0, str(ROOT))

import funcpipe as fp  # noqa: E402
from benchmarks import gpt  # noqa: E402
from funcpipe.runtime.saved import SavedBytes  # noqa: E402, F401  (the benchmarks' C.SavedBytes)
from funcpipe.schedule import Program, generate  # noqa: E402

Tensor = torch.Tensor

# ------------------------------------------------------------------------------ sizes and schedules


@dataclass(frozen=True)
class Size:
    """A model and its size. ``model="mlp"``: ``layers`` x (Linear(width) + GELU), ``batch``
    rows. ``model="gpt"``: ``layers`` blocks of d_model ``width`` with ``heads`` heads,
    ``batch`` sequences of ``seq`` tokens over ``vocab`` ids. Both: ``microbatches``."""

    name: str
    width: int
    batch: int
    layers: int = 8
    microbatches: int = 8
    model: str = "mlp"
    heads: int = 0
    seq: int = 0
    vocab: int = 0


SIZES: dict[str, Size] = {
    "gpt": Size("gpt", width=256, batch=16, model="gpt", heads=4, seq=128, vocab=256),
    "gpt-tiny": Size(
        "gpt-tiny", width=16, batch=8, layers=4, model="gpt", heads=2, seq=8, vocab=256
    ),
    "small": Size("small", width=512, batch=64),
    "large": Size("large", width=1024, batch=256),
    "tiny": Size("tiny", width=16, batch=16),  # for the test suite: shapes only matter
}
MODELS: dict[str, list[str]] = {"gpt": ["gpt"], "mlp": ["small", "large"]}  # default sizes


def resize(size: Size, **override: int | None) -> Size:
    """``size`` with the given fields replaced (``None`` keeps the field)."""
    fields = {k: v for k, v in override.items() if v is not None}
    return dataclasses.replace(size, **fields)


def sizes_for(model: str | None, names: Sequence[str] | None) -> list[str]:
    """The sizes a ``--model`` / ``--sizes`` pair asks for (``--sizes`` wins; the gpt by
    default); exits with a message where a named size belongs to another model."""
    if not names:
        return MODELS[model or "gpt"]
    if model is not None:
        wrong = [n for n in names if SIZES[n].model != model]
        if wrong:
            raise SystemExit(
                f"--sizes {' '.join(wrong)}: not sizes of --model {model} (its sizes: "
                f"{', '.join(n for n, z in SIZES.items() if z.model == model)})"
            )
    return list(names)


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule, as funcpipe generates it and as torch.distributed.pipelining names it."""

    name: str  # funcpipe's registry name (funcpipe.schedule.generate)
    chunks: int  # stages per rank
    peer: str | None  # class in torch.distributed.pipelining (None: the peer has none)


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec("gpipe", 1, "ScheduleGPipe"),
    "1f1b": ScheduleSpec("1f1b", 1, "Schedule1F1B"),
    "interleaved": ScheduleSpec("interleaved", 2, "ScheduleInterleaved1F1B"),
    "zbv": ScheduleSpec("zbv", 2, "ScheduleZBVZeroBubble"),
    "dualpipev": ScheduleSpec("dualpipev", 2, "ScheduleDualPipeV"),
    "zb-h1": ScheduleSpec("zb-h1", 1, None),
    "zb-h2": ScheduleSpec("zb-h2", 1, None),
}
PEER_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zbv", "dualpipev")


@dataclass(frozen=True)
class Variant:
    """How the timed steps compute: ``precision`` ``"fp32"``, or ``"bf16"`` (float32 weights,
    every stage under bf16 autocast: :func:`funcpipe.autocast_stage` for funcpipe, the same
    ``torch.autocast`` around each peer stage module's forward), and ``compile`` (a
    ``torch.compile`` backend, or None: :func:`funcpipe.compile_stage` for funcpipe,
    ``torch.compile(module)`` for each peer stage module). Autocast is inside, compile outside."""

    precision: str = "fp32"
    compile: str | None = None

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: one of {', '.join(PRECISIONS)}")

    @property
    def label(self) -> str:
        return self.precision + (f" + compile ({self.compile})" if self.compile else "")

    @property
    def plain(self) -> bool:
        return self.precision == "fp32" and self.compile is None

    def stages(self, stages: Sequence[fp.Stage]) -> list[fp.Stage]:
        out = list(stages)
        if self.precision == "bf16":
            out = [fp.autocast_stage(s, torch.bfloat16) for s in out]
        if self.compile:
            out = [fp.compile_stage(s, backend=self.compile) for s in out]
        return out

    def module(self, m: nn.Module) -> nn.Module:
        if self.precision == "bf16":
            m = _Autocast(m, torch.bfloat16)
        if self.compile:
            m = torch.compile(m, backend=self.compile)  # type: ignore[assignment]
        return m


PRECISIONS = ("fp32", "bf16")


class _Autocast(nn.Module):
    """``inner`` with its forward under ``torch.autocast`` for its input's device type."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner, self.dtype = inner, dtype

    def forward(self, *args: Tensor) -> Tensor:
        with torch.autocast(args[0].device.type, dtype=self.dtype):
            out: Tensor = self.inner(*args)
            return out


def variant_options(ap: Any) -> None:
    """``--precision`` and ``--compile [BACKEND]``: :class:`Variant`'s options."""
    ap.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="timed steps in fp32, or bf16: float32 weights, every stage under bf16 autocast "
        "(both libraries)",
    )
    ap.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="compile every stage for the timed steps (funcpipe.compile_stage; torch.compile "
        "of each peer stage module); BACKEND: torch.compile's, default inductor",
    )


def program_for(schedule: str, *, ranks: int, microbatches: int) -> Program:
    spec = SCHEDULES[schedule]
    chunks = spec.chunks if spec.name in ("interleaved",) else None
    return generate(spec.name, ranks=ranks, microbatches=microbatches, chunks=chunks)


# ------------------------------------------------------------------------------ the models


def mlp(
    width: int, *, layers: int = 8, dtype: torch.dtype = torch.float32, seed: int = 0
) -> nn.Sequential:
    """``layers`` x (Linear(width, width), GELU) as one flat nn.Sequential (2 * layers modules)."""
    g = torch.Generator().manual_seed(seed)
    mods: list[nn.Module] = []
    for _ in range(layers):
        lin = nn.Linear(width, width, dtype=dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(width, width, generator=g, dtype=dtype) / width**0.5)
            lin.bias.copy_(torch.randn(width, generator=g, dtype=dtype) * 0.1)
        mods += [lin, nn.GELU()]
    return nn.Sequential(*mods)


def build(size: Size, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Sequential:
    """The model of ``size`` with weights drawn from ``seed``."""
    if size.model == "gpt":
        return gpt.gpt(
            d_model=size.width,
            layers=size.layers,
            heads=size.heads,
            seq=size.seq,
            vocab=size.vocab,
            dtype=dtype,
            seed=seed,
        )
    return mlp(size.width, layers=size.layers, dtype=dtype, seed=seed)


def data(size: Size, *, dtype: torch.dtype = torch.float32, seed: int = 1) -> tuple[Tensor, Tensor]:
    """The batch and its targets: int64 token ids and next tokens (gpt; ``dtype`` unused), or
    random rows and a random target (mlp)."""
    if size.model == "gpt":
        return gpt.tokens(size.batch, size.seq, size.vocab, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size.batch, size.width, generator=g, dtype=dtype)
    y = torch.randn(size.batch, size.width, generator=g, dtype=dtype)
    return x, y


def mse(out: Tensor, y: Tensor) -> Tensor:
    return torch.nn.functional.mse_loss(out, y)


def loss_fn(size: Size) -> Callable[[Tensor, Tensor], Tensor]:
    """The model's loss ``(outputs, targets) -> scalar``: cross-entropy or mean-squared error."""
    return gpt.lm_loss if size.model == "gpt" else mse


def activation_shape(size: Size) -> tuple[int, ...]:
    """The shape of one microbatch's activation between two stages."""
    mb = size.batch // size.microbatches
    return (mb, size.seq, size.width) if size.model == "gpt" else (mb, size.width)


def bounds(size: Size, n_stages: int) -> list[tuple[int, int]]:
    """Contiguous module ranges of the model's nn.Sequential, one per stage, each with
    ``layers / n_stages`` layers (a gpt's embedding goes with stage 0, its head with the last)."""
    if size.layers % n_stages:
        raise ValueError(
            f"{size.layers} layers cannot be cut into {n_stages} equal stages; pick --layers "
            f"as a multiple of ranks x chunks ({n_stages})"
        )
    k = size.layers // n_stages
    if size.model == "gpt":  # modules: embed, blocks 1..layers, head
        cuts = [0] + [1 + s * k for s in range(1, n_stages)] + [size.layers + 2]
    else:  # modules: (Linear, GELU) x layers
        cuts = [2 * s * k for s in range(n_stages + 1)]
    return list(itertools.pairwise(cuts))


def stage_modules(model: nn.Sequential, size: Size, n_stages: int) -> list[nn.Sequential]:
    """The model cut into ``n_stages`` nn.Sequential slices (sharing the model's parameters)."""
    return [model[a:b] for a, b in bounds(size, n_stages)]  # type: ignore[misc]


def funcpipe_stages(
    model: nn.Sequential, size: Size, n_stages: int
) -> tuple[list[fp.Stage], list[Any]]:
    """funcpipe stages and params for the model cut into ``n_stages``, as a user of
    nn.Modules writes it: :func:`funcpipe.stages.partition` at :func:`bounds`' cuts."""
    cuts = [a for a, _ in bounds(size, n_stages)][1:]
    part = fp.partition(model, stages=n_stages, by=cuts)
    return list(part.stages), list(part.params)


def stage_names(
    model: nn.Sequential, size: Size, n_stages: int, stages: Iterable[int]
) -> list[str]:
    """Parameter names of the given stages, in parameter order (``"3.qkv.weight"``)."""
    ranges = bounds(size, n_stages)
    names = []
    for s in stages:
        a, b = ranges[s]
        names += [k for k, _ in model.named_parameters() if a <= int(k.split(".")[0]) < b]
    return names


def flat_grads(tree: Any) -> list[Tensor]:
    """The leaves of a funcpipe grads pytree in parameter order (dicts keep insertion order)."""
    if isinstance(tree, Mapping):
        return [t for v in tree.values() for t in flat_grads(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in flat_grads(v)]
    return [tree]


def reference_grads(model: nn.Sequential, size: Size, x: Tensor, y: Tensor) -> list[Tensor]:
    """Plain autograd in one process: gradients of the mean over microbatches of the loss (both
    pipelines define the step's loss so; with equal microbatches it is the full-batch loss)."""
    ref = copy.deepcopy(model)
    loss = loss_fn(size)
    m = size.microbatches
    xs, ys = fp.split(x, m), fp.split(y, m)
    total = sum(loss(ref(a), b) for a, b in zip(xs, ys, strict=True)) / m
    total.backward()  # type: ignore[union-attr]
    return [p.grad.detach().clone() for p in ref.parameters()]  # type: ignore[union-attr]


def max_rel_diff(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    """``max |a - b| / max |b|`` over all tensors (0 when both are zero)."""
    if len(a) != len(b):
        return float("inf")
    num = max((float((x - z).abs().max()) for x, z in zip(a, b, strict=True)), default=0.0)
    den = max((float(z.abs().max()) for z in b), default=0.0)
    return num / den if den > 0 else num


# ------------------------------------------------------------------------------ timing


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True) if y > 0]


def median_ci(
    xs: Sequence[float], *, level: float = 0.95, resamples: int = 2000
) -> tuple[float, float]:
    """Bootstrap confidence interval of the median of ``xs`` (percentile method, fixed seed):
    where the median of another run of as many rounds would fall."""
    import random

    if len(xs) < 4:
        return float("nan"), float("nan")
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(resamples))
    lo = meds[int((1 - level) / 2 * resamples)]
    hi = meds[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return lo, hi


def spread(xs: Sequence[float]) -> float:
    """Interquartile range over the median: how noisy a cell is."""
    if len(xs) < 4:
        return float("nan")
    q = statistics.quantiles(xs, n=4)
    return (q[2] - q[0]) / statistics.median(xs)


def time_calls(fn: Callable[[], Any], *, reps: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def step_times(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """The pipeline's time of each step: the slowest rank (all ranks start after a barrier)."""
    return [max(ts) for ts in zip(*per_rank, strict=True)]


# ------------------------------------------------------------------------------ tables and JSON


Column = tuple[str, str, str]  # (key, header, format spec; "" for str())


def fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value != value:  # NaN
        return "-"
    if spec and isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return str(value)


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> str:
    """A GitHub-markdown table (also readable on a terminal)."""
    head = [h for _, h, _ in columns]
    body = [[fmt(r.get(k), f) for k, _, f in columns] for r in rows]
    widths = [
        max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)
    ]
    numeric = [bool(f) for _, _, f in columns]

    def line(cells: Sequence[str]) -> str:
        return (
            "| "
            + " | ".join(
                c.rjust(w) if n else c.ljust(w)
                for c, w, n in zip(cells, widths, numeric, strict=True)
            )
            + " |"
        )

    sep = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if n else (":" + "-" * (w + 1))
            for w, n in zip(widths, numeric, strict=True)
        )
        + "|"
    )
    return "\n".join([line(head), sep, *(line(b) for b in body)])


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    cpu = ln.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def load() -> float | None:
    """The 1-minute load average (other processes competing for the two cores)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def write_json(path: str | None, payload: Mapping[str, Any]) -> None:
    if not path:
        return
    with open(path, "w") as f:
        json.dump({"machine": machine(), **payload}, f, indent=2, default=str)
        f.write("\n")


def int_at_least(least: int, why: str = "") -> Callable[[str], int]:
    """An argparse ``type``: a whole number >= ``least``; ``why`` is added to the refusal."""

    def parse(text: str) -> int:
        n = int(text)
        if n < least:
            raise argparse.ArgumentTypeError(
                f"{n}: must be >= {least}" + (f" ({why})" if why else "")
            )
        return n

    parse.__name__ = "int"  # argparse names the type in its refusal of "x": invalid int value
    return parse


def pool_options(
    ap: Any, *, job_timeout: float = 900.0, seed: bool = True, contention: bool = True
) -> None:
    """The options every pool benchmark takes: ``--seed``, ``--timeout`` (process group),
    ``--job-timeout`` (per cell), ``--quiet`` / ``--retries`` (``contention``) and ``--json``."""
    if seed:
        ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=60.0, help="process-group timeout, s")
    ap.add_argument("--job-timeout", type=float, default=job_timeout, help="per-cell timeout, s")
    if contention:
        ap.add_argument(
            "--quiet",
            action="store_true",
            help="before each cell, wait (up to 5 min) for other processes to leave the cores",
        )
        ap.add_argument(
            "--retries",
            type=int,
            default=0,
            help="rerun a cell up to this many times while other processes competed "
            "(keep the least contended)",
        )
    ap.add_argument("--json", default=None, help="write the rows (with every time) here")


def run_main(
    name: str,
    argv: list[str] | None,
    pool: PoolFactory | None,
    parser: Any,
    columns: Sequence[Column],
    run: Callable[[Any, Pools], Any],
) -> Any:
    """What every pool benchmark's ``main`` does: parse, one thread, print the table as rows
    come and again at the end, write the JSON (command, machine, rows and any extras ``run``
    returns as ``(rows, extras)``); returns ``run``'s result."""
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    print(table([], columns), flush=True)
    with Pools(pool, timeout=args.timeout) as pools:
        result = run(args, pools)
    rows, extras = result if isinstance(result, tuple) else (result, {})
    print()
    print(table(rows, columns))
    for key, value in extras.items():
        print(f"{key}: {value}")
    command = [name, *(argv if argv is not None else sys.argv[1:])]
    write_json(args.json, {"command": command, "machine": machine(), **extras, "rows": rows})
    return result


def pool(size: int, *, timeout: float = 120.0) -> fp.Pool:
    """``size`` gloo processes, one thread each, able to import ``benchmarks``."""
    return fp.Pool(size, timeout=timeout, pg_timeout=timeout, paths=[str(ROOT)])


PoolFactory = Callable[[int], fp.Pool]


class Pools:
    """Pools of gloo processes by size: from ``factory`` (e.g. the test suite's shared pools,
    never closed here) or started on demand and closed on exit. A pool found closed (a job
    failed) is replaced by a fresh one on the next :meth:`get`."""

    def __init__(self, factory: PoolFactory | None = None, *, timeout: float = 60.0) -> None:
        self.factory, self.timeout = factory, timeout
        self.own: dict[int, fp.Pool] = {}

    def get(self, size: int) -> fp.Pool:
        if self.factory is not None:
            return self.factory(size)
        p = self.own.get(size)
        if p is None or p.closed:
            p = self.own[size] = pool(size, timeout=self.timeout)
        return p

    def close(self) -> None:
        for p in self.own.values():
            p.close()
        self.own.clear()

    def __enter__(self) -> Pools:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------ stage costs


@dataclass
class StageCosts:
    """Seconds per microbatch for each stage: forward, full backward, its I/W split."""

    f: list[float]
    b: list[float]
    i: list[float]
    w: list[float]

    def as_dict(self) -> dict[str, list[float]]:
        return {"f": self.f, "b": self.b, "i": self.i, "w": self.w}

    def costs(self, comm: float = 0.0) -> fp.schedule.Costs:
        """The simulator's costs: F, I (``b``), W and the whole B (``full``), so one set serves
        programs with whole backwards, split ones and those that mix both."""
        from funcpipe.schedule import Costs

        return Costs(f=self.f, b=self.i, w=self.w, full=self.b, comm=comm)


class StageTimer:
    """Times F, B, I and W of every stage of ``size``'s model cut into ``n_stages``, on one
    microbatch, one repetition per :meth:`once`, in this process and thread, with funcpipe's
    autodiff as the interpreter calls it (parameter gradients summed in place into the leaves'
    ``.grad``; stage 0's input needs no gradient; the last stage includes the loss, seeded with
    1 / microbatches). Each stage gets the previous stage's output on that microbatch.
    Repetitions can be spread over a run (between timed steps) so that the costs see the same
    machine as the steps: a shared VM's speed drifts within minutes."""

    def __init__(
        self,
        size: Size,
        n_stages: int,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        variant: Variant | None = None,
    ) -> None:
        from funcpipe.runtime import autodiff
        from funcpipe.tree import tree_flatten

        model = build(size, seed=seed, dtype=dtype)
        stages, params = funcpipe_stages(model, size, n_stages)
        if variant is not None:
            stages = variant.stages(stages)
        x, y = data(size, seed=seed + 1, dtype=dtype)
        mb = size.batch // size.microbatches
        inputs: list[Tensor] = [x[:mb]]
        target = y[:mb]
        loss = loss_fn(size)
        g = torch.Generator().manual_seed(seed + 7)
        self.stages: list[tuple[Any, list[Tensor], list[Tensor], list[Tensor], Any]] = []
        for s, (stage, prm) in enumerate(zip(stages, params, strict=True)):
            leaves, tree = tree_flatten(prm)
            ps = [t.detach().requires_grad_() for t in leaves]
            fn = flat_stage(stage, tree, loss if s == n_stages - 1 else None, target)
            with torch.no_grad():
                out = fn(ps, inputs)
            gy = (
                [torch.tensor(1.0 / size.microbatches, dtype=dtype)]
                if s == n_stages - 1
                else [torch.randn(out[0].shape, generator=g, dtype=dtype)]
            )
            self.stages.append((fn, ps, inputs, gy, autodiff.param_nodes(ps)))
            inputs = out
        self.raw: dict[str, list[list[float]]] = {k: [[] for _ in stages] for k in "fbiw"}

    def _forward(self, s: int, ps: Sequence[Tensor] | None = None) -> Any:
        from funcpipe.runtime import autodiff

        fn, own, inputs, _, _ = self.stages[s]
        _, saved = autodiff.forward(fn, own if ps is None else ps, inputs)
        if s == 0:  # as the interpreter: the batch needs no gradient
            for t in saved.inputs:
                t.requires_grad_(False)
        return saved

    def once(self) -> None:
        from funcpipe.runtime import autodiff

        forward = self._forward
        for s, (_, ps, _, gy, nodes) in enumerate(self.stages):
            t0 = time.perf_counter()
            saved = forward(s)
            t1 = time.perf_counter()
            autodiff.backward(saved, ps, gy, accumulate=True)
            t2 = time.perf_counter()
            saved = forward(s)
            t3 = time.perf_counter()
            autodiff.backward_input(saved, ps, gy, nodes=nodes)
            t4 = time.perf_counter()
            autodiff.backward_weight(saved, ps, accumulate=True)
            t5 = time.perf_counter()
            self.raw["f"][s] += [t1 - t0, t3 - t2]
            self.raw["b"][s].append(t2 - t1)
            self.raw["i"][s].append(t4 - t3)
            self.raw["w"][s].append(t5 - t4)

    def result(self, skip: int = 0) -> StageCosts:
        """Median per stage, leaving out the first ``skip`` repetitions (warm-up)."""

        def med(key: str) -> list[float]:
            per = 2 if key == "f" else 1  # two forwards per repetition
            return [median(t[per * skip :]) for t in self.raw[key]]

        return StageCosts(med("f"), med("b"), med("i"), med("w"))

    def split_diff(self) -> list[float]:
        """Per stage: how far I then W is from one B (max relative difference over the input
        and parameter gradients), each on fresh leaves."""
        from funcpipe.runtime import autodiff

        out = []
        for s, (_, ps, _, gy, _) in enumerate(self.stages):
            whole = [t.detach().clone().requires_grad_() for t in ps]
            split = [t.detach().clone().requires_grad_() for t in ps]
            gin_b, _ = autodiff.backward(self._forward(s, whole), whole, gy, accumulate=True)
            saved = self._forward(s, split)
            nodes = autodiff.param_nodes(split)
            gin_i = autodiff.backward_input(saved, split, gy, nodes=nodes)
            autodiff.backward_weight(saved, split, accumulate=True)
            a = [t for t in [*gin_i, *(p.grad for p in split)] if t is not None]
            b = [t for t in [*gin_b, *(p.grad for p in whole)] if t is not None]
            out.append(max_rel_diff(a, b))
        return out


def flat_stage(
    stage: fp.Stage, tree: Any, loss: Callable[..., Tensor] | None, target: Tensor
) -> Callable[..., list[Tensor]]:
    from funcpipe.tree import tree_unflatten

    def fn(params: Sequence[Tensor], inputs: Sequence[Tensor]) -> list[Tensor]:
        out = stage(tree_unflatten(tree, list(params)), *inputs)
        return [loss(out, target).reshape(())] if loss is not None else [out]

    return fn


def measure_stage_costs(
    size: Size, n_stages: int, *, reps: int = 20, seed: int = 0, variant: Variant | None = None
) -> StageCosts:
    """Median time of F, B, I and W of every stage on one microbatch (:class:`StageTimer`,
    ``reps`` repetitions after 2 warm-ups; ``variant``: the stages in its precision, compiled)."""
    timer = StageTimer(size, n_stages, seed=seed, variant=variant)
    for _ in range(reps + 2):
        timer.once()
    return timer.result(skip=2)


def split_program(program: Program) -> bool:
    from funcpipe.schedule import Op

    return any(i.op is Op.I for r in program.ranks for i in r)


def ideal_makespan(program: Program, c: StageCosts) -> float:
    """The compute floor: the simulated makespan of ``program`` (communication added, no
    message latency) with each stage's measured F, B, I and W."""
    from funcpipe.schedule import add_communication, simulate

    return simulate(add_communication(program), c.costs()).makespan


def one_process_time(program: Program, c: StageCosts) -> float:
    """The simulated time of the same work on one rank: every F and backward one after another."""
    split = split_program(program)
    per_mb = sum(
        f + ((i + w) if split else b) for f, b, i, w in zip(c.f, c.b, c.i, c.w, strict=True)
    )
    return per_mb * program.microbatches


def p2p_latency(rank: int, shape: Sequence[int], reps: int = 50) -> float:
    """Half the median round trip of one float32 tensor of ``shape`` between ranks 0 and 1, over
    torch.distributed send/recv, what a Pipeline between processes uses. Every rank of the pool
    must call it."""
    import torch.distributed as dist

    t = torch.zeros(*shape)

    def send(peer: int) -> None:
        dist.send(t, peer)

    def recv(peer: int) -> None:
        dist.recv(t, peer)

    times = []
    for k in range(reps + 5):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            send(1)
            recv(1)
        elif rank == 1:
            recv(0)
            send(0)
        if k >= 5:
            times.append((time.perf_counter() - t0) / 2)
    return median(times)


# ------------------------------------------------------------------------------ contention


def _procs_running() -> int | None:
    try:
        with open("/proc/stat") as f:
            for ln in f:
                if ln.startswith("procs_running"):
                    return int(ln.split()[1])
    except OSError:
        pass
    return None


class Runnable:
    """Samples the number of runnable tasks on the machine (Linux ``procs_running``) in a
    background thread while the block runs. A benchmark with ``n`` busy ranks sees about
    ``n + 1`` (the sampler itself) when nothing else competes for the cores."""

    def __init__(self, every: float = 0.1) -> None:
        import threading

        self.every, self.samples = every, []  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            n = _procs_running()
            if n is not None:
                self.samples.append(n)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.samples) if self.samples else None

    def __enter__(self) -> Runnable:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def wait_quiet(*, max_runnable: float, timeout: float, window: float = 2.0) -> float:
    """Wait (up to ``timeout`` s) until the mean runnable count over ``window`` s is at most
    ``max_runnable``; returns the seconds waited."""
    t0 = time.monotonic()
    while True:
        with Runnable() as r:
            time.sleep(window)
        if r.mean is None or r.mean <= max_runnable or time.monotonic() - t0 > timeout:
            return time.monotonic() - t0


def measured_cell(
    job: Callable[[], Any],
    *,
    ranks: int,
    quiet: bool,
    retries: int,
    wait: float = 300.0,
    again: Callable[[Any], bool] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Run ``job`` (one benchmark cell): with ``quiet``, first wait for the other processes on
    the machine to settle; rerun up to ``retries`` times while others competed for the cores
    (mean runnable tasks above ranks + 1.5), keeping the least contended run. ``again(result)``
    False forbids a rerun (e.g. the job left its pool unusable)."""
    best: tuple[Any, dict[str, Any]] | None = None
    for attempt in range(retries + 1):
        waited = wait_quiet(max_runnable=1.5, timeout=wait) if quiet else 0.0
        with Runnable() as r:
            out = job()
        info = {"runnable": r.mean, "attempts": attempt + 1, "waited_s": waited}
        if best is None or (r.mean or 0.0) < (best[1]["runnable"] or 0.0):
            best = (out, info)
        if r.mean is None or r.mean <= ranks + 1.5 or (again is not None and not again(out)):
            break
    assert best is not None
    best[1]["attempts"] = attempt + 1
    return best
