"""One layout's predicted step: time, FLOP rates and memory per GPU, with the breakdown."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from funcpipe.errors import InvalidArgument
from funcpipe.planner import comm
from funcpipe.planner.blocks import Block, Kind, block_table, stage_kinds
from funcpipe.planner.calibration import DEFAULT, Calibration
from funcpipe.planner.cluster import Cluster
from funcpipe.planner.compute import FP8_CAST_BYTES, head_costs
from funcpipe.planner.layout import MAX_STAGES, ClusterLayout, check_gpus
from funcpipe.planner.model import Transformer
from funcpipe.planner.pipeline import (
    activation_floor,
    closed_form,
    in_flight,
    pipeline_bound,
    placement,
    simulable,
    simulated,
)

__all__ = [
    "GRADIENT_BYTES",
    "Estimate",
    "check_layout",
    "data_parallel_seconds",
    "estimate",
    "gradient_bytes",
    "optimizer_bytes_per_param",
]

GiB = 2**30


@dataclass(frozen=True)
class Estimate:
    """A predicted training step. Times in seconds, memory in bytes (``*_gib`` in GiB)."""

    layout: ClusterLayout
    step_time_s: float
    mfu: float
    hardware_tflops_per_gpu: float
    model_tflops_per_gpu: float
    memory_bytes_per_gpu: float
    fits: bool
    microbatches: int
    breakdown: dict[str, float] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)
    simulated: bool = False
    bound_s: float = 0.0
    """A lower bound of this layout's simulated step time (:func:`pipeline_bound` for the
    pipeline part, the rest as priced here): what the search prunes by. Not in the JSON."""
    memory_floor_bytes: float = 0.0
    """A lower bound of this layout's simulated memory per GPU (:func:`activation_floor` for
    the activations, the rest as here; the memory itself when simulated, or where nothing is
    simulated: one pipeline rank): what the search drops layouts by before pricing them. Not
    in the JSON."""
    tokens_per_step: int = 0
    """Tokens a step trains on: global batch x sequence."""

    @property
    def memory_gib_per_gpu(self) -> float:
        return self.memory_bytes_per_gpu / GiB

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Training throughput per GPU, as Megatron-Bridge's tables quote it."""
        return self.tokens_per_step / self.step_time_s / self.layout.gpus

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU (the published count: ``Transformer.model_flops_per_token``),
        what Megatron-Bridge's tables call "Model TFLOP / sec / GPU"; ``model_tflops_per_gpu``."""
        return self.model_tflops_per_gpu

    def as_dict(self) -> dict[str, object]:
        """The JSON the CLI prints."""
        return {
            "step_time_s": self.step_time_s,
            "mfu": self.mfu,
            "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "memory_gib_per_gpu": self.memory_gib_per_gpu,
            "fits": self.fits,
            "microbatches": self.microbatches,
            "simulated": self.simulated,
            "layout": self.layout.as_dict(),
            "breakdown_s": dict(self.breakdown),
            "memory_gib": {k: v / GiB for k, v in self.memory.items()},
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tflops_per_gpu": self.tflops_per_gpu,
        }


GRADIENT_BYTES = 4
"""Bytes per parameter of the gradients a step accumulates: float32 (main gradients of narrow
parameters, or the float32 parameters' own). Whole on every data-parallel copy until the step's
reduction with ``zero`` 0 and 1 (ZeRO-1 shards what is kept after it, not the sum during the
step); with ``zero`` 2 a 1/d shard of the sums, plus one chunk's whole gradient of one
microbatch until its reduce-scatter (:func:`gradient_bytes`)."""


def gradient_bytes(zero: int, data: int, rank_params: float, chunk_params: float) -> float:
    """Gradient bytes a rank holds during a step: its ``rank_params`` parameters' float32 sums,
    whole (``zero`` 0, 1) or 1/``data`` of them plus one microbatch's whole gradient of its
    largest chunk (``chunk_params``), which lives until its reduce-scatter (``zero`` 2)."""
    if zero < 2:
        return rank_params * GRADIENT_BYTES
    return (rank_params / data + chunk_params) * GRADIENT_BYTES


