"""A mixture-of-experts block on one GPU: its router, experts and token dispatch, and the
all-to-alls of expert parallelism.

The block is priced as Megatron-Core's all-to-all dispatcher runs it (dropless, tokens balanced
over the experts as the published benchmarks force them):

- attention as in a dense block (:func:`funcpipe.planner.compute.attention_linear`,
  :func:`~funcpipe.planner.compute.attention_core`);
- the router, a ``hidden x experts`` product on the rank's tokens (not sharded over ``tensor``;
  with ``tensor > 1`` sequence parallelism gives each rank ``1/t`` of the tokens to route, as
  Megatron-Core requires of MoE under tensor parallelism), a softmax and top-k over its logits;
- dispatch: each token copied ``top_k`` times (permute), an all-to-all over the ``expert`` axis
  that sends each copy to its expert's rank (``(ep - 1) / ep`` of them leave the rank), with
  ``tensor > 1`` an all-gather over ``tensor`` (each expert's MLP is tensor-parallel like the
  dense one), and a sort of the received rows by local expert;
- the ``experts / ep`` local experts, each its own pair (or triple) of products on its
  ``top_k x tokens x ep / experts`` rows (a grouped GEMM launches one product per expert: each
  pays the calibrated per-product overhead), the activation between them;
- combine: the same in reverse (unsort, reduce-scatter over ``tensor``, all-to-all back, the
  ``top_k`` copies summed with their router weights);
- the shared experts, one dense MLP of ``shared_experts x moe_ffn`` every token goes through.

Backward mirrors it: the two all-to-alls again (the gradients of dispatch and combine), every
memory-bound op twice over, each product once more for I and once for W.
"""

from __future__ import annotations

from funcpipe.planner import comm
from funcpipe.planner.calibration import Calibration
from funcpipe.planner.cluster import Cluster
from funcpipe.planner.compute import (
    OpCosts,
    attention_core,
    attention_linear,
    cast_seconds,
    gemm,
    matmul_peak,
)
from funcpipe.planner.layout import ClusterLayout
from funcpipe.planner.model import Transformer

__all__ = [
    "ALL_TO_ALLS",
    "HYBRIDEP_NIC_SHARE",
    "dispatch_bytes",
    "dispatch_seconds",
    "expert_group",
    "local_experts",
    "moe_comm",
    "moe_layer_costs",
    "node_touch_probability",
    "routed_rows",
]

ALL_TO_ALLS = 4
"""All-to-alls of one MoE block and microbatch: dispatch and combine in F, their gradients in
I (a full recompute runs the forward pair again)."""

_PROBS_BYTES = 4  # the router's softmax and top-k in float32

HYBRIDEP_NIC_SHARE = {"dispatch": 54.47e9 / 2 / 50e9, "combine": 53.35e9 / 2 / 50e9}
"""Share of a GPU's NIC that Hybrid-EP's bf16 dispatch and combine reach across nodes: 0.545 and
0.534. From DeepEP's ``docs/README_Hybrid-EP.md`` (deepseek-ai/DeepEP, commit ``5fbafce2``), "H100
Platform": 16 ranks (2 nodes of 8), 16 SMs (Megatron-Core's default ``moe_hybridep_num_sms``),
4,096 tokens of hidden 7,168 a rank, top-8 of 128 experts (8 a rank), random uniform routing,
"Torch API": 54.47 GB/s dispatch, 53.35 GB/s combine. That "IB bandwidth" counts each token once
per node it touches, its own node included (``tests/test_hybrid_ep.py`` and
``count_rdma_send_from_routing_map`` in ``tests/utils.py``: "we do not set the local node map to
zeros"), so at 2 nodes half the counted bytes cross the network: 27.2 and 26.7 GB/s of the 400
Gb/s (50 GB/s) NIC a DGX-H100 GPU has."""


