"""funcpipe against torch.distributed.pipelining: same model, ranks, schedule and processes.

    python benchmarks/vs_peer.py [--sizes small large] [--ranks 2 4] [--pairs 20] [--json FILE]

For every (size, ranks, schedule) cell, one job on a pool of gloo processes (one thread each):

1. gradients: from the same float64 weights, one funcpipe step (``Pipeline(transport="dist")``)
   and one peer step (``PipelineStage`` + the schedule's ``step``) on the same processes; each
   rank compares its stages' parameter gradients with each other and with plain autograd on
   the whole model (the peer averages the per-microbatch losses and divides its grads by the
   number of microbatches, funcpipe seeds each microbatch's loss with 1/m: both give the
   gradient of the mean loss);
2. time: float32, ``--warmup`` steps of each, then ``--pairs`` pairs run A B A B (funcpipe then
   peer), every step started after a barrier; a step's time is its slowest rank's. Between its
   steps the peer clears its gradients with ``zero_grad(set_to_none=True)``, torch's default,
   so its backward allocates new ones; ``--peer-grads zeros`` keeps and zeroes them instead.
   ``--peer-onednn off`` times the peer with oneDNN switched off process-wide (its small GELUs
   then take the kernel funcpipe's chain stages pick).

Reported: the median step time of each, the median of the paired ratios funcpipe / peer, and the
interquartile spread of those ratios. A peer schedule that fails records its error in the table.

``floor``: right before each cell, every rank times each stage's F, B, I and W on one microbatch
(all ranks at once, as in a step); the simulator's makespan of the schedule with those costs and
no message latency is the compute-only step time, which no runtime running the same autograd
arithmetic in this schedule can beat. ``floor/peer`` is then the lowest funcpipe/peer any
runtime could reach in that cell. Only where every rank has a core of its own (ranks <= cores).

``raw floor``: the same, with each stage's F, B, I and W computed by bare kernels
(``benchmarks/_raw.py``: the products, GELU and the loss with no autograd and no runtime; the
same gradients), timed on every rank at once right after the floor's costs. It is the step
time of the arithmetic itself, one microbatch at a time: ``raw floor/peer`` is the lowest
funcpipe/peer a runtime could reach in that cell without changing what is computed (GPipe
excepted: funcpipe sums its weight gradients over all microbatches in one product).

``staged raw floor``: the same bare kernels doing what ``Pipeline(stage_weights=True)`` does
(``_raw``'s staged B and W copy their Linears' rows aside; once per step each weight gradient
is one product over all the rows): the schedule simulated with the staged B and W, then each
rank's step sums added after its last instruction. Sums computed while a rank waits
(``idle_weights``) can take a step below it; otherwise it is the step of funcpipe's arithmetic
with a runtime that cost nothing.
"""

from __future__ import annotations

import argparse
import copy
import os
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
    ("peer_class", "peer class", ""),
    ("funcpipe_ms", "funcpipe ms", ".2f"),
    ("peer_ms", "peer ms", ".2f"),
    ("ratio", "funcpipe/peer", ".3f"),
    ("ratio_iqr", "IQR/med", ".2f"),
    ("floor_ms", "floor ms", ".2f"),
    ("floor_ratio", "floor/peer", ".3f"),
    ("raw_floor_ms", "raw floor ms", ".2f"),
    ("raw_floor_ratio", "raw floor/peer", ".3f"),
    ("staged_floor_ms", "staged raw floor ms", ".2f"),
    ("staged_floor_ratio", "staged raw/peer", ".3f"),
    ("grad_diff", "grads fp vs peer", ".1e"),
    ("grad_ref", "fp vs 1-proc", ".1e"),
    ("peer_ref", "peer vs 1-proc", ".1e"),
    ("note", "note", ""),
    ("runnable", "runnable (mean)", ".1f"),
    ("attempts", "runs", "d"),
]


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:160]


def _peer_schedule(
    spec: C.ScheduleSpec, stages: list[Any], microbatches: int
) -> Any:  # a torch.distributed.pipelining schedule
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, spec.peer or "")
    if spec.chunks == 1:
        return cls(stages[0], n_microbatches=microbatches, loss_fn=C.mse)
    return cls(stages, n_microbatches=microbatches, loss_fn=C.mse)


