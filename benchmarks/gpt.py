"""The benchmarks' transformer: a small GPT written the way PyTorch users write one.

``gpt(...)`` returns ``nn.Sequential(Embed, *Block, Head)``: token + learned position
embedding; ``layers`` pre-LayerNorm blocks (causal multi-head self-attention with one fused
qkv Linear and ``scaled_dot_product_attention(..., is_causal=True)``, an output projection and
a residual; LayerNorm, Linear(d, 4d), GELU, Linear(4d, d) and a residual); a final LayerNorm
and a Linear head over the vocabulary. The loss is cross-entropy on next-token targets
(:func:`lm_loss`). The inputs are int64 token ids, so an integer tensor enters stage 0 and
only floating activations cross between stages.

A pipeline cuts the Sequential between blocks: the embedding goes with the first blocks and
the head with the last ones (``benchmarks._common.bounds``), the same cut for funcpipe
(``funcpipe.partition(..., by=cuts)``) and for torch.distributed.pipelining (a
``PipelineStage`` of each slice).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

Tensor = torch.Tensor


class Embed(nn.Module):
    """Token embedding plus a learned position embedding: (b, s) int64 -> (b, s, d)."""

    def __init__(self, vocab: int, d_model: int, seq: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model, dtype=dtype)
        self.pos = nn.Embedding(seq, d_model, dtype=dtype)

    def forward(self, ids: Tensor) -> Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.tok(ids) + self.pos(positions)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: (b, s, d) -> (b, s, d)."""

    def __init__(self, d_model: int, heads: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} is not a multiple of heads={heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model, dtype=dtype)
        self.qkv = nn.Linear(d_model, 3 * d_model, dtype=dtype)
        self.proj = nn.Linear(d_model, d_model, dtype=dtype)
        self.ln2 = nn.LayerNorm(d_model, dtype=dtype)
        self.fc = nn.Linear(d_model, 4 * d_model, dtype=dtype)
        self.out = nn.Linear(4 * d_model, d_model, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (b, heads, s, d / heads)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection: (b, s, d) -> (b, s, vocab) logits."""

    def __init__(self, d_model: int, vocab: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model, dtype=dtype)
        self.lm = nn.Linear(d_model, vocab, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.lm(self.ln(x))


def gpt(
    *,
    d_model: int,
    layers: int,
    heads: int,
    seq: int,
    vocab: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> nn.Sequential:
    """``nn.Sequential(Embed, *layers x Block, Head)`` with weights drawn from ``seed``.

    The weights are drawn in float64 from one ``torch.Generator`` and cast to ``dtype``, so a
    float32 and a float64 model of one seed hold the same weights up to rounding.
    """
    model = nn.Sequential(
        Embed(vocab, d_model, seq, dtype=dtype),
        *[Block(d_model, heads, dtype=dtype) for _ in range(layers)],
        Head(d_model, vocab, dtype=dtype),
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            w = torch.randn(p.shape, generator=g, dtype=torch.float64)
            leaf = name.rsplit(".", 2)
            if name.endswith(("tok.weight", "pos.weight")):
                w *= 0.02
            elif leaf[-2].startswith("ln"):  # LayerNorm: near the identity, not exactly
                w = (1.0 + 0.1 * w) if leaf[-1] == "weight" else 0.1 * w
            elif leaf[-1] == "weight":  # Linear: variance 1 / fan_in; residual branches smaller
                w /= math.sqrt(p.shape[1])
                if leaf[-2] in ("proj", "out"):
                    w /= math.sqrt(2 * layers)
            else:
                w *= 0.02
            p.copy_(w)
    return model


def tokens(batch: int, seq: int, vocab: int, *, seed: int = 1) -> tuple[Tensor, Tensor]:
    """Random int64 token ids ``(batch, seq)`` and their next-token targets (the ids shifted
    by one)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy of ``(b, s, vocab)`` logits against ``(b, s)`` next-token ids (mean over
    tokens), in float32 when the logits are bf16 or float16 (stages under autocast)."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
