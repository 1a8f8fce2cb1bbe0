"""Tiny third-party models (transformers GPT-2 and Llama, a timm ViT), random weights, float64.

Built from configs, never downloaded. ``load(name)`` skips the calling test with the reason when
the package is missing (``pip install -e '.[models]'``).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import pytest
import torch


def _torchvision_ops_shim() -> None:
    """A torchvision wheel built for CUDA beside a CPU-only torch cannot load its compiled ops,
    and its import then fails registering fake kernels for two of them (``torchvision::nms``,
    ``torchvision::qnms``); transformers and timm import torchvision when it is installed. The
    models here use none of its ops: declaring the two schemas lets the import go through.
    On a torchvision built for this torch (``make setup`` installs it from the index torch came
    from) this does nothing."""
    try:
        importlib.import_module("torchvision")
        return
    except ModuleNotFoundError:
        return
    except RuntimeError as e:
        if "torchvision::nms" not in str(e):
            raise
    for op in ("nms", "qnms"):
        with contextlib.suppress(RuntimeError):  # already declared
            torch.library.define(
                f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
            )


def load(package: str) -> Any:
    """``import package`` or skip the test, saying how to install it."""
    _torchvision_ops_shim()
    try:
        return importlib.import_module(package)
    except ImportError as e:
        pytest.skip(f"{package} is not installed ({e}); pip install -e '.[models]'")


VOCAB = 64


def gpt2() -> torch.nn.Module:
    """GPT-2, 4 blocks, width 32, token embedding tied to the LM head."""
    transformers = load("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).double()


def llama() -> torch.nn.Module:
    """Llama, 4 blocks, width 32, 4 query heads over 2 key/value heads (GQA), rotary."""
    transformers = load("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).double()


def vit() -> torch.nn.Module:
    """A timm ViT: 16x16 images in 4x4 patches, 4 blocks, width 32, 10 classes."""
    timm = load("timm")
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=4, embed_dim=32,
        depth=4, num_heads=2, num_classes=10,
    )  # fmt: skip
    return model.double().eval()


def mixtral() -> torch.nn.Module:
    """Mixtral, 2 blocks of 4 experts (top 2), router logits and the auxiliary load-balancing
    loss in its output; the experts as one batched matmul (``batched_mm``: traceable, and it
    runs in float64, which the default ``grouped_mm`` refuses)."""
    transformers = load("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.01, use_cache=False,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config).double()
    if not hasattr(model, "set_experts_implementation"):
        pytest.skip(f"transformers {transformers.__version__} has no set_experts_implementation")
    model.set_experts_implementation("batched_mm")
    return model


def qwen2_moe() -> torch.nn.Module:
    """Qwen2-MoE, 2 blocks of 4 routed experts (top 2) and a gated shared expert, its
    auxiliary loss in its output; batched experts as for :func:`mixtral`."""
    transformers = load("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2, output_router_logits=True,
        use_cache=False,
    )  # fmt: skip
    model = transformers.Qwen2MoeForCausalLM(config).double()
    if not hasattr(model, "set_experts_implementation"):
        pytest.skip(f"transformers {transformers.__version__} has no set_experts_implementation")
    model.set_experts_implementation("batched_mm")
    return model
