"""A decoder-only transformer as the planner sees it: sizes, parameters and FLOPs.

Dense (``experts=0``, the default) or a mixture of experts: ``experts`` FFNs per MoE block of
width ``moe_ffn``, each token routed to ``top_k`` of them, plus ``shared_experts`` every token
goes through; the first ``dense_layers`` blocks keep a dense MLP of width ``ffn`` (DeepSeek's
layout). Attention has ``heads`` query heads and ``kv_heads`` key/value heads (grouped-query) of
``head_dim`` each (default ``hidden / heads``), full causal or, where ``window`` is set, a
sliding window on every block but each ``full_every``-th (GPT-OSS: 128 tokens, every second block
full). The MLP (dense, expert or shared) is ``gelu`` (two matrices), ``swiglu`` or ``geglu`` (a
gate and an up matrix, then a down one: three).

Two FLOP counts: :meth:`Transformer.model_flops_per_token` is the count published numbers are
quoted in (Megatron-LM 2021's for a dense model, Megatron-Bridge's for a mixture of experts);
:meth:`Transformer.forward_flops_per_token` what the GPU actually runs (windows, every matrix,
the router), which the hardware rate counts.
"""

from __future__ import annotations

from dataclasses import dataclass

from funcpipe.errors import InvalidArgument

__all__ = ["MLPS", "Transformer"]

_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

MLPS = ("gelu", "swiglu", "geglu")
"""The MLPs the planner prices: ``gelu`` (up, activation, down: two matrices); ``swiglu`` and
``geglu`` (a gate and an up matrix, their gated product, a down matrix: three; ``geglu`` is any
gate other than SiLU, e.g. GPT-OSS's clamped ``x * sigmoid(1.702 x)``)."""

_POSITIVE = ("layers", "hidden", "heads", "vocab", "seq")


