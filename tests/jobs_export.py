"""Pool jobs for tests/test_export.py: pretrained transformers weights (a safetensors file)
loaded into a split model's stages with checkpoint.load_safetensors and stepped over 2
processes, against the unsplit model loaded with from_pretrained."""

from __future__ import annotations

from typing import Any

import torch

import funcpipe as fp
from funcpipe.schedule import generate
from funcpipe.train import checkpoint
from tests import models_zoo


def llama_config() -> Any:
    transformers = models_zoo.load("transformers")
    return transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=32, intermediate_size=64, vocab_size=64,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False,
    )  # fmt: skip


def padded_batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    ids = torch.randint(1, 64, (8, 17), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(8, 16, dtype=torch.long)
    mask[:3, :5] = 0
    return {"input_ids": ids[:, :-1], "attention_mask": mask}, ids[:, 1:].masked_fill(
        mask == 0, -100
    )


def token_loss(out: dict[str, torch.Tensor], y: torch.Tensor) -> Any:
    return fp.token_cross_entropy(out["logits"], y)


def fresh_split_loaded(file: str) -> Any:
    """A Llama of other random weights, split in 2 stages, its params then filled from
    ``file``."""
    transformers = models_zoo.load("transformers")
    torch.manual_seed(123)  # not the pretrained model's weights
    model = transformers.LlamaForCausalLM(llama_config())
    fields, _ = padded_batch()
    parts = fp.split_module(model, 2, example={k: v[:2] for k, v in fields.items()})
    return parts, checkpoint.load_safetensors(file, parts.params)


def pretrained_step(rank: int, file: str) -> dict[str, Any]:
    """Pipeline 2 over 2 processes on the loaded weights: the loss and this process's grads."""
    parts, params = fresh_split_loaded(file)
    fields, labels = padded_batch()
    pipe = fp.Pipeline(
        parts.stages,
        generate("1f1b", ranks=2, microbatches=4),
        loss_fn=token_loss,
        side_inputs=parts.side_inputs,
        ties=parts.ties,
    )
    params = pipe.held(params)
    loss, grads = pipe.step(params, parts.batch(fields), labels)
    pipe.close()
    return {"loss": float(loss), "grads": [g for g in grads if g is not None]}
