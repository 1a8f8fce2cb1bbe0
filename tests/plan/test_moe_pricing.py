"""The planner's mixture-of-experts pricing (issue 53 item 5): FLOPs against a hand count, the
all-to-all against its closed form, memory split over the expert axis, the expert axis in the
search, FP8, the CLI, the bad-input errors, and the published Megatron-Bridge rows
(docs/planner.md, "Mixtures of experts")."""

from __future__ import annotations

import json
import re
from math import isclose

import pytest

from funcpipe.cli.app import main
from funcpipe.errors import InvalidArgument
from funcpipe.planner import (
    GPU,
    Calibration,
    Cluster,
    ClusterLayout,
    Link,
    Transformer,
    candidates,
    cluster,
    comm,
    estimate,
    search,
)
from funcpipe.planner.blocks import block_table
from funcpipe.planner.compute import attention_core, layer_costs
from funcpipe.planner.moe import (
    HYBRIDEP_NIC_SHARE,
    dispatch_bytes,
    dispatch_seconds,
    moe_comm,
    moe_layer_costs,
    node_touch_probability,
)
from funcpipe.planner.published import (
    MEGATRON_BRIDGE_DISPATCHER,
    MEGATRON_BRIDGE_GRAPHED,
    MEGATRON_BRIDGE_MODELS,
    MEGATRON_BRIDGE_MOE,
    megatron_bridge_graphed_run,
    megatron_bridge_run,
)

# a small mixture of experts: 4 blocks (the first dense), 8 experts of 256, top-2, 1 shared
MOE = Transformer(layers=4, hidden=128, heads=4, kv_heads=2, head_dim=64, vocab=1000, seq=64,
                  ffn=512, mlp="swiglu", tied=False, experts=8, top_k=2, moe_ffn=256,
                  shared_experts=1, dense_layers=1)  # fmt: skip
IDEAL = Cluster(GPU("ideal", {"bf16": 100e12, "fp8": 200e12}, 80e9, float("inf")))
FREE = Calibration(matmul=0.5, matmul_overhead=0.0)  # products at 50 TF/s bf16, 100 fp8


# ------------------------------------------------------------------------------------ FLOPs
def test_model_flops_are_megatron_bridges_count() -> None:
    """6 x the matrix parameters a token passes through (attention, the dense MLP of the first
    block, top-k + shared experts of the others, the output layer; no router) + 6 q s a block."""
    h, q, kvd, f, ff, s, V = 128, 4 * 64, 2 * 64, 256, 512, 64, 1000
    attention = 2 * h * q + 2 * h * kvd  # q, k, v and the output projection
    n = 4 * attention + 1 * 3 * h * ff + 3 * (2 + 1) * 3 * h * f + V * h
    assert isclose(MOE.model_flops_per_token(), 6 * n + 6 * 4 * q * s)


def test_forward_flops_count_every_matrix_the_router_and_the_window() -> None:
    h, q, kvd, f, E, s = 128, 256, 128, 256, 8, 64
    attention = 2 * h * (q + 2 * kvd) + 2 * q * h + 4 * q * s / 2
    moe_block = attention + (2 + 1) * 2 * 3 * h * f + 2 * h * E
    assert isclose(MOE.forward_flops_per_token(1), moe_block)
    assert isclose(MOE.forward_flops_per_token(0), attention + 2 * 3 * h * 512)
    windowed = Transformer(
        layers=2, hidden=128, heads=4, vocab=100, seq=64, window=16, full_every=2
    )
    w = 16
    ctx = (w * (w + 1) / 2 + (64 - w) * w) / 64  # keys per query, causal and windowed
    assert windowed.windowed(0) and not windowed.windowed(1)
    assert isclose(windowed.context(True), ctx) and isclose(windowed.context(False), 32)
    core = windowed.forward_flops_per_token(1) - windowed.forward_flops_per_token(0)
    assert isclose(core, 4 * 128 * (32 - ctx))


@pytest.mark.parametrize("name", MEGATRON_BRIDGE_MODELS)
def test_the_published_rows_count_flops_as_the_planner_does(name: str) -> None:
    """Published TFLOP/s / tokens/s is the FLOPs per token the table counts: the planner's count
    matches it within the rounding of the published TFLOP/s (GPT-OSS: 27.16 GFLOP, with the
    experts' gated MLP counted as two matrices; Qwen3: 23.01)."""
    tokens, tflops = MEGATRON_BRIDGE_MOE[name][-2:]
    published = tflops * 1e12 / tokens
    assert abs(MEGATRON_BRIDGE_MODELS[name].model_flops_per_token() / published - 1) < 0.005


