"""Published runs the planner is checked against (docs/planner.md), as data.

``MEGATRON_2021``: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC21, arXiv 2104.04473), Table 1: GPT models on A100-80GB (DGX A100,
8 GPUs per node, 8 x 200 Gb/s HDR InfiniBand), sequence 2048, vocabulary 51,200, mixed precision,
full activation recompute, microbatch 1 (the paper's weak-scaling runs). Rows: (billions of
parameters, layers, hidden, heads, tensor, pipeline, GPUs, global batch, published TFLOP/s per
GPU). Where each number comes from is in docs/planner.md; the 145.6B row ran the interleaved
schedule with 2 chunks per rank (as the issue states), the others plain 1F1B.

``MEGATRON_BRIDGE_MOE``: mixtures of experts on DGX-H100 (8 GPUs per node, one 400 Gb/s NIC per
GPU) from NVIDIA-NeMo/Megatron-Bridge ``docs/performance-summary-archive.md`` (force-balanced
routing, dropless), with each model's shape from its Hugging Face ``config.json``
(``MEGATRON_BRIDGE_MODELS``); how each is priced is in docs/planner.md.

``MEGATRON_BRIDGE_GRAPHED``: the same Qwen3-30B-A3B workload measured in Megatron-Bridge's
performance campaigns (its ``skills/`` notes) with part of each block captured in CUDA graphs,
so that less of the step is the host launching kernels: what the planner, a model of GPU time,
is compared with where the host is out of the way.
"""

from __future__ import annotations

from dataclasses import replace

from funcpipe.planner.layout import ClusterLayout
from funcpipe.planner.model import Transformer

__all__ = [
    "MEGATRON_2021",
    "MEGATRON_BRIDGE_DISPATCHER",
    "MEGATRON_BRIDGE_GRAPHED",
    "MEGATRON_BRIDGE_MODELS",
    "MEGATRON_BRIDGE_MOE",
    "ZERO_BUBBLE_2024_BUBBLE",
    "ZERO_BUBBLE_2024_MEMORY_GB",
    "ZERO_BUBBLE_2024_MODELS",
    "ZERO_BUBBLE_2024_PROFILED_MS",
    "ZERO_BUBBLE_2024_STANDINS",
    "ZERO_BUBBLE_2024_SYNCHRONIZED",
    "ZERO_BUBBLE_2024_THROUGHPUT",
    "ZERO_BUBBLE_2024_VOCAB",
    "megatron_bridge_graphed_run",
    "megatron_bridge_run",
    "zero_bubble_run",
]

MEGATRON_2021: tuple[tuple[float, int, int, int, int, int, int, int, float], ...] = (
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 30, 3072, 32, 2, 1, 64, 512, 138),
    (7.5, 36, 4096, 32, 4, 1, 128, 512, 142),
    (18.4, 40, 6144, 48, 8, 1, 256, 1024, 135),
    (39.1, 48, 8192, 64, 8, 2, 512, 1536, 138),
    (76.1, 60, 10240, 80, 8, 4, 1024, 1792, 140),
    (145.6, 80, 12288, 96, 8, 8, 1536, 2304, 148),
    (310.1, 96, 16384, 128, 8, 16, 1920, 2160, 155),
    (529.6, 105, 20480, 128, 8, 35, 2520, 2520, 163),
    (1008.0, 128, 25600, 160, 8, 64, 3072, 3072, 163),
)


MEGATRON_BRIDGE_MODELS: dict[str, Transformer] = {
    # openai/gpt-oss-120b config.json: 36 layers, hidden 2880, 64 query heads of 64, 8 KV heads,
    # 128 experts of intermediate size 2880 (a clamped GLU: gate, up, down), top-4, no shared
    # expert, vocabulary 201,088, untied, sliding window 128 on every other block (the first
    # windowed). Sequence 4,096 as the benchmark row states.
    "GPT-OSS 120B": Transformer(
        layers=36, hidden=2880, heads=64, kv_heads=8, head_dim=64, vocab=201088, seq=4096,
        ffn=2880, mlp="geglu", tied=False, experts=128, top_k=4, moe_ffn=2880, window=128,
        full_every=2,
    ),
    # Qwen/Qwen3-30B-A3B config.json: 48 layers, hidden 2048, 32 query heads of 128, 4 KV heads,
    # 128 experts of moe_intermediate_size 768 (SwiGLU), top-8, no shared expert, every block
    # MoE, vocabulary 151,936, untied. Sequence 4,096 as the row states; FP8 matrix products.
    "Qwen3-30B-A3B": Transformer(
        layers=48, hidden=2048, heads=32, kv_heads=4, head_dim=128, vocab=151936, seq=4096,
        ffn=6144, mlp="swiglu", tied=False, experts=128, top_k=8, moe_ffn=768, fp8=True,
    ),
}  # fmt: skip