def routed_rows(model: Transformer, layout: ClusterLayout) -> tuple[float, float]:
    """(tokens the rank routes, expert rows it computes) for one microbatch, ``top_k b s``
    rows either way (balanced routing: each rank receives as many copies as it sends). Under
    ``tensor > 1`` with sequence parallelism (Megatron-Core) each rank routes ``b s / t``
    tokens and gathers its tensor group's rows; without it (funcpipe's runtime) each routes
    all ``b s`` and computes ``1/t`` of every expert's width on every row."""
    if layout.moe_tensor == "tokens":  # each routes 1/t of them; whole experts, no gather
        tokens = layout.microbatch * model.seq / layout.tensor
        return tokens, tokens * model.top_k
    t = layout.tensor if layout.sequence_parallel else 1
    tokens = layout.microbatch * model.seq / t
    return tokens, tokens * model.top_k * t


def dispatch_bytes(model: Transformer, layout: ClusterLayout) -> float:
    """Bytes of one all-to-all's buffer on one rank: every token it routes, ``top_k`` copies of
    its hidden vector (in the compute dtype: the dispatch runs in bf16 under fp8 too);
    ``(ep - 1) / ep`` of it leaves the rank."""
    tokens, _ = routed_rows(model, layout)
    return tokens * model.top_k * model.hidden * model.bytes