def test_the_parameters_of_the_published_models() -> None:
    """gpt-oss-120b: 116.8B (OpenAI's model card: 116.8B total); Qwen3-30B-A3B: 30.5B."""
    assert isclose(MEGATRON_BRIDGE_MODELS["GPT-OSS 120B"].params() / 1e9, 116.83, abs_tol=0.01)
    assert isclose(MEGATRON_BRIDGE_MODELS["Qwen3-30B-A3B"].params() / 1e9, 30.55, abs_tol=0.01)


def test_an_moe_block_prices_its_products_at_the_calibrated_share() -> None:
    """Free memory traffic and no launch cost: W is the block's weight products (attention,
    router, each local expert on its share of the k copies, the shared expert) at the share."""
    tokens, h, q, kvd, f, E, k = 2 * 64, 128, 256, 128, 256, 8, 2
    for t, ep, sp, mt in ((1, 1, False, "width"), (1, 4, False, "width"), (2, 2, True, "width"),
                          (2, 2, False, "width"), (2, 2, False, "tokens")):  # fmt: skip
        lay = ClusterLayout(tensor=t, data=4, expert=ep, microbatch=2, sequence_parallel=sp,
                            moe_tensor=mt)  # fmt: skip
        c = moe_layer_costs(MOE, lay, IDEAL, FREE)
        attention = 2 * tokens * (h * (q + 2 * kvd) + q * h) / t
        # without SP each rank routes them all; split by tokens, its 1/t
        router = 2 * tokens / (t if sp or mt == "tokens" else 1) * h * E
        # every rank: all k copies at f / t of each, or (tokens) 1/t of them at the whole f
        experts = 2 * tokens * k * 3 * h * f / t
        shared = 2 * tokens * 3 * h * f / t
        assert isclose(c.w, (attention + router + experts + shared) / 50e12), (t, ep)


def test_fp8_runs_the_products_at_the_fp8_peak_and_prices_the_casts() -> None:
    """FP8 halves every product of the block but the router's (a bf16 module); the casts are
    memory traffic, and attention stays bf16."""
    fp8 = Transformer(**{**_fields(MOE), "fp8": True})
    lay = ClusterLayout(data=2, microbatch=2)
    bf, f8 = moe_layer_costs(MOE, lay, IDEAL, FREE), moe_layer_costs(fp8, lay, IDEAL, FREE)
    router = 2 * 2 * 64 * 128 * 8 / 50e12
    assert isclose(f8.w, (bf.w - router) / 2 + router)
    core = attention_core(MOE, lay, IDEAL, FREE, False)
    assert core == attention_core(fp8, lay, IDEAL, FREE, False)
    slow = Cluster(GPU("hbm", {"bf16": 100e12, "fp8": 200e12}, 80e9, 1e12))
    dense = Transformer(layers=1, hidden=128, heads=4, vocab=100, seq=64)
    lay1 = ClusterLayout()
    plain = layer_costs(dense, lay1, slow, FREE)
    cast = layer_costs(Transformer(**{**_fields(dense), "fp8": True}), lay1, slow, FREE)
    assert cast.f - cast.w > plain.f - plain.w  # the casts of F's inputs cost HBM time
    with pytest.raises(InvalidArgument, match="no FP8 peak"):
        estimate(fp8, cluster("a100-80gb"), ClusterLayout(data=2), global_batch=2)


def _fields(model: Transformer) -> dict[str, object]:
    return {k: getattr(model, k) for k in model.__dataclass_fields__}


