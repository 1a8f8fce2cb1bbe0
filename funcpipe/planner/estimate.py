"""One layout's predicted step: time, FLOP rates and memory per GPU, with the breakdown."""

from __future__ import annotations

from dataclasses import dataclass, field

from funcpipe.errors import InvalidArgument
from funcpipe.planner import comm
from funcpipe.planner.calibration import DEFAULT, Calibration
from funcpipe.planner.cluster import Cluster
from funcpipe.planner.compute import head_costs, layer_costs
from funcpipe.planner.layout import MAX_STAGES, ClusterLayout, check_gpus
from funcpipe.planner.model import Transformer
from funcpipe.planner.pipeline import (
    closed_form,
    in_flight,
    pipeline_bound,
    placement,
    simulated,
)

__all__ = [
    "GRADIENT_BYTES",
    "Estimate",
    "check_layout",
    "estimate",
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
reduction, sharded or not (ZeRO-1 shards what is kept after it, not the sum during the step)."""


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
    tokens = layout.microbatch * model.seq
    lay = layer_costs(model, layout, cluster, cal)
    head = head_costs(model, layout, cluster, cal)
    stages = p * v
    counts = layout.stage_layers or (model.layers // stages,) * stages  # blocks per stage
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
    place = placement(layout.schedule, p, v)
    rank_f, rank_i, rank_w = [0.0] * p, [0.0] * p, [0.0] * p
    rank_layers = [0] * p
    for s, r in enumerate(place):
        rank_layers[r] += counts[s]
        rank_f[r] += f[s]
        rank_i[r] += i[s]
        rank_w[r] += w[s]
    worst = max(range(p), key=lambda r: rank_f[r] + rank_i[r] + rank_w[r])
    bf, bi, bw_ = rank_f[worst], rank_i[worst], rank_w[worst]
    if simulate and p > 1:
        pipe, peaks = simulated(layout.schedule, p, m, v, f, i, w, act)
        bound = pipe
    else:
        pipe = closed_form(layout.schedule, p, m, v, bf, bi, bw_)
        chunk_act = [0.0] * p  # the largest chunk's activations per rank
        for s, r in enumerate(place):
            chunk_act[r] = max(chunk_act[r], act[s])
        peaks = tuple(
            max(in_flight(layout.schedule, p, m, v, r) * chunk_act[r], 0.0) for r in range(p)
        )
        bound = pipeline_bound(layout.schedule, place, m, f, i, w) if p > 1 else pipe
    # parameters per rank: blocks, the embedding on the first stage, the output layer on the last
    block = model.layer_params() / t
    params = [0.0] * p
    for s, r in enumerate(place):
        params[r] += counts[s] * block
    params[place[0]] += model.vocab * model.hidden / t
    if not model.tied or place[-1] != place[0]:  # the output layer (a tied copy on another rank)
        params[place[-1]] += model.vocab * model.hidden / t
    params[place[-1]] += 2 * model.hidden
    # data-parallel gradient reduction (and ZeRO-1's parameter gather), the tied embedding
    dlink = cluster.link(stride=t, size=d)
    top = max(params)
    grads = comm.all_reduce(top * nb, d, dlink)
    # ZeRO-1: a reduce-scatter under the backward, an all-gather of the parameters after the step
    gather = comm.all_gather(top * nb, d, dlink) if layout.zero1 else 0.0
    under = grads - gather
    if overlap_grad_reduce:
        window = bi + bw_  # the last microbatch's backward on this rank
        buckets = max(rank_layers[worst], 1)
        dp_exposed = max(under / buckets, under - window) + gather
    else:
        dp_exposed = grads
    emb = 0.0
    if p > 1 and model.tied:
        emb = comm.all_reduce(model.vocab * model.hidden / t * nb, 2, cluster.inter)
    opt_params = top / (d if layout.zero1 else 1)
    optimizer = opt_params * 30 / (cluster.gpu.bandwidth * cal.elementwise)
    step = pipe + dp_exposed + emb + optimizer
    # FLOPs
    n_gpus = layout.gpus
    all_tokens = global_batch * model.seq
    model_flops = model.model_flops_per_token() * all_tokens
    h, kvd = model.hidden, model.kv * model.head_dim
    fwd_block = 2 * (2 * h * h + 2 * h * kvd + 2 * h * model.ff) + 4 * h * model.seq
    selective = 0.0 if model.flash else 4.0 * h * model.seq  # the scores, recomputed
    recompute = {"none": 0.0, "selective": selective, "full": float(fwd_block)}
    hw_flops = model_flops + recompute[layout.recompute] * model.layers * all_tokens
    peak = cluster.gpu.peak(model.dtype)
    mfu = model_flops / (step * n_gpus * peak)
    # memory of the fullest rank
    opt_bytes = optimizer_bytes_per_param(model.dtype) / (d if layout.zero1 else 1)
    mem_rank = []
    for r in range(p):
        weights = params[r] * nb
        grads_b = params[r] * GRADIENT_BYTES  # float32 gradients, whole during the step
        optim = params[r] * opt_bytes
        acts = peaks[r] + lay.working
        buffers = 4 * act_bytes / t + cal.workspace_bytes
        total = weights + grads_b + optim + acts + buffers
        mem_rank.append((total, weights, grads_b, optim, acts, buffers))
    full = max(mem_rank)
    limit = cluster.gpu.memory if memory_limit is None else memory_limit
    return Estimate(
        layout=layout,
        step_time_s=step,
        mfu=mfu,
        hardware_tflops_per_gpu=hw_flops / step / n_gpus / 1e12,
        model_tflops_per_gpu=model_flops / step / n_gpus / 1e12,
        memory_bytes_per_gpu=full[0],
        fits=full[0] <= limit,
        microbatches=m,
        breakdown={
            "pipeline": pipe,
            "compute_per_microbatch": bf + bi + bw_,
            "tensor_comm_per_microbatch": max(rank_layers) * (tp_f + tp_i),
            "p2p_per_microbatch": 2 * v * msg,
            "data_parallel_exposed": dp_exposed,
            "data_parallel_total": grads,
            "embedding_sync": emb,
            "optimizer": optimizer,
        },
        memory={
            "parameters": full[1],
            "gradients": full[2],
            "optimizer": full[3],
            "activations": full[4],
            "buffers": full[5],
        },
        simulated=simulate and p > 1,
        bound_s=bound + dp_exposed + emb + optimizer,
    )
