"""One layout's predicted step: time, FLOP rates and memory per GPU, with the breakdown."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from funcpipe.errors import InvalidArgument
from funcpipe.planner import comm
from funcpipe.planner.calibration import DEFAULT, Calibration
from funcpipe.planner.cluster import Cluster
from funcpipe.planner.compute import OpCosts, head_costs, layer_costs
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

    @property
    def memory_gib_per_gpu(self) -> float:
        return self.memory_bytes_per_gpu / GiB

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
    t, p, d, v = layout.tensor, layout.pipeline, layout.data, layout.interleave
    nb = model.bytes
    lay = layer_costs(model, layout, cluster, cal)
    stages = p * v
    counts = layout.stage_layers or (model.layers // stages,) * stages  # blocks per stage
    f, i, w, act, tp, msg, act_bytes = _stage_costs(model, cluster, layout, counts, lay, cal)
    place = placement(layout.schedule, p, v)
    rank_f, rank_i, rank_w = [0.0] * p, [0.0] * p, [0.0] * p
    rank_layers = [0] * p
    for s, r in enumerate(place):
        rank_layers[r] += counts[s]
        rank_f[r] += f[s]
        rank_i[r] += i[s]
        rank_w[r] += w[s]
    compute = [rank_f[r] + rank_i[r] + rank_w[r] for r in range(p)]
    worst = max(range(p), key=lambda r: compute[r])
    bf, bi, bw_ = rank_f[worst], rank_i[worst], rank_w[worst]
    if simulate and p > 1:
        pipe, peaks = simulated(layout.schedule, p, m, v, f, i, w, act)
        bound, floor = pipe, peaks
    else:
        pipe = closed_form(layout.schedule, p, m, v, bf, bi, bw_)
        chunk_act = [0.0] * p  # the largest chunk's activations per rank
        for s, r in enumerate(place):
            chunk_act[r] = max(chunk_act[r], act[s])
        peaks = tuple(
            max(in_flight(layout.schedule, p, m, v, r) * chunk_act[r], 0.0) for r in range(p)
        )
        bound = pipeline_bound(layout.schedule, place, m, f, i, w) if p > 1 else pipe
        floor = peaks
        if p > 1:  # the program's peaks where it is small enough to read; else one chunk alive
            small = simulable(p, m, v)
            floor = activation_floor(layout.schedule, p, m, v, act) if small else tuple(chunk_act)
    stage_params, params = _parameters(model, t, counts, place)
    zero, top = layout.zero, max(params)
    backward = (bi + bw_, max(rank_layers[worst], 1))  # the last microbatch's, and buckets
    dp_exposed, dp_total = _data_parallel(
        layout, m, nb, params, stage_params, place, compute, backward, cluster, overlap_grad_reduce
    )
    emb = 0.0
    if p > 1 and model.tied:
        emb = comm.all_reduce(model.vocab * model.hidden / t * nb, 2, cluster.inter)
    opt_params = top / (d if zero else 1)
    optimizer = opt_params * 30 / (cluster.gpu.bandwidth * cal.elementwise)
    step = pipe + dp_exposed + emb + optimizer
    model_flops, hw_flops = _flops(model, layout, global_batch)
    n_gpus = layout.gpus
    mfu = model_flops / (step * n_gpus * cluster.gpu.peak(model.dtype))
    # memory of the fullest rank, and a floor of the simulated one
    chunk = [0.0] * p  # the largest chunk's parameters per rank (zero 2's whole gradient)
    for s, r in enumerate(place):
        chunk[r] = max(chunk[r], stage_params[s])
    opt_bytes = optimizer_bytes_per_param(model.dtype) / (d if zero else 1)
    parts = [
        {
            "parameters": params[r] * nb,
            "gradients": gradient_bytes(zero, d, params[r], chunk[r]),
            "optimizer": params[r] * opt_bytes,
            "activations": peaks[r] + lay.working,
            "buffers": 4 * act_bytes / t + cal.workspace_bytes,
        }
        for r in range(p)
    ]
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
            "tensor_comm_per_microbatch": max(rank_layers) * tp,
            "p2p_per_microbatch": 2 * v * msg,
            "data_parallel_exposed": dp_exposed,
            "data_parallel_total": dp_total,
            "embedding_sync": emb,
            "optimizer": optimizer,
        },
        memory=parts[full],
        simulated=simulate and p > 1,
        bound_s=bound + dp_exposed + emb + optimizer,
        memory_floor_bytes=floor_bytes,
    )


def _parameters(
    model: Transformer, t: int, counts: Sequence[int], place: Sequence[int]
) -> tuple[list[float], list[float]]:
    """(per stage, per rank) parameters over ``t``: blocks, the embedding on the first stage,
    the output layer and final norm on the last (a tied output layer on the embedding's rank
    is that one copy)."""
    table = model.vocab * model.hidden / t
    stage_params = [n * model.layer_params() / t for n in counts]
    stage_params[0] += table
    stage_params[-1] += table + 2 * model.hidden
    one = len(stage_params) == 1
    if model.tied and one:  # one stage holds the one table (it was counted as two)
        stage_params[0] -= table
    params = [0.0] * (max(place) + 1)
    for s, r in enumerate(place):
        params[r] += stage_params[s]
    if model.tied and place[-1] == place[0] and not one:
        params[place[0]] -= table
    return stage_params, params


def _data_parallel(
    layout: ClusterLayout,
    m: int,
    nb: int,
    params: Sequence[float],
    stage_params: Sequence[float],
    place: Sequence[int],
    compute: Sequence[float],
    backward: tuple[float, int],
    cluster: Cluster,
    overlap: bool,
) -> tuple[float, float]:
    """(exposed, total) seconds of the data-parallel reduction and ZeRO's parameter gather:
    the fullest rank's (:func:`data_parallel_seconds`), or with ``zero`` 2 the most of any
    rank's (its per-microbatch reduce-scatters weigh against its own compute). ``backward``:
    the busiest rank's last backward and its buckets (blocks)."""
    d, zero = layout.data, layout.zero
    dlink = cluster.link(stride=layout.tensor, size=d)
    window, buckets = backward
    top = max(params)
    gather = comm.all_gather(top * nb, d, dlink) if zero else 0.0
    once = comm.reduce_scatter if zero else comm.all_reduce
    exposed = total = 0.0
    for r in range(len(params)) if zero == 2 else (params.index(top),):
        mine = [
            comm.reduce_scatter(x * nb, d, dlink)
            for x, q in zip(stage_params, place, strict=True)
            if q == r
        ]
        e, a = data_parallel_seconds(
            zero,
            m,
            once(params[r] * nb, d, dlink),
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
    """(model, hardware) FLOPs of a step: the hardware's adds what recompute repeats."""
    all_tokens = global_batch * model.seq
    model_flops = model.model_flops_per_token() * all_tokens
    h, kvd = model.hidden, model.kv * model.head_dim
    fwd_block = 2 * (2 * h * h + 2 * h * kvd + 2 * h * model.ff) + 4 * h * model.seq
    selective = 0.0 if model.flash else 4.0 * h * model.seq  # the scores, recomputed
    recompute = {"none": 0.0, "selective": selective, "full": float(fwd_block)}
    return model_flops, model_flops + recompute[layout.recompute] * model.layers * all_tokens


def _stage_costs(
    model: Transformer,
    cluster: Cluster,
    layout: ClusterLayout,
    counts: Sequence[int],
    lay: OpCosts,
    cal: Calibration,
) -> tuple[list[float], list[float], list[float], list[float], float, float, float]:
    """Per stage F, I, W seconds and activation bytes of a microbatch, with the tensor-parallel
    collectives and point-to-point messages in them; then a block's tensor-parallel seconds,
    a message's, and a microbatch's activation bytes at a block boundary."""
    t, p, d = layout.tensor, layout.pipeline, layout.data
    head = head_costs(model, layout, cluster, cal)
    nb = model.bytes
    tokens = layout.microbatch * model.seq
    # tensor-parallel collectives per block: 2 in F, 2 in I (+2 in a full recompute)
    tlink = cluster.link(stride=1, size=t)
    act_bytes = tokens * model.hidden * nb
    if layout.sequence_parallel:  # all-gather before, reduce-scatter after each block half
        tp_f = 2 * (comm.all_gather(act_bytes, t, tlink) + comm.reduce_scatter(act_bytes, t, tlink))
    else:  # one all-reduce after attention, one after the MLP
        tp_f = 2 * comm.all_reduce(act_bytes, t, tlink)
    tp_i = tp_f * (2 if layout.recompute == "full" else 1)
    # point-to-point: one activation per F, one gradient per I; scatter/gather over tensor
    plink = cluster.link(stride=t * d, size=p)
    msg = comm.p2p(act_bytes / t, plink) if p > 1 else 0.0
    f = [n * (lay.f + tp_f) + msg for n in counts]
    i = [n * (lay.i + tp_i) + msg for n in counts]
    w = [n * lay.w for n in counts]
    act = [n * lay.activation for n in counts]
    f[-1] += head.f + comm.all_reduce(act_bytes, t, tlink)
    i[-1] += head.i + comm.all_reduce(act_bytes, t, tlink)
    w[-1] += head.w
    act[-1] += head.activation
    return f, i, w, act, tp_f + tp_i, msg, act_bytes