# ---------------------------------------------------------------------------- the all-to-all
def test_the_all_to_all_bytes_and_seconds_are_the_closed_form() -> None:
    """Each token's hidden vector to k experts: b s / t x k x h x bytes on a rank, (ep - 1) / ep of
    it leaving; NVLink inside a node, else the share for other nodes over the network while the
    node's share takes NVLink."""
    intra, inter = Link(400e9, 2e-6), Link(40e9, 9e-6)
    where = Cluster(IDEAL.gpu, gpus_per_node=8, intra=intra, inter=inter)
    b, s, h, k = 2, 64, 128, 2
    for t, ep, sp in ((1, 4, False), (1, 8, False), (1, 16, False), (2, 4, True), (2, 8, True),
                      (2, 8, False)):  # fmt: skip
        lay = ClusterLayout(tensor=t, data=16, expert=ep, microbatch=b, sequence_parallel=sp)
        nbytes = b * s / (t if sp else 1) * k * h * 2  # without SP each tensor rank sends all
        assert isclose(dispatch_bytes(MOE, lay), nbytes)
        per_node = 8 // t
        if ep <= per_node:
            want = (ep - 1) / ep * nbytes / intra.bandwidth + (ep - 1) * intra.latency
        else:
            remote = (ep - per_node) / ep * nbytes / inter.bandwidth
            local = (per_node - 1) / ep * nbytes / intra.bandwidth
            want = max(remote, local) + (ep - 1) * inter.latency
        assert isclose(dispatch_seconds(MOE, lay, where), want), (t, ep)
        assert isclose(moe_comm(MOE, lay, where)[1], 2 * want)  # dispatch and combine in F
    assert dispatch_seconds(MOE, ClusterLayout(data=4), where) == 0.0  # one expert group


def test_moe_tokens_over_tensor_send_their_share_over_the_expert_x_tensor_ranks() -> None:
    """moe_tensor="tokens" (docs/moe.md): each of the t ranks sends its 1/t of the tokens' k
    copies over the ep x t ranks (the tensor ranks adjacent: a node holds up to 8 of them); it
    all-reduces the attention's output, all-gathers the block's output (b s h bytes on each
    rank, each sending its half) and sums the router's gradient over tensor (E x h numbers),
    and the shared experts' output."""
    intra, inter = Link(400e9, 2e-6), Link(40e9, 9e-6)
    where = Cluster(IDEAL.gpu, gpus_per_node=8, intra=intra, inter=inter)
    b, s, h, k, E = 2, 64, 128, 2, 8
    for ep in (2, 4):
        lay = ClusterLayout(tensor=2, data=16, expert=ep, microbatch=b, moe_tensor="tokens")
        nbytes = b * s / 2 * k * h * 2
        assert isclose(dispatch_bytes(MOE, lay), nbytes)
        n = 2 * ep  # 4 or 8 ranks: one node
        want = (n - 1) / n * nbytes / intra.bandwidth + (n - 1) * intra.latency
        assert isclose(dispatch_seconds(MOE, lay, where), want), ep
        act = b * s * h * 2
        tp = (comm.all_reduce(act, 2, intra) + (act / 2) / intra.bandwidth + intra.latency
              + comm.all_reduce(E * h * 2, 2, intra) + comm.all_reduce(act, 2, intra))  # fmt: skip
        assert isclose(moe_comm(MOE, lay, where)[0], tp)
    wide = ClusterLayout(tensor=2, data=16, expert=8, microbatch=b, moe_tensor="tokens")
    remote = (16 - 8) / 16 * b * s / 2 * k * h * 2 / inter.bandwidth  # 16 ranks over 2 nodes
    local = (8 - 1) / 16 * b * s / 2 * k * h * 2 / intra.bandwidth
    assert isclose(dispatch_seconds(MOE, wide, where), max(remote, local) + 15 * inter.latency)


def test_moe_tokens_over_tensor_is_a_layout_field() -> None:
    """The text and JSON say it (JSON only where it is "tokens"); refused with one tensor rank,
    on a dense model, and where the experts do not split over the expert x tensor ranks; the
    search takes both splits under tensor for a mixture of experts."""
    lay = ClusterLayout(tensor=2, data=2, moe_tensor="tokens")
    assert "moe-tokens" in lay.short() and lay.as_dict()["moe_tensor"] == "tokens"
    assert "moe_tensor" not in ClusterLayout(tensor=2, data=2).as_dict()
    with pytest.raises(InvalidArgument, match="moe_tensor='tokens', tensor=1"):
        ClusterLayout(data=2, moe_tensor="tokens")
    with pytest.raises(InvalidArgument, match="moe_tensor='rows'"):
        ClusterLayout(tensor=2, moe_tensor="rows")
    with pytest.raises(InvalidArgument, match="moe_tensor='tokens', sequence_parallel=True"):
        ClusterLayout(tensor=2, data=2, moe_tensor="tokens", sequence_parallel=True)
    dense = Transformer(layers=2, hidden=64, heads=2, vocab=10, seq=8)
    with pytest.raises(InvalidArgument, match="experts=0 does not split"):
        estimate(dense, cluster("h100-sxm"), lay, global_batch=2)
    with pytest.raises(InvalidArgument, match="experts=8 does not split over them"):
        estimate(MOE, cluster("h100-sxm"),
                 ClusterLayout(tensor=2, data=16, expert=8, moe_tensor="tokens"),
                 global_batch=16)  # fmt: skip
    lays = list(candidates(MOE, 16, 32, schedules=("1f1b",), recompute=("none",), zero=(0,)))
    got = {(lay.tensor > 1, lay.moe_tensor) for lay in lays}
    assert got == {(False, "width"), (True, "width"), (True, "tokens")}
    tok = [lay for lay in lays if lay.moe_tensor == "tokens"]
    assert tok and all(
        8 % (lay.expert * lay.tensor) == 0 and not lay.sequence_parallel for lay in tok
    )


