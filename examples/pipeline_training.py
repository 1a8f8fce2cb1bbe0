"""Train an MLP with a 1F1B pipeline on 2 processes; runs unchanged under torchrun.

python examples/pipeline_training.py [--steps 30] [--schedule 1f1b]
torchrun --nproc-per-node 2 examples/pipeline_training.py
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import funcpipe as fp
from funcpipe.schedule import generate


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def train(rank: int, steps: int, schedule: str, ranks: int) -> float:
    torch.manual_seed(0)  # every rank builds the same model and data
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.GELU())])
    program = generate(schedule, ranks=ranks, microbatches=8)
    part = fp.partition(model, stages=program.n_stages, by="parameters")
    pipe = fp.Pipeline(part.stages, program, loss_fn=mse)
    params = part.params
    x, y = torch.randn(64, 32), torch.randn(64, 32)
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        loss, grads = pipe.step(params, x, y)
        # each rank updates the stages it holds; the others keep their (unused) values
        params = tuple(
            p if g is None else {k: v - 0.05 * g[k] for k, v in p.items()}
            for p, g in zip(params, grads, strict=True)
        )
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    if rank == 0:
        print(f"final loss {loss.item():.4f}", flush=True)
    return float(loss)


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args(argv)
    # CPU tensors: gloo (launch picks NCCL by default where CUDA is present)
    return fp.launch(train, args.ranks, args.steps, args.schedule, args.ranks, backend="gloo")


if __name__ == "__main__":
    main()
