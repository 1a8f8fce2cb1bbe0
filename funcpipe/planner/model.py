"""A decoder-only transformer as the planner sees it: sizes, parameters and FLOPs."""

from __future__ import annotations

from dataclasses import dataclass

from funcpipe.errors import InvalidArgument

__all__ = ["Transformer"]

_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Transformer:
    """``layers`` blocks of attention (``heads`` query heads, ``kv_heads`` key/value heads,
    default ``heads``) and a two-matrix MLP of width ``ffn`` (default ``4 * hidden``), a
    ``vocab`` embedding (tied to the output layer unless ``tied=False``), sequences of ``seq``
    tokens, computed in ``dtype``. ``flash=True``: attention is one fused kernel that keeps no
    ``seq x seq`` scores; ``False``: scores, softmax and dropout are separate ops (Megatron 2021).
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int | None = None
    kv_heads: int | None = None
    tied: bool = True
    dtype: str = "bf16"
    flash: bool = True

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"Transformer({name}={value!r}): a positive integer")
        if self.hidden % self.heads:
            raise InvalidArgument(
                f"Transformer(hidden={self.hidden}, heads={self.heads}): hidden must be a "
                "multiple of heads"
            )
        if self.heads % self.kv:
            raise InvalidArgument(
                f"Transformer(kv_heads={self.kv_heads}): heads={self.heads} must be a multiple"
            )
        if self.dtype not in _BYTES:
            raise InvalidArgument(f"Transformer(dtype={self.dtype!r}): one of {', '.join(_BYTES)}")

    @property
    def ff(self) -> int:
        return 4 * self.hidden if self.ffn is None else self.ffn

    @property
    def kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def bytes(self) -> int:
        """Bytes per element of activations and parameters in compute."""
        return _BYTES[self.dtype]

    def layer_params(self) -> int:
        h, kvd = self.hidden, self.kv * self.head_dim
        attn = h * (h + 2 * kvd) + (h + 2 * kvd) + h * h + h
        mlp = 2 * h * self.ff + self.ff + h
        return attn + mlp + 4 * h  # two LayerNorms

    def params(self) -> int:
        """All parameters: blocks, embedding (and output layer if untied), final norm."""
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * self.layer_params() + emb + 2 * self.hidden

    def model_flops_per_token(self) -> float:
        """Forward plus backward FLOPs of one token, no recompute: ``6 N + 12 L h s`` with
        ``N`` the matrix parameters (blocks and the output layer; biases and norms left out,
        as Megatron's formula does) and the attention scores' ``12 L h s``."""
        h, kvd = self.hidden, self.kv * self.head_dim
        n = self.layers * (2 * h * h + 2 * h * kvd + 2 * h * self.ff) + self.vocab * h
        return 6.0 * n + 12.0 * self.layers * self.hidden * self.seq