def test_tensor_parallel_experts_without_sequence_parallelism_all_reduce_the_rows() -> None:
    """funcpipe's runtime (docs/moe.md): under tensor = 2 without sequence parallelism an MoE
    block all-reduces the attention's output, the k routed rows per token and the shared
    experts' output in F (the same again in I); with it, Megatron's all-gathers and
    reduce-scatters of the same tensors."""
    intra = Link(400e9, 2e-6)
    where = Cluster(IDEAL.gpu, gpus_per_node=8, intra=intra, inter=intra)
    act = 2 * 64 * 128 * 2  # b s h x bf16 bytes
    plain = ClusterLayout(tensor=2, data=2, microbatch=2)
    want = comm.all_reduce(act, 2, intra) * 2 + comm.all_reduce(2 * act, 2, intra)
    assert isclose(moe_comm(MOE, plain, where)[0], want)
    sp = ClusterLayout(tensor=2, data=2, microbatch=2, sequence_parallel=True)
    pair = comm.all_gather(act, 2, intra) + comm.reduce_scatter(act, 2, intra)
    routed = comm.all_gather(2 * act, 2, intra) + comm.reduce_scatter(2 * act, 2, intra)
    assert isclose(moe_comm(MOE, sp, where)[0], 2 * pair + routed)
    e = estimate(MOE, cluster("h100-sxm"), plain, global_batch=4)  # priced, not refused
    assert e.fits and e.step_time_s > 0


def test_a_step_carries_four_all_to_alls_per_moe_block_and_microbatch() -> None:
    where = cluster("h100-sxm", gpus_per_node=4)  # the group of 8 spans two nodes
    lay = ClusterLayout(data=16, expert=8)
    e = estimate(MOE, where, lay, global_batch=32)
    one = dispatch_seconds(MOE, lay, where)
    assert one > 0
    assert isclose(e.breakdown["expert_all_to_all_per_microbatch"], 3 * 4 * one)  # 3 MoE blocks
    table = block_table(MOE, lay, where, Calibration())
    moe, dense = table[True, False], table[False, False]
    assert isclose(moe.f - moe.costs.f, 2 * one) and isclose(moe.i - moe.costs.i, 2 * one)
    assert dense.a2a_f == dense.a2a_i == 0.0
    full = block_table(MOE, ClusterLayout(data=16, expert=8, recompute="full"), where,
                       Calibration())[True, False]  # fmt: skip
    assert isclose(full.a2a_i, 4 * one)  # the recomputed forward dispatches again


