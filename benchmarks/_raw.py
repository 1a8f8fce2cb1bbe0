"""The benchmark MLP's stages as bare kernels: the least arithmetic any runtime can do.

A stage of ``k`` x (Linear + GELU) on one microbatch, computed with the aten kernels alone: no
autograd graph, no engine, no runtime. F: per layer ``addmm`` and ``gelu`` (the kernel
funcpipe's chain stages pick by size, :func:`funcpipe.runtime.chain.gelu`; keeping each
layer's input and pre-activation, what autograd keeps too). I: per layer, last first,
``gelu_backward`` and ``mm`` with the weight. W: per layer ``addmm_`` into the weight's
gradient and a column sum into the bias's. B: I and W per layer in one pass. The last stage
adds the mean-squared-error loss and its gradient (scaled by 1 / microbatches, as a pipeline
step's loss is). Each weight's product reads the whole weight once, as the autograd kernels do:
the same products in the same sizes, so these times are what a runtime that computes every
microbatch's gradients one microbatch at a time cannot go below on this machine.

The staged arithmetic (``backward_staged``, ``weight_staged``, ``settle``) is what
``Pipeline(stage_weights=True)`` computes: each B or W copies its Linears' rows (input and
incoming gradient) aside and adds the bias gradient; once per step each weight gradient is one
product over all the step's rows. Here the rows wait in buffers of their own (a runtime that
cost nothing could afford them), so the step's sum reads them without funcpipe's copy out of
the gradient's memory.

Used by ``vs_peer.py`` for its ``raw floor`` and ``staged raw floor`` columns; :func:`check`
compares the gradients with autograd's (the test suite runs it).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks import _common as C
from funcpipe.runtime import chain

Tensor = torch.Tensor


class RawStage:
    """One stage's weights and gradient buffers, and its F, I, W and B as bare kernels."""

    def __init__(self, weights: list[Tensor], biases: list[Tensor], *, sink: bool, scale: float):
        self.w = [t.detach().clone() for t in weights]
        self.b = [t.detach().clone() for t in biases]
        self.gw = [torch.zeros_like(t) for t in self.w]
        self.gb = [torch.zeros_like(t) for t in self.b]
        self.sink = sink
        self.scale = scale  # d loss / d (the mean squared error of one microbatch)

    def forward(self, x: Tensor, y: Tensor | None) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        saved = []
        h = x
        for w, b in zip(self.w, self.b, strict=True):
            a = torch.addmm(b, h, w.t())
            saved.append((h, a))
            h = chain.gelu(a)
        if self.sink:
            assert y is not None
            diff = h - y
            saved.append((diff, diff))
            h = diff.pow(2).mean()
        return h, saved

    def _top(self, saved: list[tuple[Tensor, Tensor]], gy: Tensor | None) -> Tensor:
        if self.sink:
            diff = saved[-1][0]
            return diff * (2.0 * self.scale / diff.numel())
        assert gy is not None
        return gy

    def backward_input(
        self, saved: list[tuple[Tensor, Tensor]], gy: Tensor | None
    ) -> tuple[Tensor, list[tuple[int, Tensor, Tensor]]]:
        g = self._top(saved, gy)
        later = []
        for k in reversed(range(len(self.w))):
            h, a = saved[k]
            g = chain.gelu_backward(g, a)
            later.append((k, g, h))
            g = torch.mm(g, self.w[k])
        return g, later

    def backward_weight(self, later: list[tuple[int, Tensor, Tensor]]) -> None:
        for k, g, h in later:
            self.gw[k].addmm_(g.t(), h)
            self.gb[k].add_(g.sum(0))

    def begin_step(self, rows: int) -> None:
        """Room for ``rows`` staged rows per Linear (a step's, for the staged arithmetic)."""
        self.staged = 0
        self.sg = [torch.empty(rows, w.shape[0], dtype=w.dtype) for w in self.w]
        self.sh = [torch.empty(rows, w.shape[1], dtype=w.dtype) for w in self.w]

    def _stage(self, k: int, g: Tensor, h: Tensor) -> None:
        n = self.staged
        self.sg[k][n : n + g.shape[0]].copy_(g)
        self.sh[k][n : n + h.shape[0]].copy_(h)
        self.gb[k].add_(g.sum(0))

    def backward_staged(self, saved: list[tuple[Tensor, Tensor]], gy: Tensor | None) -> Tensor:
        """B with the weight products' rows staged (:meth:`settle` sums them)."""
        g = self._top(saved, gy)
        for k in reversed(range(len(self.w))):
            h, a = saved[k]
            g = chain.gelu_backward(g, a)
            self._stage(k, g, h)
            g = torch.mm(g, self.w[k])
        self.staged += g.shape[0]
        return g

    def weight_staged(self, later: list[tuple[int, Tensor, Tensor]]) -> None:
        """W with the weight products' rows staged."""
        for k, g, h in later:
            self._stage(k, g, h)
        self.staged += later[0][1].shape[0]

    def settle(self) -> None:
        """Each weight gradient = one product over every staged row (overwrites ``gw``)."""
        n = self.staged
        for k in range(len(self.w)):
            torch.mm(self.sg[k][:n].t(), self.sh[k][:n], out=self.gw[k])
        self.staged = 0

    def backward(self, saved: list[tuple[Tensor, Tensor]], gy: Tensor | None) -> Tensor:
        g = self._top(saved, gy)
        for k in reversed(range(len(self.w))):
            h, a = saved[k]
            g = chain.gelu_backward(g, a)
            self.gw[k].addmm_(g.t(), h)
            self.gb[k].add_(g.sum(0))
            g = torch.mm(g, self.w[k])
        return g