def expert_group(layout: ClusterLayout, cluster: Cluster) -> tuple[int, int]:
    """(ranks of the expert all-to-all's group, how many of them share a node): the ``expert``
    ranks, ``tensor`` apart; with ``moe_tensor="tokens"`` the ``expert x tensor`` ranks, the
    tensor ranks adjacent."""
    ep, t = layout.expert, layout.tensor
    if layout.moe_tensor == "tokens":
        return ep * t, min(ep * t, max(cluster.gpus_per_node, t))
    return ep, max(1, cluster.gpus_per_node // t)


def local_experts(model: Transformer, layout: ClusterLayout) -> tuple[float, float]:
    """(experts a rank holds, the width of each it computes): ``E / ep`` at width ``F / t``, or
    with ``moe_tensor="tokens"`` ``E / (ep t)`` whole ones."""
    if layout.moe_tensor == "tokens":
        return model.experts / (layout.expert * layout.tensor), float(model.expert_ffn)
    return model.experts / layout.expert, model.expert_ffn / layout.tensor


def dispatch_seconds(
    model: Transformer, layout: ClusterLayout, cluster: Cluster, op: str = "dispatch"
) -> float:
    """Seconds of one all-to-all over the ``expert`` axis (``op``: ``"dispatch"`` or
    ``"combine"``): its members are ``tensor`` ranks apart (tensor innermost, then expert), so
    ``gpus_per_node / tensor`` of them share a node; on NVLink when the group fits in one.
    ``alltoall``: :func:`~funcpipe.planner.comm.all_to_all_nodes`. ``hybridep`` across nodes:
    :func:`_hybridep_seconds`; inside one node it is priced as the NVLink all-to-all (DeepEP
    publishes no H100 figure for its intra-node kernels)."""
    n, per_node = expert_group(layout, cluster)
    nbytes = dispatch_bytes(model, layout)
    if layout.dispatcher == "hybridep" and per_node < n:
        return _hybridep_seconds(model, layout, cluster, per_node, op)
    return comm.all_to_all_nodes(nbytes, n, per_node, cluster.intra, cluster.inter)


def node_touch_probability(experts: int, on_node: int, top_k: int) -> float:
    """Chance that a token's ``top_k`` distinct experts, drawn uniformly from ``experts`` (the
    benchmarks' forced balance: random router logits), include one of the ``on_node`` experts
    of a given node: ``1 - C(experts - on_node, k) / C(experts, k)``."""
    miss = 1.0
    for i in range(top_k):
        miss *= max(0, experts - on_node - i) / (experts - i)
    return 1.0 - miss


def _hybridep_seconds(
    model: Transformer, layout: ClusterLayout, cluster: Cluster, per_node: int, op: str
) -> float:
    """Hybrid-EP across ``ep / per_node`` nodes: each routed token crosses the network once per
    other node holding one of its experts (one copy of its hidden vector, however many of that
    node's experts it picked), at :data:`HYBRIDEP_NIC_SHARE` of the NIC, and is fanned out over
    NVLink inside the node (at most the node's ``(g - 1) / g`` of the rank's routed rows) at
    the same time; the slower of the two, plus a network latency per other node."""
    n, _ = expert_group(layout, cluster)
    nodes = n // per_node
    tokens, _ = routed_rows(model, layout)
    on_node = model.experts // n * per_node
    touched = (nodes - 1) * node_touch_probability(model.experts, on_node, model.top_k)
    remote = tokens * touched * model.hidden * model.bytes
    remote_s = remote / (cluster.inter.bandwidth * HYBRIDEP_NIC_SHARE[op])
    local_s = (per_node - 1) / per_node * dispatch_bytes(model, layout) / cluster.intra.bandwidth
    return max(remote_s, local_s) + (nodes - 1) * cluster.inter.latency


def moe_comm(model: Transformer, layout: ClusterLayout, cluster: Cluster) -> tuple[float, float]:
    """(tensor-parallel, all-to-all) seconds of one MoE block in F (I repeats both): with
    sequence parallelism the attention's all-gather and reduce-scatter, the routed rows' gather
    and scatter over ``tensor``, the shared experts' pair; without it an all-reduce each of the
    attention's output, the routed rows (summed per row before the router's weights) and the
    shared experts' output; dispatch and combine."""
    t = layout.tensor
    a2a = dispatch_seconds(model, layout, cluster) + dispatch_seconds(
        model, layout, cluster, "combine"
    )
    if t == 1:
        return 0.0, a2a
    tlink = cluster.link(stride=1, size=t)
    act = layout.microbatch * model.seq * model.hidden * model.bytes
    routed = model.top_k * act
    if layout.moe_tensor == "tokens":  # the output all-gathered; the router's gradient summed
        tp = comm.all_reduce(act, t, tlink) + comm.all_gather(act, t, tlink)
        tp += comm.all_reduce(model.experts * model.hidden * model.bytes, t, tlink)
        return tp + (comm.all_reduce(act, t, tlink) if model.shared_experts else 0.0), a2a
    if not layout.sequence_parallel:  # funcpipe's runtime: all-reduces (docs/moe.md)
        tp = comm.all_reduce(act, t, tlink) + comm.all_reduce(routed, t, tlink)
        return tp + (comm.all_reduce(act, t, tlink) if model.shared_experts else 0.0), a2a
    pair = comm.all_gather(act, t, tlink) + comm.reduce_scatter(act, t, tlink)
    tp = pair + comm.all_gather(routed, t, tlink) + comm.reduce_scatter(routed, t, tlink)
    if model.shared_experts:
        tp += pair
    return tp, a2a


def moe_layer_costs(
    model: Transformer,
    layout: ClusterLayout,
    cluster: Cluster,
    cal: Calibration,
    *,
    windowed: bool = False,
) -> OpCosts:
    """One MoE block on one GPU for one microbatch, without its communication (:func:`moe_comm`)."""
    peak, bf16 = matmul_peak(model, cluster), cluster.gpu.peak(model.dtype)
    bw, nb = cluster.gpu.bandwidth, model.bytes
    t, h = layout.tensor, model.hidden
    tokens, rows = routed_rows(model, layout)  # per rank: routed tokens, expert rows
    all_tokens = layout.microbatch * model.seq
    m = model.matrices
    local, f_ = local_experts(model, layout)  # experts held, the width of each computed
    per_expert = rows / local
    shared = model.shared_experts * model.expert_ffn / t  # (its width split either way)
    linear = attention_linear(model, layout, cluster, cal) + gemm(
        tokens, model.experts, h, bf16, cal
    )  # the router: not an FP8 module
    linear += local * (
        gemm(per_expert, (m - 1) * f_, h, peak, cal) + gemm(per_expert, h, f_, peak, cal)
    )
    if shared:
        linear += gemm(all_tokens, (m - 1) * shared, h, peak, cal)
        linear += gemm(all_tokens, h, shared, peak, cal)
    x = _block_tokens(model, layout) * h  # the block's input on this rank (norms, residuals)
    routed = tokens * h  # the MoE's routed tokens (x, or 1/t of it with moe_tensor="tokens")
    norm_f = 2 * (2 * x * nb) / (bw * cal.norm)
    act_f = (rows * f_ + all_tokens * shared) * m * nb / (bw * cal.elementwise)
    moved = 2 * (3 * x * nb + x)  # the two residual adds
    moved += 3 * tokens * model.experts * _PROBS_BYTES  # softmax and top-k of the logits
    moved += 2 * (1 + model.top_k) * routed * nb  # permute and unpermute (with the weights)
    if expert_group(layout, cluster)[0] > 1 and local > 1:
        moved += 2 * 2 * rows * h * nb  # sort the received rows by expert, and back
    if shared:
        moved += 3 * x * nb  # add the shared experts' output
    mem_f = norm_f + act_f + moved / (bw * cal.elementwise)
    mem_b = 2 * mem_f
    if model.fp8:  # each product's input in F, its output gradient in I
        q, kvd = model.q_size, model.kv_size
        mem_f += cast_seconds(
            x + all_tokens * q / t + rows * (h + f_) + (x + all_tokens * shared) * bool(shared),
            model,
            cluster,
            cal,
        )
        mem_b += cast_seconds(
            all_tokens * (q + 2 * kvd) / t
            + x
            + rows * ((m - 1) * f_ + h)
            + (all_tokens * (m - 1) * shared + x) * bool(shared),
            model,
            cluster,
            cal,
        )
    core_f, core_b, selective = attention_core(model, layout, cluster, cal, windowed)
    f = linear + core_f + mem_f
    kept, saved_by_selective = _activations(model, layout, tokens, rows, f_)
    full = kept
    if layout.recompute == "full":
        extra, act, working = f, x * nb, full
    elif layout.recompute == "selective":  # the norms and the experts' activation (Megatron's
        # --recompute-modules layernorm moe_act), and unfused attention's scores as for dense
        extra = selective + norm_f + act_f
        act, working = full - saved_by_selective, 0.0
    else:
        extra, act, working = 0.0, full, 0.0
    i = linear + core_b + mem_b + extra
    return OpCosts(f=f, i=i, w=linear, recompute=extra, activation=act, working=working)


def _block_tokens(model: Transformer, layout: ClusterLayout) -> float:
    """Tokens of a block's input (and norms, residual adds) on one rank: ``b s / t`` under
    sequence parallelism, else all ``b s``."""
    t = layout.tensor if layout.sequence_parallel else 1
    return layout.microbatch * model.seq / t


def _activations(
    model: Transformer, layout: ClusterLayout, tokens: float, rows: float, f_: float
) -> tuple[float, float]:
    """(bytes an MoE block keeps for backward on one rank, the part selective recompute does
    not keep): per token of the block its two norm inputs and outputs (the second norm's
    output is the router's input), per routed token the router's float32 probabilities; per head-sharded token Q, K, V
    and the attention output (and unfused attention's scores); per expert row its input, the
    up (and gate) output, the activation and the down output (the combine's weights need it);
    the shared experts' up output and activation. No dropout masks (MoE models train without
    dropout)."""
    t, h, nb = layout.tensor, model.hidden, model.bytes
    all_tokens = layout.microbatch * model.seq
    m = model.matrices  # (f_: each expert's width computed on this rank)
    shared = model.shared_experts * model.expert_ffn / t
    block = _block_tokens(model, layout)
    norms = 4 * block * h  # inputs and outputs of the two norms
    heads = all_tokens * (2 * model.q_size + 2 * model.kv_size) / t
    scores = 0.0 if model.flash else 5 * model.heads * model.seq / t * all_tokens / nb
    experts = rows * (h + m * f_ + h) + all_tokens * m * shared
    kept = (norms + heads + scores + experts) * nb + tokens * model.experts * _PROBS_BYTES
    selective = (2 * block * h + rows * f_ + all_tokens * shared + scores) * nb
    return kept, selective