def test_hybridep_sends_each_token_once_per_other_node_it_touches() -> None:
    """Across nodes, Hybrid-EP moves b s / t tokens x (nodes - 1) x P(a node holds one of the
    token's k experts) hidden vectors over the network, at the published share of the NIC,
    while the node's fan-out takes NVLink; inside a node it is the NVLink all-to-all."""
    intra, inter = Link(400e9, 2e-6), Link(40e9, 9e-6)
    where = Cluster(IDEAL.gpu, gpus_per_node=4, intra=intra, inter=inter)
    b, s, h, k, E = 2, 64, 128, 2, 8
    for ep in (8, 4):
        flat = ClusterLayout(data=8, expert=ep, microbatch=b)
        hyb = ClusterLayout(data=8, expert=ep, microbatch=b, dispatcher="hybridep")
        if ep == 4:  # one node: the same as the flat all-to-all
            assert dispatch_seconds(MOE, hyb, where) == dispatch_seconds(MOE, flat, where)
            continue
        on_node = E // ep * 4  # 4 of the 8 experts on each of the 2 nodes
        touch = 1 - (4 * 3) / (8 * 7)  # 1 - C(4, 2) / C(8, 2)
        assert isclose(node_touch_probability(E, on_node, k), touch)
        remote = b * s * 1 * touch * h * 2
        for op in ("dispatch", "combine"):
            net = remote / (inter.bandwidth * HYBRIDEP_NIC_SHARE[op])
            nvl = 3 / 4 * dispatch_bytes(MOE, hyb) / intra.bandwidth
            want = max(net, nvl) + inter.latency
            assert isclose(dispatch_seconds(MOE, hyb, where, op), want), op
        pair = dispatch_seconds(MOE, hyb, where) + dispatch_seconds(MOE, hyb, where, "combine")
        assert isclose(moe_comm(MOE, hyb, where)[1], pair)
        assert pair < moe_comm(MOE, flat, where)[1]  # fewer bytes over the network
    assert isclose(HYBRIDEP_NIC_SHARE["dispatch"], 0.5447, abs_tol=1e-4)  # DeepEP's H100 rows
    assert isclose(HYBRIDEP_NIC_SHARE["combine"], 0.5335, abs_tol=1e-4)
    assert node_touch_probability(8, 8, 2) == 1.0 and node_touch_probability(8, 0, 2) == 0.0


def test_the_dispatcher_is_a_layout_field() -> None:
    lay = ClusterLayout(data=16, expert=16, zero=1, dispatcher="hybridep")
    assert lay.short() == "t1 p1 d16 e16 b1 v1 none zero1 hybridep 1f1b"
    assert lay.as_dict()["dispatcher"] == "hybridep"
    assert "dispatcher" not in ClusterLayout(data=16, expert=16).as_dict()
    with pytest.raises(InvalidArgument, match="one of alltoall, hybridep"):
        ClusterLayout(data=4, expert=4, dispatcher="deepep")
    with pytest.raises(InvalidArgument, match="expert=1"):
        ClusterLayout(data=4, dispatcher="hybridep")
    assert MEGATRON_BRIDGE_DISPATCHER == {"GPT-OSS 120B": "alltoall",
                                          "Qwen3-30B-A3B": "hybridep"}  # fmt: skip
    assert megatron_bridge_run("Qwen3-30B-A3B")[1].dispatcher == "hybridep"