def data_parallel_seconds(
    zero: int,
    m: int,
    gradient: float,
    stage_gradients: Sequence[float],
    gather: float,
    compute: float,
    window: float,
    buckets: int,
    overlap: bool,
) -> tuple[float, float]:
    """(exposed, total) seconds of a rank's data-parallel gradient reduction (and parameter
    gather). ``gradient``: an all-reduce (``zero`` 0) or reduce-scatter (1) of the rank's
    gradients, once a step; ``stage_gradients``: a reduce-scatter of each of its stages',
    once per microbatch (2); ``gather``: the all-gather of its parameters (1, 2); ``compute``:
    its seconds of F + I + W per microbatch; ``window``: the last microbatch's backward.

    Overlapped (``overlap``), the step's last reduction sticks out of ``window`` (at least one
    of ``buckets``); ``zero`` 2's ``m - 1`` earlier ones run under the following microbatches'
    compute, and only what a microbatch's reduce-scatters take beyond its compute adds up. Not
    overlapped, everything runs after the pipeline drains. The gather is never hidden."""
    last = sum(stage_gradients) if zero == 2 else gradient
    total = (m if zero == 2 else 1) * last + gather
    if not overlap:
        return total, total
    exposed = max(last / buckets, last - window) + gather
    if zero == 2:
        exposed += (m - 1) * max(0.0, last - compute)
    return exposed, total


def optimizer_bytes_per_param(dtype: str) -> int:
    """AdamW's bytes per parameter: the float32 moments ``m`` and ``v`` (8), plus a float32
    master copy (4) for parameters narrower than float32 (``bf16``, ``fp16``:
    ``adamw(master_weights=True)``). float32 parameters are updated in place of a master: 8."""
    return 8 if dtype == "fp32" else 12


def check_layout(model: Transformer, layout: ClusterLayout, gpus: int, global_batch: int) -> int:
    """Raise InvalidArgument unless ``layout`` fits the model and batch; return microbatches."""
    t, p, d, b, v = (
        layout.tensor,
        layout.pipeline,
        layout.data,
        layout.microbatch,
        layout.interleave,
    )
    if layout.gpus != gpus:
        raise InvalidArgument(
            f"layout {layout.short()}: tensor x pipeline x data = {layout.gpus} but gpus={gpus}; "
            "the three must multiply to the GPU count"
        )
    check_gpus(gpus, "estimate")
    if p * v > MAX_STAGES:
        raise InvalidArgument(
            f"layout pipeline={p}, interleave={v}: {p * v:,} stages, but the planner models at "
            f"most {MAX_STAGES:,} pipeline stages (pipeline x interleave; the longest pipelines "
            "in use have about a hundred); use a smaller pipeline or interleave"
        )
    if model.heads % t or model.kv % t:
        raise InvalidArgument(
            f"layout tensor={t}: heads={model.heads} and kv_heads={model.kv} must be multiples "
            "of tensor"
        )
    _check_experts(model, layout)
    if layout.stage_layers is not None:
        if sum(layout.stage_layers) != model.layers:
            raise InvalidArgument(
                f"layout stage_layers={list(layout.stage_layers)}: they add up to "
                f"{sum(layout.stage_layers)} blocks but the model has layers={model.layers}"
            )
    elif model.layers % (p * v):
        raise InvalidArgument(
            f"layout pipeline={p}, interleave={v}: layers={model.layers} must split evenly into "
            f"pipeline x interleave = {p * v} stages"
        )
    if global_batch % (d * b):
        raise InvalidArgument(
            f"global_batch={global_batch} is not a multiple of data x microbatch = {d * b}; "
            "pick a microbatch (and data) that divide it"
        )
    return global_batch // (d * b)


def _check_experts(model: Transformer, layout: ClusterLayout) -> None:
    """Refuse an expert axis the model cannot use: a dense model's, or one that does not divide
    the experts."""
    ep = layout.expert
    if ep > 1 and not model.experts:
        raise InvalidArgument(
            f"layout expert={ep}: the model has no experts (experts=0, a dense model); pass "
            "expert=1, or give the Transformer experts="
        )
    if model.experts % ep:
        raise InvalidArgument(
            f"layout expert={ep}: experts={model.experts} must split evenly over the expert "
            f"axis (each rank holds experts / expert of them); pick an expert size that "
            f"divides {model.experts}"
        )
    if layout.moe_tensor == "tokens":
        spread = ep * layout.tensor
        if not model.experts or model.experts % spread:
            raise InvalidArgument(
                f"layout moe_tensor='tokens' (expert {ep} x tensor {layout.tensor}): the "
                f"experts spread over the {spread} expert x tensor ranks, and "
                f"experts={model.experts} does not split over them; give a mixture of experts "
                f"with a multiple of {spread} experts, or moe_tensor='width'"
            )