@dataclass(frozen=True)
class Transformer:
    """``layers`` blocks of attention (``heads`` query heads, ``kv_heads`` key/value heads,
    default ``heads``, of ``head_dim`` each, default ``hidden / heads``) and an MLP of width
    ``ffn`` (default ``4 * hidden``; ``mlp`` one of :data:`MLPS`), a ``vocab`` embedding (tied
    to the output layer unless ``tied=False``), sequences of ``seq`` tokens, computed in
    ``dtype`` (matrix products in FP8 with ``fp8=True``). ``flash=True``: attention is one fused
    kernel that keeps no ``seq x seq`` scores; ``False``: scores, softmax and dropout are
    separate ops (Megatron 2021).

    Mixture of experts (``experts > 0``): every block from ``dense_layers`` on replaces its MLP
    by a router and ``experts`` expert MLPs of width ``moe_ffn`` (default ``ffn``), each token
    through ``top_k`` of them and the ``shared_experts`` (each of width ``moe_ffn``). ``window``:
    sliding-window attention of that many tokens on every block but each ``full_every``-th
    (block ``i`` is full when ``(i + 1) % full_every == 0``; ``None``: every block windowed).
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
    head_dim: int | None = None
    mlp: str = "gelu"
    experts: int = 0
    top_k: int = 1
    moe_ffn: int | None = None
    shared_experts: int = 0
    dense_layers: int = 0
    window: int | None = None
    full_every: int | None = None
    fp8: bool = False

    def __post_init__(self) -> None:
        for name in _POSITIVE:
            _check_int(name, getattr(self, name), least=1)
        for name in ("ffn", "kv_heads", "head_dim", "moe_ffn", "window", "full_every"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), least=1)
        for name in ("experts", "top_k", "shared_experts", "dense_layers"):
            _check_int(name, getattr(self, name), least=0)
        if self.head_dim is None and self.hidden % self.heads:
            raise InvalidArgument(
                f"Transformer(hidden={self.hidden}, heads={self.heads}): hidden must be a "
                "multiple of heads (or give head_dim)"
            )
        if self.heads % self.kv:
            raise InvalidArgument(
                f"Transformer(kv_heads={self.kv_heads}): heads={self.heads} must be a multiple"
            )
        if self.dtype not in _BYTES:
            raise InvalidArgument(f"Transformer(dtype={self.dtype!r}): one of {', '.join(_BYTES)}")
        if self.mlp not in MLPS:
            raise InvalidArgument(f"Transformer(mlp={self.mlp!r}): one of {', '.join(MLPS)}")
        if self.fp8 not in (False, True):
            raise InvalidArgument(f"Transformer(fp8={self.fp8!r}): True or False")
        if self.fp8 and self.dtype == "fp32":
            raise InvalidArgument(
                "Transformer(fp8=True, dtype='fp32'): FP8 matrix products run under bf16 or fp16 "
                "mixed precision; pass dtype='bf16'"
            )
        if self.window is None and self.full_every is not None:
            raise InvalidArgument(
                f"Transformer(full_every={self.full_every}): full_every says which blocks skip "
                "the sliding window; give window= too"
            )
        self._check_experts()

    def _check_experts(self) -> None:
        if not self.experts:
            moe = {"top_k": 1, "moe_ffn": None, "shared_experts": 0, "dense_layers": 0}
            given = [f"{k}={getattr(self, k)!r}" for k, v in moe.items() if getattr(self, k) != v]
            if given:
                raise InvalidArgument(
                    f"Transformer({', '.join(given)}): these describe a mixture of experts, and "
                    "experts=0 (a dense model); give experts= too, or leave them out"
                )
            return
        if not 1 <= self.top_k <= self.experts:
            raise InvalidArgument(
                f"Transformer(top_k={self.top_k}, experts={self.experts}): each token goes "
                f"through top_k of the experts, so 1 <= top_k <= experts; pass a top_k of at "
                f"most {self.experts}"
            )
        if self.dense_layers >= self.layers:
            raise InvalidArgument(
                f"Transformer(dense_layers={self.dense_layers}, layers={self.layers}): the "
                "first dense_layers blocks have a dense MLP and the rest experts; leave at "
                "least one MoE block (or pass experts=0 for a dense model)"
            )

    @property
    def ff(self) -> int:
        return 4 * self.hidden if self.ffn is None else self.ffn

    @property
    def kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def head_size(self) -> int:
        """The head dimension: ``head_dim``, or ``hidden / heads`` where it is not given."""
        return self.hidden // self.heads if self.head_dim is None else self.head_dim

    @property
    def q_size(self) -> int:
        """Width of the query (and attention output) projection: ``heads x head_size``."""
        return self.heads * self.head_size

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection: ``kv_heads x head_size``."""
        return self.kv * self.head_size

    @property
    def expert_ffn(self) -> int:
        return self.ff if self.moe_ffn is None else self.moe_ffn

    @property
    def matrices(self) -> int:
        """Matrices of one MLP: 2 (``gelu``), 3 (gated)."""
        return 2 if self.mlp == "gelu" else 3

    @property
    def bytes(self) -> int:
        """Bytes per element of activations and parameters in compute."""
        return _BYTES[self.dtype]

    @property
    def moe_layers(self) -> int:
        """Blocks with experts (0 for a dense model)."""
        return self.layers - self.dense_layers if self.experts else 0

    def is_moe(self, block: int) -> bool:
        """Whether block ``block`` (from 0) has experts instead of a dense MLP."""
        return self.experts > 0 and block >= self.dense_layers

    def windowed(self, block: int) -> bool:
        """Whether block ``block`` (from 0) attends through the sliding window."""
        if self.window is None:
            return False
        return self.full_every is None or (block + 1) % self.full_every != 0

    def context(self, windowed: bool) -> float:
        """Keys each query attends to, on average, under the causal mask (and the window)."""
        s = self.seq
        if not windowed or self.window is None or self.window >= s:
            return s / 2
        w = self.window
        return w - w * (w - 1) / (2 * s)  # (w (w + 1) / 2 + (s - w) w) / s, exactly

    def _attention_params(self) -> int:
        h, q, kvd = self.hidden, self.q_size, self.kv_size
        return h * (q + 2 * kvd) + (q + 2 * kvd) + q * h + h

    def _mlp_params(self, width: int) -> int:
        """One MLP of ``width``: its matrices and biases."""
        return self.matrices * self.hidden * width + (self.matrices - 1) * width + self.hidden

    def layer_params(self) -> int:
        """A dense block's parameters: attention, MLP and two LayerNorms."""
        return self._attention_params() + self._mlp_params(self.ff) + 4 * self.hidden

    def moe_layer_params(self) -> tuple[int, int]:
        """(dense, expert) parameters of an MoE block: attention, norms, router and shared
        experts; the ``experts`` expert MLPs (split over the expert axis)."""
        h, f = self.hidden, self.expert_ffn
        dense = self._attention_params() + 4 * h + h * self.experts
        dense += self.shared_experts * self._mlp_params(f)
        return dense, self.experts * self._mlp_params(f)

    def params(self) -> int:
        """All parameters: blocks, embedding (and output layer if untied), final norm."""
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        dense, expert = self.moe_layer_params()
        blocks = (self.layers - self.moe_layers) * self.layer_params()
        blocks += self.moe_layers * (dense + expert)
        return blocks + emb + 2 * self.hidden

    def _counted_matrices(self) -> int:
        """Matrices of an MLP as Megatron's formula counts them: three only for SwiGLU (its
        ``--swiglu``; Megatron-Bridge up to 26.04 applied the 3/2 to SiLU gates alone)."""
        return 3 if self.mlp == "swiglu" else 2

    def model_flops_per_token(self) -> float:
        """Forward plus backward FLOPs of one token as published numbers count them.

        Dense: ``6 N + 12 L q s`` with ``N`` the matrix parameters (blocks and the output layer;
        biases and norms left out) and the scores' ``12 L q s`` (Megatron-LM 2021's count,
        which its validation uses). Mixture of experts: Megatron-Bridge's count, ``6 x`` the
        matrix parameters a token passes through (attention, the dense MLPs, ``top_k`` plus the
        shared experts, the output layer; no router) plus ``6 q s`` per block for the causal
        half of the scores, every block at full length (windows not discounted) and a gated MLP
        counted with three matrices only for SwiGLU, as Megatron-Bridge's ``flop_utils`` of
        the 26.04 containers did."""
        h, q, kvd, cm = self.hidden, self.q_size, self.kv_size, self._counted_matrices()
        attention = 2 * h * q + 2 * h * kvd
        if not self.experts:
            n = self.layers * (attention + cm * h * self.ff) + self.vocab * h
            return 6.0 * n + 12.0 * self.layers * q * self.seq
        routed = (self.top_k + self.shared_experts) * cm * h * self.expert_ffn
        n = self.layers * attention + self.dense_layers * cm * h * self.ff
        n += self.moe_layers * routed + self.vocab * h
        return 6.0 * n + 6.0 * self.layers * q * self.seq

    def forward_flops_per_token(self, block: int | None = None) -> float:
        """Forward FLOPs of one token through block ``block`` as the GPU runs them (every
        matrix, the router, the window), or with ``None`` through the whole model (the output
        layer included)."""
        if block is None:
            total = sum(self.forward_flops_per_token(i) for i in range(self.layers))
            return total + 2.0 * self.hidden * self.vocab
        h, q, kvd = self.hidden, self.q_size, self.kv_size
        attention = 2.0 * h * (q + 2 * kvd) + 2.0 * q * h
        attention += 4.0 * q * self.context(self.windowed(block))
        if not self.is_moe(block):
            return attention + 2.0 * self.matrices * h * self.ff
        experts = (self.top_k + self.shared_experts) * 2.0 * self.matrices * h * self.expert_ffn
        return attention + experts + 2.0 * h * self.experts


def _check_int(name: str, value: object, *, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        rule = "a positive integer" if least == 1 else "an integer >= 0"
        raise InvalidArgument(f"Transformer({name}={value!r}): {rule}")