# -------------------------------------------------------------------------------- memory
def test_expert_memory_is_split_over_the_expert_axis() -> None:
    """Experts (and their gradients and optimizer state) over ``expert``; dense ones whole; with
    ZeRO-1 the dense optimizer state over ``data``, the experts' over ``data / expert``."""
    h100 = cluster("h100-sxm")
    dense, expert = MOE.moe_layer_params()
    blocks = MOE.layer_params() + 3 * dense  # the first block dense, three MoE
    rest = 2 * MOE.vocab * MOE.hidden + 2 * MOE.hidden  # untied embedding and output, norm
    for ep, zero in ((1, 0), (2, 0), (4, 0), (4, 1), (2, 1)):
        e = estimate(MOE, h100, ClusterLayout(data=4, expert=ep, zero=zero), global_batch=8)
        held_dense, held_expert = blocks + rest, 3 * expert / ep
        assert isclose(e.memory["parameters"], 2 * (held_dense + held_expert))
        assert isclose(e.memory["gradients"], 4 * (held_dense + held_expert))
        d_share, e_share = (4, 4 // ep) if zero else (1, 1)
        optimizer = 12 * held_dense / d_share + 12 * held_expert / e_share
        assert isclose(e.memory["optimizer"], optimizer), (ep, zero)


def test_dense_gradients_reduce_over_data_and_expert_ones_over_data_by_expert() -> None:
    """Not overlapped, one all-reduce of the dense gradients over the 8 copies and one of the
    experts' over the 8 / expert copies of each (none at expert = data)."""
    h100 = cluster("h100-sxm")
    dense, expert = MOE.moe_layer_params()
    held_dense = MOE.layer_params() + 3 * dense + 2 * MOE.vocab * MOE.hidden + 2 * MOE.hidden
    for ep in (1, 2, 4, 8):
        e = estimate(MOE, h100, ClusterLayout(data=8, expert=ep), global_batch=8,
                     overlap_grad_reduce=False)  # fmt: skip
        want = comm.all_reduce(2 * held_dense, 8, h100.intra)
        want += comm.all_reduce(2 * 3 * expert / ep, 8 // ep, h100.intra)
        assert isclose(e.breakdown["data_parallel_total"], want), ep


# ----------------------------------------------------------------------- layout and search
def test_the_candidates_take_expert_sizes_dividing_data_and_the_experts() -> None:
    lays = list(candidates(MOE, 16, 32, schedules=("1f1b",), recompute=("none",), zero=(0,)))
    sizes = {lay.expert for lay in lays}
    assert sizes == {1, 2, 4, 8}  # 16 copies at most, 8 experts
    assert all(lay.data % lay.expert == 0 and 8 % lay.expert == 0 for lay in lays)
    # under TP both: Megatron's sequence-parallel MoE and funcpipe's all-reduced one
    assert {lay.sequence_parallel for lay in lays if lay.tensor > 1} == {False, True}
    narrow = candidates(MOE, 16, 32, schedules=("1f1b",), recompute=("none",), expert=(4,))
    assert {lay.expert for lay in narrow} == {4}
    dense = Transformer(layers=4, hidden=128, heads=4, vocab=1000, seq=64)
    assert {lay.expert for lay in candidates(dense, 16, 32)} == {1}
    with pytest.raises(InvalidArgument, match="expert="):
        list(candidates(MOE, 16, 32, expert=(0,)))


def test_the_search_chooses_an_expert_axis_where_experts_do_not_fit_without_one() -> None:
    """64 experts of 8192 (6.4B expert parameters a block) on 8 GPUs: without the axis every GPU
    would hold all of them; the search splits them."""
    big = Transformer(layers=4, hidden=2048, heads=16, vocab=32000, seq=2048, tied=False,
                      mlp="swiglu", experts=64, top_k=2, moe_ffn=8192)  # fmt: skip
    h100 = cluster("h100-sxm")
    lone = estimate(big, h100, ClusterLayout(data=8, zero=1), global_batch=16)
    assert not lone.fits
    best = search(big, h100, gpus=8, global_batch=16, top=3, schedules=("1f1b",))
    assert all(e.fits for e in best)
    assert best[0].layout.expert > 1, best[0].layout.short()
    assert f"e{best[0].layout.expert}" in best[0].layout.short()
    fixed = estimate(big, h100, best[0].layout, global_batch=16, simulate=True)
    assert isclose(fixed.step_time_s, best[0].step_time_s)


def test_a_dense_layout_keeps_its_json_and_text() -> None:
    lay = ClusterLayout(tensor=2, pipeline=2, data=2)
    assert "expert" not in lay.as_dict() and lay.short() == "t2 p2 d2 b1 v1 none 1f1b"
    moe = ClusterLayout(data=8, expert=4)
    assert moe.as_dict()["expert"] == 4 and moe.short() == "t1 p1 d8 e4 b1 v1 none 1f1b"


# ------------------------------------------------------------------------------------- CLI
MOE_ARGS = ["plan", "--layers", "4", "--hidden", "128", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "64", "--vocab", "1000", "--seq", "64", "--ffn", "512", "--mlp",
            "swiglu", "--untied", "--experts", "8", "--top-k", "2", "--moe-ffn", "256",
            "--shared-experts", "1", "--dense-layers", "1", "--global-batch", "32", "--gpus",
            "16", "--gpu", "h100-sxm"]  # fmt: skip


def test_cli_prices_a_mixture_of_experts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*MOE_ARGS, "--expert-parallel", "8", "--precision", "fp8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = estimate(Transformer(**{**_fields(MOE), "fp8": True}), cluster("h100-sxm"),
                    ClusterLayout(data=16, expert=8), global_batch=32)  # fmt: skip
    assert isclose(out["tokens_per_s_per_gpu"], want.tokens_per_s_per_gpu)
    assert isclose(out["tflops_per_gpu"], want.tflops_per_gpu)
    assert isclose(out["tokens_per_s_per_gpu"], 32 * 64 / out["step_time_s"] / 16)
    for key in ("step_time_s", "mfu", "hardware_tflops_per_gpu", "model_tflops_per_gpu",
                "memory_gib_per_gpu", "fits", "layout", "breakdown_s", "memory_gib"):  # fmt: skip
        assert key in out
    assert out["layout"]["expert"] == 8 and out["searched"] is False
    assert main([*MOE_ARGS, "--top", "2"]) == 0  # searched, with the expert axis
    table = capsys.readouterr().out
    assert "8 experts (top 2)" in table and "tok/s/GPU" in table and "(searched)" in table


def test_cli_prices_moe_tokens_over_tensor(capsys: pytest.CaptureFixture[str]) -> None:
    """--moe-tensor tokens fixes the layout's split (its JSON says it; the text too)."""
    args = [*MOE_ARGS, "--tensor", "2", "--expert-parallel", "2", "--moe-tensor", "tokens"]
    assert main([*args, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["moe_tensor"] == "tokens"
    assert main(args) == 0
    assert "moe-tokens" in capsys.readouterr().out


def test_cli_json_of_a_dense_model_has_the_new_keys(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "1000",
            "--seq", "128", "--global-batch", "16", "--gpus", "8", "--gpu", "h100-sxm"]  # fmt: skip
    assert main([*args, "--tensor", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens_per_s_per_gpu"] > 0 and isclose(out["tflops_per_gpu"],
                                                        out["model_tflops_per_gpu"])  # fmt: skip
    assert "expert" not in out["layout"]


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--expert-parallel", "3"], ["--expert-parallel 3", "--experts 8", "divisor of 8"]),
        (["--expert-parallel", "8", "--pipeline", "4"],
         ["--expert-parallel 8 does not divide", "data = 4", "divisor of 4"]),
        (["--expert-parallel", "8", "--gpus", "4", "--global-batch", "4"],
         ["does not divide the data-parallel copies", "data = 4"]),
        (["--top-k", "9"], ["--top-k 9", "--experts 8", "1 to 8"]),
        (["--dense-layers", "4"], ["dense_layers=4", "layers=4"]),
        (["--precision", "fp8", "--gpu", "a100-80gb"], ["--precision fp8", "a100-80gb", "FP8"]),
        (["--full-every", "2"], ["--full-every 2", "--window"]),
    ],
)  # fmt: skip
def test_cli_refuses_bad_moe_input(
    extra: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*MOE_ARGS, *extra]) == 2
    err = capsys.readouterr().err
    assert "funcpipe plan: error:" in err and all(n in err for n in needles), err


def test_cli_refuses_moe_options_without_experts(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "1000",
            "--seq", "128", "--global-batch", "16", "--gpus", "8", "--gpu", "h100-sxm"]  # fmt: skip
    for extra in (["--top-k", "2"], ["--expert-parallel", "2"], ["--moe-ffn", "64"],
                  ["--moe-tensor", "tokens"]):  # fmt: skip
        assert main([*args, *extra]) == 2
        assert "give --experts E too" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: Transformer(**{**_fields(MOE), "top_k": 9}), "top_k=9, experts=8"),
        (lambda: Transformer(**{**_fields(MOE), "top_k": 0}), "1 <= top_k <= experts"),
        (lambda: Transformer(layers=2, hidden=64, heads=2, vocab=10, seq=8, top_k=2),
         "experts=0"),
        (lambda: Transformer(**{**_fields(MOE), "mlp": "relu"}), "mlp='relu'"),
        (lambda: Transformer(**{**_fields(MOE), "experts": -1}), "experts=-1"),
        (lambda: ClusterLayout(data=6, expert=4), "expert must divide data"),
        (lambda: estimate(MOE, cluster("h100-sxm"), ClusterLayout(data=6, expert=3),
                          global_batch=6), "experts=8 must split evenly"),
        (lambda: estimate(Transformer(layers=2, hidden=64, heads=2, vocab=10, seq=8),
                          cluster("h100-sxm"), ClusterLayout(data=2, expert=2), global_batch=2),
         "no experts"),
    ],
)  # fmt: skip
def test_the_api_refuses_bad_moe_input(make: object, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(needle)):
        make()  # type: ignore[operator]