def stages(size: C.Size, n_stages: int, *, seed: int = 0, dtype: Any = None) -> list[RawStage]:
    """The benchmark MLP (``C.mlp``, same seed, same weights) cut into ``n_stages`` raw stages."""
    model = C.mlp(size.width, layers=size.layers, seed=seed, dtype=dtype or torch.float32)
    out = []
    for s, part in enumerate(C.stage_modules(model, n_stages)):
        lins = [m for m in part if isinstance(m, torch.nn.Linear)]
        out.append(
            RawStage(
                [m.weight for m in lins],
                [m.bias for m in lins],
                sink=s == n_stages - 1,
                scale=1.0 / size.microbatches,
            )
        )
    return out


def _one_microbatch(size: C.Size, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """An input, a target and an incoming gradient of one microbatch's shape."""
    mb = size.batch // size.microbatches
    g = torch.Generator().manual_seed(seed + 7)
    x, y, gy = (torch.randn(mb, size.width, generator=g) for _ in range(3))
    return x, y, gy


def measure(size: C.Size, n_stages: int, *, reps: int = 20, seed: int = 0) -> C.StageCosts:
    """Median seconds of each raw stage's F, B, I and W on one microbatch (2 warm-ups)."""
    raw = stages(size, n_stages, seed=seed)
    x, y, gy = _one_microbatch(size, seed)
    times: dict[str, list[list[float]]] = {k: [[] for _ in raw] for k in "fbiw"}
    for rep in range(reps + 2):
        for s, st in enumerate(raw):
            t0 = time.perf_counter()
            _, saved = st.forward(x, y)
            t1 = time.perf_counter()
            st.backward(saved, gy)
            t2 = time.perf_counter()
            _, saved = st.forward(x, y)
            t3 = time.perf_counter()
            _, later = st.backward_input(saved, gy)
            t4 = time.perf_counter()
            st.backward_weight(later)
            t5 = time.perf_counter()
            if rep >= 2:
                times["f"][s] += [t1 - t0, t3 - t2]
                times["b"][s].append(t2 - t1)
                times["i"][s].append(t4 - t3)
                times["w"][s].append(t5 - t4)
    return C.StageCosts(*[[C.median(t) for t in times[k]] for k in "fbiw"])


def measure_staged(
    size: C.Size, n_stages: int, *, reps: int = 20, seed: int = 0
) -> tuple[C.StageCosts, list[float]]:
    """Median seconds of each raw stage's staged arithmetic (2 warm-ups): F, the staged B, I
    and the staged W on one microbatch; and the step's weight sums (one product per Linear over
    all the microbatches' rows)."""
    raw = stages(size, n_stages, seed=seed)
    x, y, gy = _one_microbatch(size, seed)
    m = size.microbatches
    times: dict[str, list[list[float]]] = {k: [[] for _ in raw] for k in ("f", "b", "i", "w", "s")}
    for rep in range(reps + 2):
        for s, st in enumerate(raw):
            got: dict[str, list[float]] = {k: [] for k in times}
            st.begin_step(m * len(x))  # a step's rows: m staged B's, one sum
            for _ in range(m):
                t0 = time.perf_counter()
                _, saved = st.forward(x, y)
                t1 = time.perf_counter()
                st.backward_staged(saved, gy)
                got["f"].append(t1 - t0)
                got["b"].append(time.perf_counter() - t1)
            t2 = time.perf_counter()
            st.settle()
            got["s"].append(time.perf_counter() - t2)
            st.begin_step(m * len(x))  # m I's and staged W's (the sum is timed above)
            for _ in range(m):
                t3 = time.perf_counter()
                _, later = st.backward_input(saved, gy)
                t4 = time.perf_counter()
                st.weight_staged(later)
                got["i"].append(t4 - t3)
                got["w"].append(time.perf_counter() - t4)
            if rep >= 2:
                for k, v in got.items():
                    times[k][s] += v
    med = {k: [C.median(t) for t in v] for k, v in times.items()}
    return C.StageCosts(med["f"], med["b"], med["i"], med["w"]), med["s"]


def check(size: C.Size, n_stages: int, *, seed: int = 0, staged: bool = False) -> float:
    """Largest relative difference (float64) between the raw stages' gradients over a whole batch
    of microbatches (B for even microbatches, I then W for odd ones) and autograd's on the
    model: 0 up to rounding, or the floor would time other arithmetic. ``staged``: the staged
    B and W, each weight summed once at the end (:meth:`RawStage.settle`)."""
    f64 = torch.float64
    model = C.mlp(size.width, layers=size.layers, seed=seed, dtype=f64)
    x, y = C.data(size, dtype=f64, seed=seed + 1)
    want = C.reference_grads(model, x, y, microbatches=size.microbatches)
    raw = stages(size, n_stages, seed=seed, dtype=f64)
    for st in raw if staged else ():
        st.begin_step(size.batch)
    for m, (xm, ym) in enumerate(
        zip(x.chunk(size.microbatches), y.chunk(size.microbatches), strict=True)
    ):
        h, saved_all = xm, []
        for st in raw:
            h, saved = st.forward(h, ym)
            saved_all.append(saved)
        gh: Tensor | None = None
        for st, saved in zip(reversed(raw), reversed(saved_all), strict=True):
            if m % 2 == 0:
                gh = (st.backward_staged if staged else st.backward)(saved, gh)
            else:
                gh, later = st.backward_input(saved, gh)
                (st.weight_staged if staged else st.backward_weight)(later)
    for st in raw if staged else ():
        st.settle()
    got = [t for st in raw for w, b in zip(st.gw, st.gb, strict=True) for t in (w, b)]
    return C.max_rel_diff(got, want)
