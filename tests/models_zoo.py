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