# ---------------------------------------------------------------- the published benchmarks
def _row(name: str) -> tuple[float, float, float, float, bool]:
    model, layout, gpus, batch = megatron_bridge_run(name)
    assert layout.gpus == gpus
    e = estimate(model, cluster("h100-sxm"), layout, global_batch=batch, simulate=True)
    tokens, tflops = MEGATRON_BRIDGE_MOE[name][-2:]
    return e.tokens_per_s_per_gpu, tokens, e.tflops_per_gpu, tflops, e.fits


@pytest.mark.xfail(
    strict=True,
    reason="docs/planner.md: the planner gives Qwen3-30B-A3B EP16 (Hybrid-EP) 11,453 "
    "tokens/s/GPU, 1.30x the published eager 8,826. The same workload with its router in CUDA "
    "graphs is within 20% (1.03x BF16, 0.87x blockwise FP8; the test above), and graphs took "
    "31% off its eager FP8 step (Megatron-Bridge's measurement): the gap is the host's launch "
    "time, which the planner, a model of GPU time, does not price",
)
def test_qwen3_30b_a3b_within_20_percent() -> None:
    """Megatron-Bridge 26.06, 16 H100, FP8, EP16, Hybrid-EP: 8,826 tokens/s/GPU and 203
    TFLOP/s/GPU (docs/planner.md: predicted 1.30x of both)."""
    got, tokens, tf, tflops, fits = _row("Qwen3-30B-A3B")
    assert fits
    assert abs(got / tokens - 1) <= 0.20, got
    assert abs(tf / tflops - 1) <= 0.20, tf


