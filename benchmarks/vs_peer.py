"""funcpipe against torch.distributed.pipelining: same model, ranks, schedule and processes.

    python benchmarks/vs_peer.py [--model gpt|mlp] [--ranks 2 4] [--pairs 20] [--json FILE]
        [--precision fp32|bf16] [--compile [BACKEND]]

The model (``--model``, default ``gpt``; ``--sizes`` names sizes of ``benchmarks._common.SIZES``)
is one ``nn.Sequential`` cut at the same places for both: ``funcpipe.partition(model,
stages=n, by=cuts)`` and a ``PipelineStage`` of each slice. ``gpt`` (the headline): a GPT of
8 pre-LayerNorm blocks, d_model 256, 4 heads, 128 tokens, byte vocabulary, cross-entropy on
next tokens, 16 sequences in 8 microbatches (``benchmarks/gpt.py``); ``mlp``: the toy MLP of
earlier rounds, 8 x (Linear + GELU), sizes ``small`` and ``large``.

For every (size, ranks, schedule) cell, one job on a pool of gloo processes (one thread each):

1. gradients: from the same float64 weights, one funcpipe step (``Pipeline(transport="dist")``)
   and one peer step (``PipelineStage`` + the schedule's ``step``) on the same processes; each
   rank compares its stages' parameter gradients with each other and with plain autograd on
   the whole model in one process (the peer averages the per-microbatch losses and divides
   its grads by the number of microbatches, funcpipe seeds each microbatch's loss with 1/m:
   both give the gradient of the mean loss);
2. time: float32 weights, ``--warmup`` steps of each, then ``--pairs`` pairs run A B A B
   (funcpipe then peer), every step started after a barrier; a step's time is its slowest
   rank's. Between its steps the peer clears its gradients with ``zero_grad(set_to_none=True)``,
   torch's default; ``--peer-grads zeros`` keeps and zeroes them instead. ``--precision bf16``
   runs every stage of both under bf16 autocast (funcpipe: ``autocast_stage``; the peer: a
   module whose forward is under ``torch.autocast``), ``--compile [BACKEND]`` compiles every
   stage of both (``compile_stage``; ``torch.compile`` of each peer stage module); the last
   timed step's gradients of the two are compared (``grads fp vs peer (timed)``).

Reported: the median step time of each, the median of the paired ratios funcpipe / peer, and the
interquartile spread of those ratios. A peer schedule that fails records its error in the table.

``ideal``: the compute floor. Right before each cell, this (the launching) process, one
thread like each rank, times every stage's F, B, I and W on one microbatch with funcpipe's
autodiff as the interpreter calls it (``--ideal-reps`` repetitions, medians; the last stage
with its loss); ideal = ``funcpipe.schedule.simulate`` of the schedule's program with those
costs and no message latency. No runtime that runs this arithmetic in this schedule, one core
per rank, can beat it: ``executed/ideal`` is funcpipe's median step over it, ``peer/ideal``
the peer's. With more ranks than cores the ranks share cores, which the simulation does not
model (4 ranks on 2 cores cannot reach it).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as C

COLUMNS: list[C.Column] = [
    ("size", "size", ""),
    ("ranks", "ranks", "d"),
    ("schedule", "schedule", ""),
    ("variant", "timed as", ""),
    ("peer_class", "peer class", ""),
    ("funcpipe_ms", "funcpipe ms", ".1f"),
    ("peer_ms", "peer ms", ".1f"),
    ("ratio", "funcpipe/peer", ".3f"),
    ("ratio_iqr", "IQR/med", ".2f"),
    ("ideal_ms", "ideal ms", ".1f"),
    ("ideal_ratio", "executed/ideal", ".3f"),
    ("peer_ideal_ratio", "peer/ideal", ".3f"),
    ("grad_diff", "grads fp vs peer", ".1e"),
    ("grad_ref", "fp vs 1-proc", ".1e"),
    ("peer_ref", "peer vs 1-proc", ".1e"),
    ("grad_diff_timed", "grads fp vs peer (timed)", ".1e"),
    ("note", "note", ""),
    ("runnable", "runnable (mean)", ".1f"),
    ("attempts", "runs", "d"),
]


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:160]


class _Peer:
    """The peer's stages and schedule for the stages this rank holds (a deep copy of the
    model: its gradients live in its own parameters' ``.grad``)."""

    def __init__(
        self,
        spec: C.ScheduleSpec,
        model: torch.nn.Sequential,
        size: C.Size,
        mine: list[int],
        n: int,
        *,
        set_to_none: bool = True,
        variant: C.Variant | None = None,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage, schedules

        self.set_to_none = set_to_none
        self.model = copy.deepcopy(model)
        self.modules = C.stage_modules(self.model, size, n)
        self.mine, self.n = mine, n
        wrap = variant.module if variant is not None else (lambda m: m)
        cpu = torch.device("cpu")
        stages = [PipelineStage(wrap(self.modules[s]), s, n, cpu) for s in mine]
        cls = getattr(schedules, spec.peer or "")
        loss = C.loss_fn(size)
        m = size.microbatches
        self.schedule = cls(
            stages[0] if spec.chunks == 1 else stages, n_microbatches=m, loss_fn=loss
        )

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for s in self.mine:
            self.modules[s].zero_grad(set_to_none=self.set_to_none)
        args = (x,) if 0 in self.mine else ()
        target = y if self.n - 1 in self.mine else None
        self.schedule.step(*args, target=target, return_outputs=False)

    def grads(self, names: list[str]) -> list[torch.Tensor]:
        by_name = dict(self.model.named_parameters())
        return [
            torch.zeros_like(by_name[k]) if by_name[k].grad is None else by_name[k].grad.clone()
            for k in names
        ]


def _fp_grads(grads: Any, names: list[str]) -> list[torch.Tensor]:
    """This rank's gradients from funcpipe's grads (one dict per stage, ``None`` for the
    stages it does not hold), in ``names``' order."""
    by_name = {k: v for g in grads if isinstance(g, dict) for k, v in g.items()}
    return [by_name[k] for k in names]


def _any(flag: bool) -> bool:
    """True on every rank when it is true on some rank."""
    import torch.distributed as dist

    t = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(t)
    return bool(t.item() > 0)


def cell(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One (size, ranks, schedule) cell on this rank; see the module docstring."""
    import torch.distributed as dist

    import funcpipe as fp

    size = C.Size(**cfg["size"])
    variant = C.Variant(**cfg["variant"])
    spec = C.SCHEDULES[cfg["schedule"]]
    ranks = dist.get_world_size()
    program = C.program_for(spec.name, ranks=ranks, microbatches=size.microbatches)
    n = program.n_stages
    mine = sorted(program.stages_on(rank))
    out: dict[str, Any] = {"rank": rank, "errors": {}, "dirty": False}

    def build(
        dtype: torch.dtype, timed: bool = False
    ) -> tuple[Any, torch.nn.Sequential, list[Any], Any, Any]:
        model = C.build(size, dtype=dtype, seed=cfg["seed"])
        stages, params = C.funcpipe_stages(model, size, n)
        if timed:
            stages = variant.stages(stages)
        pipe = fp.Pipeline(stages, program, loss_fn=C.loss_fn(size), transport="dist")
        x, y = C.data(size, dtype=dtype, seed=cfg["seed"] + 1)
        return pipe, model, params, x, y

    # ---- gradients, float64
    pipe, model, params, x, y = build(torch.float64)
    names = C.stage_names(model, size, n, mine)
    ref_all = dict(
        zip(
            [k for k, _ in model.named_parameters()],
            C.reference_grads(model, size, x, y),
            strict=True,
        )
    )
    ref = [ref_all[k] for k in names]
    fp_grads: list[torch.Tensor] | None = None
    try:
        res = pipe.step(params, x, y)
        fp_grads = _fp_grads(res.grads, names)
        out["grad_ref"] = C.max_rel_diff(fp_grads, ref)
    except Exception as e:
        out["errors"]["funcpipe"] = _short(e)
        out["dirty"] = True
        out["traceback"] = traceback.format_exc()
    peer_ok = spec.peer is not None and cfg["peer"]
    if peer_ok:
        try:
            peer = _Peer(spec, model, size, mine, n)
            peer.step(x, y)
            pg = peer.grads(names)
            out["peer_ref"] = C.max_rel_diff(pg, ref)
            if fp_grads is not None:
                out["grad_diff"] = C.max_rel_diff(fp_grads, pg)
        except Exception as e:
            out["errors"]["peer"] = _short(e)
            out["dirty"] = True
    try:
        failed = _any(out["dirty"])
    except Exception:
        out["dirty"] = True
        return out
    if failed:
        out["dirty"] = True
        return out
    del pipe, model, params, ref_all, ref, fp_grads
    if peer_ok:
        del peer

    # ---- time, float32 weights (in the variant's precision, compiled or not), A B A B
    pipe, model, params, x, y = build(torch.float32, timed=True)
    peer32: _Peer | None = None
    if peer_ok:
        try:
            none = cfg["peer_grads"] == "none"
            peer32 = _Peer(spec, model, size, mine, n, set_to_none=none, variant=variant)
        except Exception as e:  # torch's zero-bubble schedules refuse compiled stage modules
            out["errors"]["peer (timed)"] = _short(e)
        if _any(peer32 is None):  # every rank times the same steps
            peer32 = None
    last: list[Any] = [None]

    def timed(f: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0

    def run_fp() -> None:
        last[0] = pipe.step(params, x, y)

    def run_peer() -> None:
        assert peer32 is not None
        peer32.step(x, y)

    fp_t, peer_t = [], []
    try:
        for _ in range(cfg["warmup"]):
            timed(run_fp)
            if peer32 is not None:
                timed(run_peer)
        for _ in range(cfg["pairs"]):
            fp_t.append(timed(run_fp))
            if peer32 is not None:
                peer_t.append(timed(run_peer))
    except Exception as e:  # e.g. the peer cannot run a compiled stage in this schedule
        out["errors"]["timed"] = _short(e)
        out["dirty"] = True
        out["traceback"] = traceback.format_exc()
        return out
    out["funcpipe"], out["peer"] = fp_t, peer_t
    if peer32 is not None and last[0] is not None:  # the last timed step's gradients
        out["grad_diff_timed"] = C.max_rel_diff(
            _fp_grads(last[0].grads, names), peer32.grads(names)
        )
    return out


def ideal(program: Any, size: C.Size, args: argparse.Namespace) -> tuple[float, C.StageCosts]:
    """The compute floor (s): the schedule's simulated makespan from each stage's F, B, I and
    W measured now in this process (one thread), and those costs."""
    costs = C.measure_stage_costs(
        size, program.n_stages, reps=args.ideal_reps, seed=args.seed, variant=_variant(args)
    )
    return C.ideal_makespan(program, costs), costs


def _variant(args: argparse.Namespace) -> C.Variant:
    return C.Variant(precision=args.precision, compile=args.compile)


def run(args: argparse.Namespace, pools: C.Pools) -> list[dict[str, Any]]:
    from benchmarks import vs_peer  # by module name, so the workers can unpickle the job

    rows: list[dict[str, Any]] = []
    for ranks in args.ranks:
        for size_name in C.sizes_for(args.model, args.sizes):
            size = C.resize(
                C.SIZES[size_name],
                width=args.width,
                batch=args.batch,
                layers=args.layers,
                microbatches=args.microbatches,
            )
            for sched in args.schedules:
                spec = C.SCHEDULES[sched]
                row: dict[str, Any] = {
                    "size": size.name,
                    "model": size.model,
                    "width": size.width,
                    "batch": size.batch,
                    "layers": size.layers,
                    "heads": size.heads,
                    "seq": size.seq,
                    "microbatches": size.microbatches,
                    "ranks": ranks,
                    "schedule": sched,
                    "variant": _variant(args).label,
                    "precision": args.precision,
                    "compile": args.compile,
                    "peer_class": spec.peer or "-",
                    "pairs": args.pairs,
                    "warmup": args.warmup,
                    "peer_grads": args.peer_grads,
                }
                cfg = {
                    "size": vars(size),
                    "schedule": sched,
                    "variant": vars(_variant(args)),
                    "seed": args.seed,
                    "pairs": args.pairs,
                    "warmup": args.warmup,
                    "peer": not args.no_peer,
                    "peer_grads": args.peer_grads,
                }
                pool = pools.get(ranks)
                program = C.program_for(sched, ranks=ranks, microbatches=size.microbatches)
                if args.ideal_reps > 0:
                    span, costs = ideal(program, size, args)
                    row["ideal_ms"] = span * 1e3
                    row["one_process_ms"] = C.one_process_time(program, costs) * 1e3
                    row["stage_costs_s"] = costs.as_dict()
                try:
                    results, info = C.measured_cell(
                        lambda pool=pool, cfg=cfg: pool.run(
                            vs_peer.cell, cfg, timeout=args.job_timeout
                        ),
                        ranks=ranks,
                        quiet=args.quiet,
                        retries=args.retries,
                        again=lambda res: not any(r["dirty"] for r in res),
                    )
                except Exception as e:  # a rank died or hung: restart the pool
                    row["note"] = f"job failed: {_short(e)}"
                    pool.close(kill=True)
                    rows.append(row)
                    print(C.table([row], COLUMNS).splitlines()[-1], flush=True)
                    continue
                errors: dict[str, str] = {}
                # the rank that raised first, not the ones that timed out waiting for it
                for r in sorted(results, key=lambda r: "Timed out" in str(r["errors"])):
                    for k, v in r["errors"].items():
                        errors.setdefault(k, f"rank {r['rank']}: {v}")
                if any("traceback" in r for r in results) and args.verbose:
                    print(
                        next(r["traceback"] for r in results if "traceback" in r), file=sys.stderr
                    )
                peer_ran = "peer" not in errors and spec.peer and not args.no_peer
                row["grad_diff"] = (
                    max((r.get("grad_diff", 0.0) for r in results), default=None)
                    if peer_ran
                    else None
                )
                row["grad_ref"] = (
                    max((r.get("grad_ref", 0.0) for r in results), default=None)
                    if "funcpipe" not in errors
                    else None
                )
                row["peer_ref"] = (
                    max((r.get("peer_ref", 0.0) for r in results), default=None)
                    if peer_ran
                    else None
                )
                timed_diffs = [r["grad_diff_timed"] for r in results if "grad_diff_timed" in r]
                row["grad_diff_timed"] = max(timed_diffs) if timed_diffs else None
                if "funcpipe" in results[0]:
                    fp_t = C.step_times([r["funcpipe"] for r in results])
                    row["funcpipe_ms"] = C.median(fp_t) * 1e3
                    row["funcpipe_times"] = fp_t
                    if row.get("ideal_ms"):
                        row["ideal_ratio"] = row["funcpipe_ms"] / row["ideal_ms"]
                    if results[0]["peer"]:
                        peer_t = C.step_times([r["peer"] for r in results])
                        ratios = C.paired_ratios(fp_t, peer_t)
                        row["peer_ms"] = C.median(peer_t) * 1e3
                        row["peer_times"] = peer_t
                        row["ratio"] = C.median(ratios)
                        row["ratio_iqr"] = C.spread(ratios)
                        if row.get("ideal_ms"):
                            row["peer_ideal_ratio"] = row["peer_ms"] / row["ideal_ms"]
                row["note"] = "; ".join(f"{k} failed ({v})" for k, v in errors.items()) or ""
                if any(r["dirty"] for r in results):
                    pool.close(kill=True)
                row.update(info)
                rows.append(row)
                print(C.table([row], COLUMNS).splitlines()[-1], flush=True)
    return rows


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="vs_peer.py",
        description="funcpipe vs torch.distributed.pipelining: step time and gradients.",
    )
    ap.add_argument(
        "--model",
        choices=sorted(C.MODELS),
        default=None,
        help="gpt (the default) or mlp: runs that model's sizes (gpt: gpt; mlp: small large)",
    )
    ap.add_argument(
        "--sizes", nargs="+", default=None, choices=sorted(C.SIZES), help="sizes to run instead"
    )
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument(
        "--schedules", nargs="+", default=list(C.PEER_SCHEDULES), choices=list(C.PEER_SCHEDULES)
    )
    ap.add_argument("--pairs", type=C.int_at_least(1), default=20, help="timed A B pairs per cell")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each first")
    ap.add_argument("--width", type=int, default=None, help="override the width (gpt: d_model)")
    ap.add_argument(
        "--batch", type=int, default=None, help="override the batch (gpt: sequences; mlp: rows)"
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="override the layers (gpt: blocks; mlp: Linear+GELU)",
    )
    ap.add_argument("--microbatches", type=int, default=None, help="override the 8 microbatches")
    ap.add_argument("--no-peer", action="store_true", help="time funcpipe only")
    ap.add_argument(
        "--ideal-reps",
        type=int,
        default=10,
        help="repetitions per stage cost for the ideal (compute floor); 0: skip it",
    )
    ap.add_argument(
        "--peer-grads",
        default="none",
        choices=["none", "zeros"],
        help="between the peer's steps: zero_grad(set_to_none=True), torch's default (none: "
        "every step allocates new gradients), or set_to_none=False (zeros: they are reused)",
    )
    C.variant_options(ap)
    ap.add_argument("--verbose", action="store_true")
    C.pool_options(ap)
    return ap


def main(
    argv: list[str] | None = None, *, pool: C.PoolFactory | None = None
) -> list[dict[str, Any]]:
    """Run the benchmark; ``pool(n)`` may supply started pools of ``n`` gloo processes."""
    rows: list[dict[str, Any]] = C.run_main("vs_peer.py", argv, pool, parser, COLUMNS, run)
    return rows


if __name__ == "__main__":
    main()