MEGATRON_BRIDGE_MOE: dict[str, tuple[str, int, str, int, int, int, int, int, int, float, float]] = {
    # container, GPUs, precision, global batch, microbatch, tensor, pipeline, expert, recompute
    # modules (1: layernorm and moe_act, Megatron-Bridge's H100 GPT-OSS recipe; 0: none),
    # published tokens/s/GPU, published model TFLOP/s/GPU
    "GPT-OSS 120B": ("26.04.01", 64, "bf16", 1280, 1, 1, 4, 8, 1, 5824, 158),
    "Qwen3-30B-A3B": ("26.06", 16, "fp8", 1024, 1, 1, 1, 16, 0, 8826, 203),
}


MEGATRON_BRIDGE_DISPATCHER: dict[str, str] = {
    # scripts/performance/configs: GPT-OSS 120B H100 BF16 V2 keeps the recipe's
    # moe_token_dispatcher_type="alltoall"; Qwen3-30B-A3B H100 FP8_CS V1 (qwen/
    # qwen3_workload_base_configs.py) sets moe_flex_dispatcher_backend="hybridep"
    "GPT-OSS 120B": "alltoall",
    "Qwen3-30B-A3B": "hybridep",
}


def megatron_bridge_run(name: str) -> tuple[Transformer, ClusterLayout, int, int]:
    """(Transformer, ClusterLayout, GPUs, global batch) of one :data:`MEGATRON_BRIDGE_MOE` row in
    planner terms: Megatron-Core's distributed optimizer (``zero=1``), 1F1B, data = GPUs /
    (tensor x pipeline) with the expert axis inside it, the recipe's recompute of the norms and
    the expert activation as ``selective``, the recipe's dispatcher
    (:data:`MEGATRON_BRIDGE_DISPATCHER`)."""
    _, gpus, _, batch, b, t, p, ep, rc, _, _ = MEGATRON_BRIDGE_MOE[name]
    layout = ClusterLayout(tensor=t, pipeline=p, data=gpus // (t * p), microbatch=b, expert=ep,
                    zero=1, recompute="selective" if rc else "none",
                    dispatcher=MEGATRON_BRIDGE_DISPATCHER[name])  # fmt: skip
    return MEGATRON_BRIDGE_MODELS[name], layout, gpus, batch


MEGATRON_BRIDGE_GRAPHED: dict[str, tuple[str, bool, float, float]] = {
    # Qwen3-30B-A3B on 16 H100 (2 nodes), TP1 PP1 CP1 EP16, MBS 1, GBS 1024, seq 4096,
    # forced-balanced routing: (source, FP8 products, measured step seconds, model TFLOP/s/GPU).
    # skills/nemo-mbridge-perf-moe-comm-overlap/SKILL.md (NVIDIA-NeMo/Megatron-Bridge, commit
    # 228e9a3e), "HybridEP production-shape validation", the "EP overlap off" row: BF16,
    # Hybrid-EP, Transformer Engine graph scopes moe_router and moe_preprocess, iterations 5-20.
    "Qwen3-30B-A3B BF16 (router graphs)": ("moe-comm-overlap", False, 24.7138, 244.039),
    # skills/nemo-mbridge-perf-cuda-graphs/SKILL.md and card.yaml (same commit), pitfall 16:
    # "blockwise FP8 without scoped graphs was about 29.18 seconds/step, while
    # attn,moe_router,moe_preprocess replay averaged 19.99728 seconds ... 301.60 model
    # TFLOP/s/GPU" (26.08.rc2, 16xH100_recipe, 2 nodes; the batch is not stated: 1,024 is the
    # one that makes 301.60 TFLOP/s at 19.997 s with Megatron-Bridge's 23.0 GFLOP a token).
    "Qwen3-30B-A3B FP8 blockwise (attention and router graphs)": (
        "cuda-graphs", True, 19.99728, 301.60,
    ),
}  # fmt: skip