@pytest.mark.parametrize("name", MEGATRON_BRIDGE_GRAPHED)
def test_qwen3_with_graph_captured_routers_within_20_percent(name: str) -> None:
    """The published Qwen3-30B-A3B workload (16 H100, EP16, Hybrid-EP, GBS 1024) as Megatron-
    Bridge's campaigns measured it with the router (and attention) in CUDA graphs, so that the
    host's launches take less of the step: the planner, a model of GPU time, is within 20% of
    both (docs/planner.md: 1.03x in BF16, 0.87x in blockwise FP8). The batch of the FP8 run is
    not stated; 1,024 is the one its step time and TFLOP/s agree on (checked here to 0.5%)."""
    model, layout, gpus, batch = megatron_bridge_graphed_run(name)
    _, _, step_s, tflops = MEGATRON_BRIDGE_GRAPHED[name]
    tokens = batch * model.seq / gpus / step_s
    assert isclose(model.model_flops_per_token() * tokens, tflops * 1e12, rel_tol=5e-3)
    e = estimate(model, cluster("h100-sxm"), layout, global_batch=batch, simulate=True)
    assert e.fits and layout.dispatcher == "hybridep" and layout.expert == 16
    assert abs(e.tokens_per_s_per_gpu / tokens - 1) <= 0.20, e.tokens_per_s_per_gpu
    assert abs(e.tflops_per_gpu / tflops - 1) <= 0.20, e.tflops_per_gpu


def test_the_published_rows_as_priced() -> None:
    """The numbers docs/planner.md's table quotes (tokens/s/GPU, TFLOP/s/GPU), to 0.5%; and the
    flat all-to-all the EP16 row used to be priced with (0.90x)."""
    for name, tokens, tf in (("GPT-OSS 120B", 9857, 267.8), ("Qwen3-30B-A3B", 11453, 263.5)):
        got, _, got_tf, _, fits = _row(name)
        assert fits and isclose(got, tokens, rel_tol=5e-3) and isclose(got_tf, tf, rel_tol=5e-3)
    model, _, _, batch = megatron_bridge_run("Qwen3-30B-A3B")
    flat = estimate(model, cluster("h100-sxm"), ClusterLayout(data=16, expert=16, zero=1),
                    global_batch=batch, simulate=True)  # fmt: skip
    assert isclose(flat.tokens_per_s_per_gpu, 7912, rel_tol=5e-3)


@pytest.mark.xfail(
    strict=True,
    reason="docs/planner.md: the planner prices GPT-OSS 120B (PP4 EP8, all-to-all on NVLink) at "
    "1.69x the published 5,824 tokens/s/GPU; its MoE blocks take 16 ms a microbatch there "
    "against the roofline's 8 ms, and a 1.30x gap shows on both Qwen3 rows (in-node EP8, and "
    "EP16 with Hybrid-EP). Not the expert GEMMs (a published H100 per-expert cuBLAS timing "
    "runs under the planner's price); eager launches cost Qwen3 31% of its step, and a share "
    "like GPT-OSS 20B's measured 16-24% would still leave 1.3-1.4x; no graphed H100 run of "
    "GPT-OSS 120B is published",
)
def test_gpt_oss_120b_within_20_percent() -> None:
    """Megatron-Bridge 26.04.01, 64 H100, BF16, PP4 EP8: 5,824 tokens/s/GPU, 158 TFLOP/s/GPU."""
    got, tokens, tf, tflops, fits = _row("GPT-OSS 120B")
    assert fits
    assert abs(got / tokens - 1) <= 0.20, got
    assert abs(tf / tflops - 1) <= 0.20, tf
