"""The demo's GPT on one GPU against the best plain single-GPU code: tokens/s, MFU and CUDA time
per training step (forward, backward, optimizer), eager and compiled.

Two models of the same shape (the demo's ``--size``: 24 blocks of width 1024, 16 heads, sequences
of 1024 tokens, a 256-token vocabulary, tied embedding), the same batch and microbatches:

- ``nanogpt``: written here in plain PyTorch, independently of funcpipe (``nn.Linear`` layers,
  fused qkv, ``F.scaled_dot_product_attention``, float32 parameters under bf16 autocast,
  ``loss.backward()`` per microbatch, ``torch.optim.AdamW(fused=True)`` on CUDA): the baseline;
- ``funcpipe``: ``funcpipe.models.gpt`` as one stage of a one-rank ``Pipeline`` (1F1B), the
  functional AdamW; in ``--precision bf16-master`` (bf16 parameters, float32 gradient sums
  ``grad_dtype``, float32 master weights: no weight cast inside a microbatch) and
  ``fp32-autocast`` (float32 parameters under bf16 autocast, as the baseline).

Each runs eager and ``torch.compile``d (``--compile`` modes: ``none``, ``default``,
``reduce-overhead`` for CUDA graphs where the model allows it), after warm-up steps. The CUDA
time of one step is the sum of its kernels' device time (torch.profiler). A compiled run also
records the graphs dynamo made and its graph breaks with their reasons (the aim: one graph per
model; on 2026-11-27 the compiled GPT on an H100 ran in several compiled regions, each entered
24 times a microbatch: a break per block). Results are printed and
written, one JSON line per run as it ends, to ``--out`` (on the device tool: ``$OUT``)::

    python3 benchmarks/gpu_profile.py --out $OUT/profile.jsonl [--size large] [--steps 6]

On the CPU it runs too (``--device cpu --size tiny``: what the tests run), for the code's sake,
not the numbers'.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.utils import counters

import funcpipe as fp
from benchmarks.dispatch import NanoBlock
from funcpipe.cli.demo import SIZES
from funcpipe.models import gpt
from funcpipe.schedule import generate
from funcpipe.tree import tree_map

PEAK_BF16 = {"cuda": 989e12, "cpu": 1e12}  # H100 SXM dense bf16 (an H200 has the same peak)
PRECISIONS = ("bf16-master", "fp32-autocast")
COMPILE = ("none", "default", "reduce-overhead")


class NanoGPT(nn.Module):
    """A nanoGPT-style decoder: token and position embeddings, pre-norm blocks, a final norm and
    an LM head tied to the token embedding."""

    def __init__(self, cfg: gpt.GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.wte = nn.Embedding(cfg.vocab, d)
        self.wpe = nn.Embedding(cfg.context, d)
        self.blocks = nn.ModuleList(
            NanoBlock(d, cfg.heads, cfg.mlp, torch.float32) for _ in range(cfg.layers)
        )
        self.ln_f = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids: Tensor, targets: Tensor) -> Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.wte(ids) + self.wpe(pos)
        for block in self.blocks:
            h = block(h)
        logits = F.linear(self.ln_f(h), self.wte.weight)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def nanogpt_step(
    cfg: gpt.GPTConfig, x: Tensor, y: Tensor, m: int, compile_mode: str
) -> Callable[[], None]:
    """One training step of the baseline: m microbatches under bf16 autocast, then AdamW."""
    dev = x.device
    torch.manual_seed(0)
    model = NanoGPT(cfg).to(dev)
    fwd: Callable[[Tensor, Tensor], Tensor] = model
    if compile_mode != "none":
        fwd = torch.compile(model, mode=None if compile_mode == "default" else compile_mode)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=dev.type == "cuda")

    def step() -> None:
        for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = fwd(xs, ys) / m
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def funcpipe_step(
    cfg: gpt.GPTConfig, x: Tensor, y: Tensor, m: int, compile_mode: str, precision: str
) -> Callable[[], None]:
    """One training step of funcpipe's GPT: a one-rank Pipeline (1F1B), then the pure AdamW."""
    dev = x.device
    axis = gpt.single_axis()
    low = precision == "bf16-master"
    params: Any = gpt.split(gpt.init(cfg, seed=0, device=dev), cfg, 1)
    stage = gpt.stages(cfg, 1, axis=axis)[0]
    if low:
        params = tree_map(lambda t: t.to(torch.bfloat16), params)
    else:
        stage = fp.autocast_stage(stage, torch.bfloat16)
    if compile_mode != "none":
        stage = fp.compile_stage(stage, mode=None if compile_mode == "default" else compile_mode)
    pipe = fp.Pipeline(
        [stage],
        generate("1f1b", ranks=1, microbatches=m),
        loss_fn=gpt.loss_fn(axis=axis),
        grad_dtype=torch.float32 if low else None,
    )
    opt = fp.optim.adamw(3e-4, master_weights=low)
    state = {"params": params, "opt": opt.init(params)}

    def step() -> None:
        out = pipe.step(state["params"], x, y)
        state["params"], state["opt"] = opt.update(out.grads, state["opt"], state["params"])

    return step