def megatron_bridge_graphed_run(name: str) -> tuple[Transformer, ClusterLayout, int, int]:
    """(Transformer, ClusterLayout, GPUs, global batch) of one :data:`MEGATRON_BRIDGE_GRAPHED`
    run: the published Qwen3-30B-A3B row's model and layout (Hybrid-EP, EP16) in its
    precision (a blockwise FP8 recipe is priced as current scaling, the one FP8 the planner
    has)."""
    model, layout, gpus, batch = megatron_bridge_run("Qwen3-30B-A3B")
    return replace(model, fp8=MEGATRON_BRIDGE_GRAPHED[name][1]), layout, gpus, batch


# Qi, Wan, Huang and Lin, "Zero Bubble (Almost) Pipeline Parallelism" (ICLR 2024, OpenReview
# tuzTN0eIO5; arXiv 2401.10241): GPT-3-like models on A100 SXM 80GB (up to 4 nodes of 8, RoCE),
# pipeline parallelism only, the first and last stage one block fewer than the others (Section
# 5.1). Where each number comes from is in docs/planner.md.

ZERO_BUBBLE_2024_MODELS: dict[str, tuple[int, int, int, int, int, int, tuple[int, int, int]]] = {
    # Table 3: layers, attention heads, hidden, sequence, pipeline stages (= GPUs), microbatch
    # size, numbers of microbatches
    "1.5B": (22, 24, 2304, 1024, 8, 6, (24, 32, 64)),
    "6.2B": (30, 32, 4096, 1024, 8, 3, (24, 32, 64)),
    "14.6B": (46, 40, 5120, 1024, 16, 1, (48, 64, 128)),
    "28.3B": (62, 48, 6144, 1024, 32, 1, (96, 128, 256)),
}

ZERO_BUBBLE_2024_THROUGHPUT: dict[str, dict[str, tuple[float, float, float]]] = {
    # Table 4, samples per GPU per second at the three microbatch counts of Table 3
    "1.5B": {
        "zb-2p": (14.5, 14.8, 14.9),
        "zb-1p": (12.9, 13.4, 14.2),
        "1f1b": (11.8, 12.5, 13.6),
        "1f1b-i": (13.1, 13.4, 13.9),
    },
    "6.2B": {
        "zb-2p": (4.32, 4.35, 4.39),
        "zb-1p": (3.88, 4.00, 4.20),
        "1f1b": (3.50, 3.70, 4.03),
        "1f1b-i": (4.01, 4.08, 4.19),
    },
    "14.6B": {
        "zb-2p": (1.81, 1.83, 1.85),
        "zb-1p": (1.61, 1.67, 1.76),
        "1f1b": (1.40, 1.49, 1.64),
        "1f1b-i": (1.54, 1.59, 1.66),
    },
    "28.3B": {
        "zb-2p": (0.99, 1.00, 1.00),
        "zb-1p": (0.87, 0.90, 0.96),
        "1f1b": (0.76, 0.80, 0.88),
        "1f1b-i": (0.82, 0.85, 0.90),
    },
}

ZERO_BUBBLE_2024_MEMORY_GB: dict[str, dict[str, float]] = {
    # Table 4, memory (GB), the same at every microbatch count
    "1.5B": {"zb-2p": 59, "zb-1p": 32, "1f1b": 30, "1f1b-i": 40},
    "6.2B": {"zb-2p": 70, "zb-1p": 42, "1f1b": 39, "1f1b-i": 48},
    "14.6B": {"zb-2p": 51, "zb-1p": 33, "1f1b": 32, "1f1b-i": 39},
    "28.3B": {"zb-2p": 74, "zb-1p": 44, "1f1b": 43, "1f1b-i": 58},
}

