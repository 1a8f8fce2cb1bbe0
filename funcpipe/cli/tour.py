"""``funcpipe tour``: partition an MLP, infer its shapes, check the reference step, train it.

Everything runs in one process on the CPU; it shows the pieces a pipeline is built from.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any, TextIO

import torch
from torch import nn

from funcpipe.cli.args import Subparsers
from funcpipe.pipeline.microbatch import split
from funcpipe.pipeline.reference import reference_step
from funcpipe.stages.partition import partition
from funcpipe.stages.shapes import infer_specs
from funcpipe.tree import tree_leaves, tree_map

__all__ = ["register", "run_demo"]

WIDTHS = (16, 32, 32, 32, 4)


def register(subparsers: Subparsers) -> None:
    """Add the ``tour`` subcommand to ``subparsers``."""
    parser = subparsers.add_parser(
        "tour",
        help="partition an MLP, infer its shapes, check the reference step and train it",
        description="Partition a float64 MLP into stages by parameter count, infer every "
        "stage's shapes without data, compare reference_step with plain autograd on "
        "the whole module, then train with pure SGD updates (one process).",
    )
    parser.add_argument("--microbatches", type=int, default=4, metavar="M", help="default: 4")
    parser.add_argument("--stages", type=int, default=2, metavar="N", help="default: 2")
    parser.add_argument("--steps", type=int, default=20, help="SGD steps (default: 20)")
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    run_demo(microbatches=args.microbatches, stages=args.stages, steps=args.steps)
    return 0


def _mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs - targets) ** 2).mean()


def _build(batch: int) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """A seeded float64 MLP and a regression task (targets from a random teacher)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for i, (w_in, w_out) in enumerate(itertools.pairwise(WIDTHS)):
            layers.append(nn.Linear(w_in, w_out))
            if i + 2 < len(WIDTHS):
                layers.append(nn.Tanh())
        model = nn.Sequential(*layers).to(torch.float64)
        x = torch.randn(batch, WIDTHS[0], dtype=torch.float64)
        teacher = torch.randn(WIDTHS[0], WIDTHS[-1], dtype=torch.float64) / WIDTHS[0] ** 0.5
        y = torch.sin(x @ teacher)
    return model, x, y


def run_demo(
    *,
    microbatches: int = 4,
    stages: int = 2,
    steps: int = 20,
    lr: float = 0.5,
    batch: int = 32,
    file: TextIO | None = None,
) -> float:
    """Run the demo, printing to ``file`` (stdout by default); returns the final loss."""
    out = sys.stdout if file is None else file

    def say(text: str = "") -> None:
        print(text, file=out)

    model, x, y = _build(batch)
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    widths = "-".join(str(w) for w in WIDTHS)
    say(
        f"funcpipe demo: MLP {widths} ({len(model)} layers, float64), batch {batch}, "
        f"{microbatches} microbatches"
    )

    part = partition(model, stages, by="parameters")
    example = split(x, microbatches)[0]
    specs = infer_specs(part.stages, part.params, example)
    say(f'\npartition(model, {stages}, by="parameters") and infer_specs on one microbatch:')
    for i, (stage, stage_params, spec) in enumerate(
        zip(part.stages, part.params, specs, strict=True)
    ):
        count = sum(t.numel() for t in tree_leaves(stage_params))
        say(
            f"  stage {i}  {stage.name:<11} {count:>5} params  "
            f"{spec.inputs} -> {spec.outputs}  ({spec.method})"
        )

    loss, grads = reference_step(
        part.stages, part.params, x, _mse, targets=y, microbatches=microbatches
    )
    # The same step with plain autograd on the whole module (loss = mean over microbatches).
    names = [name for name, _ in model.named_parameters()]
    mb_losses = [
        _mse(model(xb), yb)
        for xb, yb in zip(split(x, microbatches), split(y, microbatches), strict=True)
    ]
    plain_loss = torch.stack(mb_losses).mean()
    plain_grads = torch.autograd.grad(plain_loss, list(model.parameters()))
    ours = {name: g for stage_grads in grads for name, g in stage_grads.items()}
    max_diff = max(
        float((ours[name] - g).abs().max()) for name, g in zip(names, plain_grads, strict=True)
    )
    say("\nreference_step vs plain autograd on the whole module:")
    plain = float(plain_loss.detach())
    say(f"  loss {float(loss):.10f} vs {plain:.10f}   max |grad diff| {max_diff:.1e}")

    say(f"\n{steps} SGD steps, lr={lr}: new params = p - lr * g (no module is touched)")
    params: tuple[Any, ...] = part.params
    shown = {1, steps} | set(range(5, steps + 1, 5))
    for step in range(1, steps + 1):
        loss, grads = reference_step(
            part.stages, params, x, _mse, targets=y, microbatches=microbatches
        )
        if step in shown:
            say(f"  step {step:>3}  loss {float(loss):.6f}")
        params = tuple(
            tree_map(lambda p, g: p - lr * g, p_tree, g_tree)
            for p_tree, g_tree in zip(params, grads, strict=True)
        )
    unchanged = all(
        p is q and torch.equal(p.detach(), saved) and p.grad is None
        for (p, saved), q in zip(before.values(), model.parameters(), strict=True)
    )
    say(f"\nmodule parameters unchanged (values, identity, no .grad): {unchanged}")
    return float(loss)
