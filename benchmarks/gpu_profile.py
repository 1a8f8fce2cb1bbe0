"""Where a CUDA step of the demo's GPT spends its time: the same model and microbatches stepped
(a) as plain PyTorch (forward, ``loss.backward()`` per microbatch, gradients accumulated in
``.grad``), (b) as a one-rank funcpipe Pipeline (1F1B, the demo's path), and (c) the top CUDA
kernels of (b) from torch.profiler. Run on a GPU machine::

    python3 benchmarks/gpu_profile.py [--size large] [--steps 6] [--json out.json]

It answers whether a low MFU in the demo is the model's (a is as slow) or funcpipe's (b slower).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

import funcpipe as fp
from funcpipe.cli.demo import SIZES
from funcpipe.models import gpt
from funcpipe.schedule import generate
from funcpipe.tree import tree_leaves, tree_structure, tree_unflatten


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="large", choices=list(SIZES))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default="")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=0, help="override the size's layers")
    o = ap.parse_args()
    size = SIZES[o.size]
    cfg = gpt.GPTConfig(
        vocab=256,
        context=size.context,
        d_model=size.d_model,
        heads=size.heads,
        layers=o.layers or size.layers,
    )
    dev = torch.device(o.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    axis = gpt.single_axis()
    full = gpt.init(cfg, seed=0, device=dev)
    params = gpt.split(full, cfg, 1)
    stage = fp.autocast_stage(gpt.stages(cfg, 1, axis=axis)[0], torch.bfloat16)
    if o.compile:
        stage = fp.compile_stage(stage)
    loss_fn = gpt.loss_fn(axis=axis)
    m = size.microbatches
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (size.batch, cfg.context + 1), generator=g).to(dev)
    x, y = tokens[:, :-1], tokens[:, 1:]
    ntok = x.numel()
    fpt = gpt.flops_per_token(cfg)
    out: dict[str, Any] = {"size": o.size, "tokens_per_step": ntok, "compile": o.compile}

    def plain() -> None:
        leaves = [t.detach().requires_grad_() for t in tree_leaves(params)]
        tree = tree_unflatten(tree_structure(params), leaves)
        for xs, ys in zip(x.chunk(m), y.chunk(m), strict=True):
            (loss_fn(stage.fn(tree[0], xs), ys) / m).backward()

    pipe = fp.Pipeline([stage], generate("1f1b", ranks=1, microbatches=m), loss_fn=loss_fn)

    def funcpipe_step() -> None:
        pipe.step(params, x, y)

    for name, fn in (("plain", plain), ("funcpipe", funcpipe_step)):
        for _ in range(2):
            fn()
        sync()
        t = time.perf_counter()
        for _ in range(o.steps):
            fn()
        sync()
        dt = (time.perf_counter() - t) / o.steps
        out[f"{name}_step_ms"] = 1e3 * dt
        out[f"{name}_tokens_per_s"] = ntok / dt
        out[f"{name}_mfu"] = ntok * fpt / dt / 989e12  # the H100 SXM dense bf16 peak
        print(f"{name}: {1e3 * dt:.1f} ms/step, {ntok / dt:,.0f} tokens/s", flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        funcpipe_step()
        sync()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(table)
    out["profile_top"] = table
    if o.json:
        with open(o.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