def estimate(
    model: Transformer,
    cluster: Cluster,
    layout: ClusterLayout,
    *,
    global_batch: int,
    calibration: Calibration = DEFAULT,
    simulate: bool = False,
    overlap_grad_reduce: bool = True,
    memory_limit: float | None = None,
) -> Estimate:
    """Predict one training step of ``model`` on ``cluster`` laid out as ``layout``.

    ``simulate=True`` runs the schedule's program through :func:`funcpipe.schedule.simulate`
    (uneven stages priced one by one) instead of the closed form. ``overlap_grad_reduce``:
    the data-parallel gradient reduction runs bucket by bucket under the last microbatch's
    backward (only what sticks out of it counts); ``False`` runs it after the pipeline drains
    (Megatron-LM 2021). ``memory_limit`` bytes (default: the GPU's memory) decides ``fits``.
    """
    cal = calibration
    m = check_layout(model, layout, layout.gpus, global_batch)
    if model.fp8 and "fp8" not in cluster.gpu.flops:
        raise InvalidArgument(
            f"Transformer(fp8=True) on {cluster.gpu.name}: this GPU has no FP8 peak (no FP8 "
            "tensor cores, or none given); use an H100 or H200 preset, add flops['fp8'] to "
            "the GPU, or pass fp8=False"
        )
    t, p, d, v = layout.tensor, layout.pipeline, layout.data, layout.interleave
    nb = model.bytes
    table = block_table(model, layout, cluster, cal)
    stages = p * v
    counts = layout.stage_layers or (model.layers // stages,) * stages  # blocks per stage
    kinds = stage_kinds(model, counts)
    f, i, w, act, msg, act_bytes = _stage_costs(model, cluster, layout, kinds, table, cal)
    place = placement(layout.schedule, p, v)
    rank_f, rank_i, rank_w = _per_rank(place, f), _per_rank(place, i), _per_rank(place, w)
    rank_layers = [0] * p
    rank_kinds: list[dict[Kind, int]] = [{} for _ in range(p)]  # blocks of each kind per rank
    for s, r in enumerate(place):
        rank_layers[r] += counts[s]
        for k, n in kinds[s]:
            rank_kinds[r][k] = rank_kinds[r].get(k, 0) + n
    rank_comm = [[(n, table[k]) for k, n in rk.items()] for rk in rank_kinds]
    rank_tp = [sum(n * (b.tp_f + b.tp_i) for n, b in rc) for rc in rank_comm]
    rank_a2a = [sum(n * (b.a2a_f + b.a2a_i) for n, b in rc) for rc in rank_comm]
    compute = [rank_f[r] + rank_i[r] + rank_w[r] for r in range(p)]
    worst = max(range(p), key=lambda r: compute[r])
    bf, bi, bw_ = rank_f[worst], rank_i[worst], rank_w[worst]
    a2a = _all_to_alls(kinds, table) if layout.overlap else None
    pipe, peaks, bound, floor = _pipeline(
        layout, m, (f, i, w), act, a2a, (bf, bi, bw_), simulate and p > 1
    )
    held = _parameters(model, layout, kinds, table, place)
    totals_p = [held.dense[r] + held.expert[r] for r in range(p)]
    top = max(range(p), key=lambda r: totals_p[r])  # the rank holding the most parameters
    zero, de = layout.zero, d // layout.expert  # de: the copies of each expert
    backward = (bi + bw_, max(rank_layers[worst], 1))  # the last microbatch's, and buckets
    dp_exposed, dp_total = _data_parallel(
        layout, m, nb, held, place, compute, backward, cluster, overlap_grad_reduce, top
    )
    emb = 0.0
    if p > 1 and model.tied:
        emb = comm.all_reduce(model.vocab * model.hidden / t * nb, 2, cluster.inter)
    opt_params = held.dense[top] / (d if zero else 1) + held.expert[top] / (de if zero else 1)
    optimizer = opt_params * 30 / (cluster.gpu.bandwidth * cal.elementwise)
    cast = 0.0  # FP8: the weights quantized once a step (the first microbatch), every rank
    if model.fp8:
        cast = totals_p[top] * FP8_CAST_BYTES / (cluster.gpu.bandwidth * cal.elementwise)
    step = pipe + dp_exposed + emb + optimizer + cast
    model_flops, hw_flops = _flops(model, layout, global_batch)
    n_gpus = layout.gpus
    mfu = model_flops / (step * n_gpus * cluster.gpu.peak(model.dtype))
    # memory of the fullest rank, and a floor of the simulated one
    parts = _memory(model, layout, held, place, peaks, table, act_bytes, cal)
    totals = [sum(part.values()) for part in parts]
    full = max(range(p), key=lambda r: totals[r])
    floor_bytes = max(totals[r] - peaks[r] + floor[r] for r in range(p))
    full_bytes = totals[full]
    limit = cluster.gpu.memory if memory_limit is None else memory_limit
    return Estimate(
        layout=layout,
        step_time_s=step,
        mfu=mfu,
        hardware_tflops_per_gpu=hw_flops / step / n_gpus / 1e12,
        model_tflops_per_gpu=model_flops / step / n_gpus / 1e12,
        memory_bytes_per_gpu=full_bytes,
        fits=full_bytes <= limit,
        microbatches=m,
        breakdown={
            "pipeline": pipe,
            "compute_per_microbatch": bf + bi + bw_,
            "tensor_comm_per_microbatch": max(rank_tp, default=0.0),
            "p2p_per_microbatch": 2 * v * msg,
            "data_parallel_exposed": dp_exposed,
            "data_parallel_total": dp_total,
            "embedding_sync": emb,
            "optimizer": optimizer,
            "expert_all_to_all_per_microbatch": max(rank_a2a, default=0.0),
            "fp8_weight_cast": cast,
        },
        memory=parts[full],
        simulated=simulate and p > 1,
        bound_s=bound + dp_exposed + emb + optimizer + cast,
        memory_floor_bytes=floor_bytes,
        tokens_per_step=global_batch * model.seq,
    )


def _all_to_alls(
    kinds: Sequence[tuple[tuple[Kind, int], ...]], table: dict[Kind, Block]
) -> tuple[list[float], list[float]]:
    """Per stage, the expert all-to-all seconds inside its F and inside its I."""
    f = [sum((n * table[k].a2a_f for k, n in ks), 0.0) for ks in kinds]
    i = [sum((n * table[k].a2a_i for k, n in ks), 0.0) for ks in kinds]
    return f, i


def _pipeline(
    layout: ClusterLayout,
    m: int,
    fiw: tuple[list[float], list[float], list[float]],
    act: list[float],
    comm: tuple[list[float], list[float]] | None,
    worst: tuple[float, float, float],
    simulate: bool,
) -> tuple[float, tuple[float, ...], float, tuple[float, ...]]:
    """(seconds, peak activation bytes per rank, a lower bound of the simulated seconds, a lower
    bound of the simulated peaks) of the pipeline part of a step: simulated, or the closed form
    of the busiest rank's ``worst`` F, I, W. Per stage ``fiw``: F, I, W with all their
    communication; ``comm``: the all-to-alls in F and I of an overlapped layout, which the
    simulator takes apart for its pairs to hide (the closed form gives the overlap no credit:
    :mod:`funcpipe.planner.pipeline`)."""
    sched, p, v = layout.schedule, layout.pipeline, layout.interleave
    f, i, w = fiw
    place = placement(sched, p, v)
    apart: dict[str, list[float]] = {}
    if comm is not None:  # compute alone in f and i; the all-to-alls beside them
        f = [x - y for x, y in zip(f, comm[0], strict=True)]
        i = [x - y for x, y in zip(i, comm[1], strict=True)]
        apart = {"f_comm": comm[0], "i_comm": comm[1]}
    if simulate:
        pipe, peaks = simulated(sched, p, m, v, f, i, w, act, **apart)
        return pipe, peaks, pipe, peaks
    pipe = closed_form(sched, p, m, v, *worst)
    chunk_act = [0.0] * p  # the largest chunk's activations per rank
    for s, r in enumerate(place):
        chunk_act[r] = max(chunk_act[r], act[s])
    peaks = tuple(max(in_flight(sched, p, m, v, r) * chunk_act[r], 0.0) for r in range(p))
    if p == 1:
        return pipe, peaks, pipe, peaks
    bound = pipeline_bound(sched, place, m, f, i, w, apart.get("f_comm"), apart.get("i_comm"))
    # the program's peaks where it is small enough to read; else one chunk alive
    small = simulable(p, m, v)
    floor = activation_floor(sched, p, m, v, act) if small else tuple(chunk_act)
    return pipe, peaks, bound, floor


def _per_rank(place: Sequence[int], per_stage: Sequence[float]) -> list[float]:
    """Per rank, the sum of its stages' values (in stage order)."""
    out = [0.0] * (max(place) + 1)
    for s, r in enumerate(place):
        out[r] += per_stage[s]
    return out


@dataclass(frozen=True)
class _Held:
    """Parameters per stage and per rank, dense (over ``tensor``) and expert (over ``tensor x
    expert``)."""

    stage_dense: list[float]
    dense: list[float]
    stage_expert: list[float]
    expert: list[float]


def _parameters(
    model: Transformer,
    layout: ClusterLayout,
    kinds: Sequence[tuple[tuple[Kind, int], ...]],
    table: dict[Kind, Block],
    place: Sequence[int],
) -> _Held:
    """Parameters per stage and per rank: blocks, the embedding on the first stage, the output
    layer and final norm on the last (a tied output layer on the embedding's rank is that one
    copy); experts split over ``tensor x expert``, the rest over ``tensor``."""
    t = layout.tensor
    emb = model.vocab * model.hidden / t
    stage_dense = [sum(n * table[k].dense for k, n in ks) / t for ks in kinds]
    split = t * layout.expert
    stage_expert = [sum(n * table[k].expert for k, n in ks) / split for ks in kinds]
    stage_dense[0] += emb
    stage_dense[-1] += emb + 2 * model.hidden
    one = len(stage_dense) == 1
    if model.tied and one:  # one stage holds the one table (it was counted as two)
        stage_dense[0] -= emb
    ranks = max(place) + 1
    dense, expert = [0.0] * ranks, [0.0] * ranks
    for s, r in enumerate(place):
        dense[r] += stage_dense[s]
        expert[r] += stage_expert[s]
    if model.tied and place[-1] == place[0] and not one:
        dense[place[0]] -= emb
    return _Held(stage_dense, dense, stage_expert, expert)


def _memory(
    model: Transformer,
    layout: ClusterLayout,
    held: _Held,
    place: Sequence[int],
    peaks: Sequence[float],
    table: dict[Kind, Block],
    act_bytes: float,
    cal: Calibration,
) -> list[dict[str, float]]:
    """Bytes per rank by kind: weights, gradients (:func:`gradient_bytes`: the dense ones over
    ``data``, the experts over the ``data / expert`` copies of each), optimizer state (sharded
    over the same groups with ZeRO), activations (the schedule's peak plus a recomputed block's
    working set), point-to-point buffers and workspace."""
    p, d, zero, nb = layout.pipeline, layout.data, layout.zero, model.bytes
    de = d // layout.expert
    chunk, echunk = [0.0] * p, [0.0] * p  # the largest chunk's parameters per rank (zero 2)
    for s, r in enumerate(place):
        chunk[r] = max(chunk[r], held.stage_dense[s])
        echunk[r] = max(echunk[r], held.stage_expert[s])
    per_param = optimizer_bytes_per_param(model.dtype)
    opt_bytes, eopt_bytes = per_param / (d if zero else 1), per_param / (de if zero else 1)
    working = max(b.costs.working for b in table.values())
    return [
        {
            "parameters": (held.dense[r] + held.expert[r]) * nb,
            "gradients": gradient_bytes(zero, d, held.dense[r], chunk[r])
            + gradient_bytes(zero, de, held.expert[r], echunk[r]),
            "optimizer": held.dense[r] * opt_bytes + held.expert[r] * eopt_bytes,
            "activations": peaks[r] + working,
            "buffers": 4 * act_bytes / layout.tensor + cal.workspace_bytes,
        }
        for r in range(p)
    ]


def _data_parallel(
    layout: ClusterLayout,
    m: int,
    nb: int,
    held: _Held,
    place: Sequence[int],
    compute: Sequence[float],
    backward: tuple[float, int],
    cluster: Cluster,
    overlap: bool,
    top: int,
) -> tuple[float, float]:
    """(exposed, total) seconds of the data-parallel reduction and ZeRO's parameter gather:
    the fullest rank's (``top``; :func:`data_parallel_seconds`), or with ``zero`` 2 the most of
    any rank's (its per-microbatch reduce-scatters weigh against its own compute). The dense
    gradients are reduced over the ``data`` copies, the experts' over the ``data / expert``
    copies of each (``tensor x expert`` ranks apart); the two add up. ``backward``: the busiest
    rank's last backward and its buckets (blocks)."""
    d, zero, ep, t = layout.data, layout.zero, layout.expert, layout.tensor
    groups = [(d, cluster.link(stride=t, size=d), held.dense, held.stage_dense)]
    if any(held.expert):
        groups.append(
            (d // ep, cluster.link(stride=t * ep, size=d // ep), held.expert, held.stage_expert)
        )
    window, buckets = backward
    gather = (
        sum(comm.all_gather(max(ps) * nb, n, link) for n, link, ps, _ in groups) if zero else 0.0
    )
    once = comm.reduce_scatter if zero else comm.all_reduce
    exposed = total = 0.0
    for r in range(len(held.dense)) if zero == 2 else (top,):
        mine = [
            sum(comm.reduce_scatter(sp[s] * nb, n, link) for n, link, _, sp in groups)
            for s, q in enumerate(place)
            if q == r
        ]
        e, a = data_parallel_seconds(
            zero,
            m,
            sum(once(ps[r] * nb, n, link) for n, link, ps, _ in groups),
            mine,
            gather,
            compute[r],
            window,
            buckets,
            overlap,
        )
        exposed, total = max(exposed, e), max(total, a)
    return exposed, total


def _flops(model: Transformer, layout: ClusterLayout, global_batch: int) -> tuple[float, float]:
    """(model, hardware) FLOPs of a step: the hardware's adds what recompute repeats (and for a
    mixture of experts counts what runs: :meth:`Transformer.forward_flops_per_token`)."""
    all_tokens = global_batch * model.seq
    model_flops = model.model_flops_per_token() * all_tokens
    if model.experts:
        fwd = [model.forward_flops_per_token(n) for n in range(model.layers)]
        head = 2.0 * model.hidden * model.vocab
        again = sum(fwd) if layout.recompute == "full" else 0.0
        if layout.recompute == "selective" and not model.flash:  # the scores, recomputed
            again = 4.0 * model.q_size * model.seq * model.layers
        return model_flops, (3 * (sum(fwd) + head) + again) * all_tokens
    h, q, kvd = model.hidden, model.q_size, model.kv_size
    fwd_block = 2 * (2 * h * q + 2 * h * kvd + model.matrices * h * model.ff) + 4 * q * model.seq
    selective = 0.0 if model.flash else 4.0 * q * model.seq  # the scores, recomputed
    recompute = {"none": 0.0, "selective": selective, "full": float(fwd_block)}
    return model_flops, model_flops + recompute[layout.recompute] * model.layers * all_tokens


def _stage_costs(
    model: Transformer,
    cluster: Cluster,
    layout: ClusterLayout,
    kinds: Sequence[tuple[tuple[Kind, int], ...]],
    table: dict[Kind, Block],
    cal: Calibration,
) -> tuple[list[float], list[float], list[float], list[float], float, float]:
    """Per stage F, I, W seconds and activation bytes of a microbatch, with the tensor-parallel
    collectives, the expert all-to-alls and the point-to-point messages in them; then a
    message's seconds and a microbatch's activation bytes at a block boundary."""
    t, p, d = layout.tensor, layout.pipeline, layout.data
    head = head_costs(model, layout, cluster, cal)
    nb = model.bytes
    tokens = layout.microbatch * model.seq
    tlink = cluster.link(stride=1, size=t)
    act_bytes = tokens * model.hidden * nb
    # point-to-point: one activation per F, one gradient per I; scatter/gather over tensor
    plink = cluster.link(stride=t * d, size=p)
    msg = comm.p2p(act_bytes / t, plink) if p > 1 else 0.0
    f = [sum((n * table[k].f for k, n in ks), 0.0) + msg for ks in kinds]
    i = [sum((n * table[k].i for k, n in ks), 0.0) + msg for ks in kinds]
    w = [sum((n * table[k].costs.w for k, n in ks), 0.0) for ks in kinds]
    act = [sum((n * table[k].costs.activation for k, n in ks), 0.0) for ks in kinds]
    f[-1] += head.f + comm.all_reduce(act_bytes, t, tlink)
    i[-1] += head.i + comm.all_reduce(act_bytes, t, tlink)
    w[-1] += head.w
    act[-1] += head.activation
    return f, i, w, act, msg, act_bytes