class _Peer:
    """The peer's stages and schedule for the stages this rank holds."""

    def __init__(
        self,
        spec: C.ScheduleSpec,
        model: torch.nn.Sequential,
        mine: list[int],
        n: int,
        m: int,
        *,
        set_to_none: bool = True,
        onednn: bool = True,
    ) -> None:
        from torch.distributed.pipelining import PipelineStage

        self.set_to_none, self.onednn = set_to_none, onednn

        self.model = copy.deepcopy(model)
        self.modules = C.stage_modules(self.model, n)
        self.mine, self.n = mine, n
        stages = [PipelineStage(self.modules[s], s, n, torch.device("cpu")) for s in mine]
        self.schedule = _peer_schedule(spec, stages, m)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for s in self.mine:
            self.modules[s].zero_grad(set_to_none=self.set_to_none)
        args = (x,) if 0 in self.mine else ()
        target = y if self.n - 1 in self.mine else None
        if self.onednn:
            self.schedule.step(*args, target=target, return_outputs=False)
            return
        with torch.backends.mkldnn.flags(enabled=False):  # (--peer-onednn off)
            self.schedule.step(*args, target=target, return_outputs=False)

    def grads(self, names: list[str]) -> list[torch.Tensor]:
        by_name = dict(self.model.named_parameters())
        return [
            torch.zeros_like(by_name[k]) if by_name[k].grad is None else by_name[k].grad.clone()
            for k in names
        ]


def _stage_names(model: torch.nn.Sequential, n: int, stages: list[int]) -> list[str]:
    """Parameter names of the given stages, in parameter order."""
    cuts = C.bounds(len(model), n)
    names = []
    for s in stages:
        a, b = cuts[s]
        names += [k for k, _ in model.named_parameters() if a <= int(k.split(".")[0]) < b]
    return names


def _fp_grads(
    grads: Any, names: list[str], model: torch.nn.Sequential, mine: list[int], n: int
) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for s in mine:
        g = grads[s]
        if isinstance(g, dict):
            out += [g[k] for k in _stage_names(model, n, [s])]
        else:
            out += list(g)
    return out