ZERO_BUBBLE_2024_BUBBLE: dict[str, dict[str, tuple[float, float, float]]] = {
    # Table 5, bubble rates (computed by the paper from Table 6's times, not measured)
    "1.5B": {
        "1f1b": (0.2431, 0.1985, 0.1240),
        "1f1b-i": (0.1055, 0.0818, 0.0443),
        "zb-h1": (0.1585, 0.1242, 0.0674),
        "zb-h2": (0.1083, 0.0837, 0.0444),
        "zb-1p": (0.1585, 0.1242, 0.0674),
        "zb-2p": (0.0433, 0.0039, 0.0026),
    },
    "6.2B": {
        "1f1b": (0.2347, 0.1898, 0.1091),
        "1f1b-i": (0.0808, 0.0628, 0.0320),
        "zb-h1": (0.1323, 0.1045, 0.0554),
        "zb-h2": (0.0698, 0.0559, 0.0294),
        "zb-1p": (0.1323, 0.1045, 0.0554),
        "zb-2p": (0.0029, 0.0022, 0.0010),
    },
    "14.6B": {
        "1f1b": (0.2552, 0.2082, 0.1251),
        "1f1b-i": (0.1104, 0.0852, 0.0445),
        "zb-h1": (0.1397, 0.1088, 0.0576),
        "zb-h2": (0.0672, 0.0516, 0.0266),
        "zb-1p": (0.1397, 0.1088, 0.0576),
        "zb-2p": (0.0066, 0.0054, 0.0028),
    },
    "28.3B": {
        "1f1b": (0.2646, 0.2168, 0.1352),
        "1f1b-i": (0.1493, 0.1164, 0.0624),
        "zb-h1": (0.1421, 0.1106, 0.0594),
        "zb-h2": (0.0641, 0.0490, 0.0257),
        "zb-1p": (0.1421, 0.1106, 0.0594),
        "zb-2p": (0.0038, 0.0029, 0.0018),
    },
}

ZERO_BUBBLE_2024_PROFILED_MS: dict[str, tuple[tuple[float, float, float, float], ...]] = {
    # Table 6: T_F, T_B (input gradients), T_W, T_comm in milliseconds, per microbatch count
    "1.5B": (
        (18.522, 18.086, 9.337, 0.601),
        (18.513, 18.086, 9.331, 0.626),
        (18.546, 18.097, 9.321, 0.762),
    ),
    "6.2B": (
        (29.718, 29.444, 19.927, 0.527),
        (29.802, 29.428, 19.530, 0.577),
        (29.935, 29.621, 19.388, 0.535),
    ),
    "14.6B": (
        (11.347, 11.248, 8.132, 0.377),
        (11.307, 11.254, 8.101, 0.379),
        (11.325, 11.308, 8.109, 0.378),
    ),
    "28.3B": (
        (10.419, 10.207, 7.715, 0.408),
        (10.408, 10.204, 7.703, 0.408),
        (10.402, 10.248, 7.698, 0.460),
    ),
}

ZERO_BUBBLE_2024_SYNCHRONIZED: dict[str, tuple[int, float, float]] = {
    # Table 7: ZB-2p at the first microbatch count of Table 3, samples per GPU per second with
    # the paper's optimizer post-validation (as in Table 4) and with an all-reduce
    # synchronization before the optimizer step (as funcpipe steps)
    "1.5B": (24, 14.5, 13.11),
    "6.2B": (24, 4.32, 4.00),
    "14.6B": (48, 1.81, 1.68),
    "28.3B": (96, 0.99, 0.91),
}

ZERO_BUBBLE_2024_VOCAB = 50304
"""Not stated in the paper: GPT-2's 50,257 tokens padded to a multiple of 128, Megatron-LM's
default for its GPT-2 tokenizer (an assumption; docs/planner.md gives the effect of 50,257)."""

ZERO_BUBBLE_2024_STANDINS = {"1f1b": "1f1b", "zb-1p": "zb-h1", "zb-2p": "zb-h2"}
"""The paper's schedules and the planner's schedule priced for each: ZB-1p's searched schedule
has exactly ZB-H1's bubble in all 12 settings of Table 5; ZB-2p (searched under a 2p activation
limit) has no generator here, and ZB-H2 (the same limit, made for equal F, B, W) stands in."""


def zero_bubble_run(
    name: str, microbatches: int, schedule: str
) -> tuple[Transformer, ClusterLayout, int]:
    """(Transformer, ClusterLayout, global batch) of one Zero Bubble Table 4 run in planner terms:
    unfused attention (Megatron-LM's, as the paper's activation formula ``sb(34h + 5as)`` implies),
    tied embedding, the first and last stage one block fewer. ``schedule`` is a key of
    :data:`ZERO_BUBBLE_2024_STANDINS`."""
    layers, heads, hidden, seq, p, b, _ = ZERO_BUBBLE_2024_MODELS[name]
    mid = (layers + 2) // p
    counts = (mid - 1,) + (mid,) * (p - 2) + (mid - 1,)
    model = Transformer(layers=layers, hidden=hidden, heads=heads, vocab=ZERO_BUBBLE_2024_VOCAB,
                        seq=seq, flash=False)  # fmt: skip
    layout = ClusterLayout(pipeline=p, microbatch=b, schedule=ZERO_BUBBLE_2024_STANDINS[schedule],
                    stage_layers=counts)  # fmt: skip
    return model, layout, microbatches * b