def _cuda_time_ms(step: Callable[[], None], sync: Callable[[], None]) -> float | None:
    """The summed device time of one step's kernels (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    total = sum(e.self_device_time_total for e in prof.key_averages())
    return total / 1e3


def measure(
    name: str, step: Callable[[], None], *, steps: int, warmup: int, device: torch.device
) -> dict[str, float | None]:
    sync = _sync(device)
    for _ in range(warmup):
        step()
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    dt = (time.perf_counter() - t) / steps
    return {"step_ms": 1e3 * dt, "cuda_ms": _cuda_time_ms(step, sync)}


@contextlib.contextmanager
def _writer(path: str) -> Iterator[Callable[[dict[str, Any]], None]]:
    f = open(path, "a") if path else None  # noqa: SIM115 (kept open across runs)

    def write(row: dict[str, Any]) -> None:
        print(json.dumps(row), flush=True)
        if f is not None:
            f.write(json.dumps(row) + "\n")
            f.flush()

    try:
        yield write
    finally:
        if f is not None:
            f.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="large", choices=list(SIZES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--microbatches", type=int, default=0, help="default: the size's")
    ap.add_argument("--models", default="nanogpt,funcpipe")
    ap.add_argument("--precisions", default=",".join(PRECISIONS))
    ap.add_argument("--compile", default="none,default", help=f"from {', '.join(COMPILE)}")
    ap.add_argument("--out", default="", help="append one JSON line per run here")
    o = ap.parse_args(argv)
    size = SIZES[o.size]
    cfg = gpt.GPTConfig(
        vocab=256, context=size.context, d_model=size.d_model, heads=size.heads, layers=size.layers
    )
    dev = torch.device(o.device)
    m = o.microbatches or size.microbatches
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (size.batch, cfg.context + 1), generator=g).to(dev)
    x, y = tokens[:, :-1], tokens[:, 1:]
    ntok = x.numel()
    fpt = gpt.flops_per_token(cfg)
    peak = PEAK_BF16.get(dev.type, math.nan)
    runs: list[tuple[str, str, str, Callable[[], Callable[[], None]]]] = []
    for mode in o.compile.split(","):
        if "nanogpt" in o.models:
            runs.append(
                (
                    "nanogpt",
                    "fp32-autocast",
                    mode,
                    lambda mode=mode: nanogpt_step(cfg, x, y, m, mode),
                )
            )
        if "funcpipe" in o.models:
            for prec in o.precisions.split(","):
                runs.append(
                    (
                        "funcpipe",
                        prec,
                        mode,
                        lambda mode=mode, prec=prec: funcpipe_step(cfg, x, y, m, mode, prec),
                    )
                )
    with _writer(o.out) as write:
        for model, prec, mode, build in runs:
            row: dict[str, Any] = {
                "model": model, "precision": prec, "compile": mode, "size": o.size,
                "microbatches": m, "tokens_per_step": ntok, "device": str(dev),
                "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None,
                "torch": torch.__version__,
            }  # fmt: skip
            if mode != "none":  # count this run's graphs and breaks alone
                torch._dynamo.reset()
                counters.clear()
            try:
                got = measure(model, build(), steps=o.steps, warmup=o.warmup, device=dev)
            except Exception as e:  # one failing run must not lose the others' numbers
                row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                write(row)
                continue
            dt = got["step_ms"] / 1e3  # type: ignore[operator]
            row.update(got, tokens_per_s=ntok / dt, mfu=ntok * fpt / dt / peak)
            if mode != "none":  # one graph per model is the aim: a break per block costs
                breaks = counters["graph_break"]
                row.update(
                    graphs=int(counters["stats"]["unique_graphs"]),
                    graph_breaks=int(sum(breaks.values())),
                    break_reasons=[str(k)[:200] for k, _ in breaks.most_common(3)],
                )
            write(row)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