def both_steps(rank: int, cfg: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """funcpipe's and the peer's float32 steps of ``cfg``'s (size, schedule, seed) on this rank,
    as ``{"funcpipe": step, "peer": step}``, and how far their float64 gradients from the same
    weights are apart (max |difference| / max |gradient| over this rank's stages)."""
    import torch.distributed as dist

    import funcpipe as fp

    size = C.Size(**cfg["size"])
    spec = C.SCHEDULES[cfg["schedule"]]
    program = C.program_for(spec.name, ranks=dist.get_world_size(), microbatches=size.microbatches)
    n = program.n_stages
    mine = sorted(program.stages_on(rank))

    def build(dtype: torch.dtype) -> tuple[Any, _Peer, list[Any], Any, Any, Any]:
        model = C.mlp(size.width, layers=size.layers, dtype=dtype, seed=cfg["seed"])
        stages, params = C.funcpipe_stages(model, n, kind="module")
        pipe = fp.Pipeline(stages, program, loss_fn=C.mse, transport="dist")
        peer = _Peer(spec, model, mine, n, size.microbatches)
        x, y = C.data(size, dtype=dtype, seed=cfg["seed"] + 1)
        return pipe, peer, params, x, y, model

    pipe, peer, params, x, y, model = build(torch.float64)
    names = _stage_names(model, n, mine)
    mine_fp = _fp_grads(pipe.step(params, x, y).grads, names, model, mine, n)
    peer.step(x, y)
    diff = C.max_rel_diff(mine_fp, peer.grads(names))
    del pipe, peer

    pipe, peer, params, x, y, _ = build(torch.float32)
    steps = {"funcpipe": lambda: pipe.step(params, x, y), "peer": lambda: peer.step(x, y)}
    return steps, diff


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
    spec = C.SCHEDULES[cfg["schedule"]]
    ranks = dist.get_world_size()
    program = C.program_for(spec.name, ranks=ranks, microbatches=size.microbatches)
    n = program.n_stages
    mine = sorted(program.stages_on(rank))
    out: dict[str, Any] = {"rank": rank, "errors": {}, "dirty": False}

    def build(dtype: torch.dtype) -> tuple[Any, torch.nn.Sequential, list[Any], Any, Any]:
        model = C.mlp(size.width, layers=size.layers, dtype=dtype, seed=cfg["seed"])
        stages, params = C.funcpipe_stages(model, n, kind=cfg["stage_kind"])
        pipe = fp.Pipeline(
            stages,
            program,
            loss_fn=C.mse,
            transport="dist",
            p2p=cfg["p2p"],
            batch_weights_extra=cfg["batch_weights_extra"],
        )
        x, y = C.data(size, dtype=dtype, seed=cfg["seed"] + 1)
        return pipe, model, params, x, y

    # ---- gradients, float64
    pipe, model, params, x, y = build(torch.float64)
    names = _stage_names(model, n, mine)
    ref_all = dict(
        zip(
            [k for k, _ in model.named_parameters()],
            C.reference_grads(model, x, y, microbatches=size.microbatches),
            strict=True,
        )
    )
    ref = [ref_all[k] for k in names]
    fp_grads: list[torch.Tensor] | None = None
    try:
        res = pipe.step(params, x, y)
        fp_grads = _fp_grads(res.grads, names, model, mine, n)
        out["grad_ref"] = C.max_rel_diff(fp_grads, ref)
    except Exception as e:
        out["errors"]["funcpipe"] = _short(e)
        out["dirty"] = True
        out["traceback"] = traceback.format_exc()
    peer_ok = spec.peer is not None and cfg["peer"]
    if peer_ok:
        try:
            peer = _Peer(spec, model, mine, n, size.microbatches)
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

    # ---- time, float32, A B A B
    pipe, model, params, x, y = build(torch.float32)
    peer32 = (
        _Peer(
            spec,
            model,
            mine,
            n,
            size.microbatches,
            set_to_none=cfg["peer_grads"] == "none",
            onednn=cfg.get("peer_onednn", "on") == "on",
        )
        if peer_ok
        else None
    )

    def timed(f: Any) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0

    def run_fp() -> None:
        pipe.step(params, x, y)

    def run_peer() -> None:
        assert peer32 is not None
        peer32.step(x, y)

    for _ in range(cfg["warmup"]):
        timed(run_fp)
        if peer32 is not None:
            timed(run_peer)
    fp_t, peer_t = [], []
    for _ in range(cfg["pairs"]):
        fp_t.append(timed(run_fp))
        if peer32 is not None:
            peer_t.append(timed(run_peer))
    out["funcpipe"], out["peer"] = fp_t, peer_t
    return out


def raw_costs_job(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from benchmarks import _raw

    size = C.Size(**cfg["size"])
    n, reps, seed = cfg["n_stages"], cfg["reps"], cfg["seed"]
    staged, sums = _raw.measure_staged(size, n, reps=reps, seed=seed)
    plain = _raw.measure(size, n, reps=reps, seed=seed)
    return {"plain": plain.as_dict(), "staged": staged.as_dict(), "sums": sums}


def floor(
    pool: Any, program: Any, size: C.Size, args: argparse.Namespace
) -> tuple[float, float, float]:
    """The schedule's compute-only makespans (s) from stage costs measured now on every rank:
    with funcpipe's autodiff, with bare kernels (``_raw``), and with the bare kernels' staged
    arithmetic (each rank's step-end weight sums after its last instruction)."""
    from benchmarks import vs_simulated
    from funcpipe.schedule import add_communication, simulate

    measured = pool.run(
        vs_simulated.costs_job,
        {
            "size": vars(size),
            "seed": args.seed,
            "stage_kind": args.stage_kind,
            "n_stages": [program.n_stages],
            "cost_reps": args.floor_reps,
            "comm_reps": 1,
        },
        timeout=args.job_timeout,
    )
    raw = pool.run(
        raw_costs_job,
        {
            "size": vars(size),
            "seed": args.seed,
            "n_stages": program.n_stages,
            "reps": args.floor_reps,
        },
        timeout=args.job_timeout,
    )
    n = program.n_stages
    mine = {s: program.placement[s] for s in range(n)}
    lowered = add_communication(program)

    def own(costs: list[C.StageCosts]) -> C.StageCosts:  # each stage's, from its own rank
        return C.StageCosts(
            *[[getattr(costs[mine[s]], k)[s] for s in range(n)] for k in ("f", "b", "i", "w")]
        )

    spans = []
    for costs in (
        [C.StageCosts(**m["costs"][str(n)]) for m in measured],
        [C.StageCosts(**r["plain"]) for r in raw],
    ):
        spans.append(simulate(lowered, C.costs_for(program, own(costs))).makespan)
    timeline = simulate(
        lowered, C.costs_for(program, own([C.StageCosts(**r["staged"]) for r in raw]))
    )
    sums = [raw[mine[s]]["sums"][s] for s in range(n)]
    ends = [max((e.end for e in events), default=0.0) for events in timeline.events]
    for s in range(n):
        ends[mine[s]] += sums[s]
    return spans[0], spans[1], max(ends)


def run(args: argparse.Namespace, pools: C.Pools) -> list[dict[str, Any]]:
    from benchmarks import vs_peer  # by module name, so the workers can unpickle the job

    rows: list[dict[str, Any]] = []
    for ranks in args.ranks:
        for size_name in args.sizes:
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
                    "width": size.width,
                    "batch": size.batch,
                    "layers": size.layers,
                    "microbatches": size.microbatches,
                    "ranks": ranks,
                    "schedule": sched,
                    "peer_class": spec.peer or "-",
                    "pairs": args.pairs,
                    "p2p": args.p2p,
                    "peer_grads": args.peer_grads,
                    "peer_onednn": args.peer_onednn,
                    "batch_weights_extra": args.batch_weights_extra,
                }
                cfg = {
                    "size": vars(size),
                    "schedule": sched,
                    "seed": args.seed,
                    "stage_kind": args.stage_kind,
                    "pairs": args.pairs,
                    "warmup": args.warmup,
                    "peer": not args.no_peer,
                    "p2p": args.p2p,
                    "peer_grads": args.peer_grads,
                    "peer_onednn": args.peer_onednn,
                    "batch_weights_extra": args.batch_weights_extra,
                }
                pool = pools.get(ranks)
                program = C.program_for(sched, ranks=ranks, microbatches=size.microbatches)
                if args.floor_reps > 0 and ranks <= (os.cpu_count() or 1):
                    # (with more ranks than cores the simulator's one-core-per-rank is wrong)
                    spans = floor(pool, program, size, args)
                    row["floor_ms"], row["raw_floor_ms"], row["staged_floor_ms"] = (
                        t * 1e3 for t in spans
                    )
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
                row["grad_diff"] = (
                    max((r.get("grad_diff", 0.0) for r in results), default=None)
                    if "peer" not in errors and spec.peer
                    else None
                )
                row["grad_ref"] = (
                    max((r.get("grad_ref", 0.0) for r in results), default=None)
                    if "funcpipe" not in errors
                    else None
                )
                row["peer_ref"] = (
                    max((r.get("peer_ref", 0.0) for r in results), default=None)
                    if "peer" not in errors and spec.peer
                    else None
                )
                if "funcpipe" in results[0]:
                    fp_t = C.step_times([r["funcpipe"] for r in results])
                    row["funcpipe_ms"] = C.median(fp_t) * 1e3
                    row["funcpipe_times"] = fp_t
                    if results[0]["peer"]:
                        peer_t = C.step_times([r["peer"] for r in results])
                        ratios = C.paired_ratios(fp_t, peer_t)
                        row["peer_ms"] = C.median(peer_t) * 1e3
                        row["peer_times"] = peer_t
                        row["ratio"] = C.median(ratios)
                        row["ratio_iqr"] = C.spread(ratios)
                        for k in ("floor", "raw_floor", "staged_floor"):
                            if row.get(f"{k}_ms"):
                                row[f"{k}_ratio"] = row[f"{k}_ms"] / row["peer_ms"]
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
    ap.add_argument("--sizes", nargs="+", default=["small", "large"], choices=sorted(C.SIZES))
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    ap.add_argument(
        "--schedules", nargs="+", default=list(C.PEER_SCHEDULES), choices=list(C.PEER_SCHEDULES)
    )
    ap.add_argument("--pairs", type=int, default=20, help="timed A B pairs per cell")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    ap.add_argument("--width", type=int, default=None, help="override the size's width")
    ap.add_argument("--batch", type=int, default=None, help="override the size's batch")
    ap.add_argument(
        "--layers", type=int, default=None, help="override the number of Linear+GELU layers"
    )
    ap.add_argument("--microbatches", type=int, default=None, help="override the 8 microbatches")
    ap.add_argument(
        "--stage-kind",
        default="module",
        choices=["module", "function"],
        help="funcpipe stages from nn.Module slices (functional_call) or plain functions",
    )
    ap.add_argument("--no-peer", action="store_true", help="time funcpipe only")
    ap.add_argument(
        "--floor-reps",
        type=int,
        default=10,
        help="repetitions per stage cost for the compute-only floor (0: skip it)",
    )
    ap.add_argument(
        "--p2p",
        default="auto",
        choices=["auto", "torch"],
        help="funcpipe's messages: same-host sockets (auto, its default) or gloo send/recv (torch)",
    )
    ap.add_argument(
        "--peer-grads",
        default="none",
        choices=["none", "zeros"],
        help="between the peer's steps: zero_grad(set_to_none=True), torch's default (none: "
        "every step allocates new gradients), or set_to_none=False (zeros: they are reused)",
    )
    ap.add_argument(
        "--peer-onednn",
        default="on",
        choices=["on", "off"],
        help="off: the peer's timed steps run with oneDNN switched off process-wide "
        "(torch.backends.mkldnn.flags(enabled=False)), as a user could run it: its small "
        "GELUs then take ATen's kernel, the one funcpipe's chain stages pick (default on: "
        "PyTorch's default)",
    )
    ap.add_argument(
        "--batch-weights-extra",
        type=int,
        default=0,
        help="funcpipe's Pipeline(batch_weights_extra=N): activations above the program's peak "
        "a rank may keep to sum weight gradients over several microbatches (default 0)",
    )
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
