"""``funcpipe checkpoint export RUN --out FILE``: a run's checkpoint as one safetensors file of
the model's parameters, whole, under the model's own names
(:func:`funcpipe.train.checkpoint.export`; one process, no process group)."""

from __future__ import annotations

import argparse

import torch

from funcpipe.cli.args import Subparsers

__all__ = ["register"]

_DTYPES = {"saved": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def register(subparsers: Subparsers) -> None:
    """Add the ``checkpoint`` subcommand (and its ``export``) to ``subparsers``."""
    parser = subparsers.add_parser(
        "checkpoint",
        help="export a run's checkpoint to a safetensors file other tools load",
        description="Work with the checkpoints funcpipe.train.checkpoint.save_model writes.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    export = actions.add_parser(
        "export",
        help="the model's parameters, whole, by its own names, in one .safetensors file",
        description="Read a save_model checkpoint (at any stage split, tensor layout or ZeRO "
        "level) in this one process and write its parameters whole, under the model's names "
        "(for split_module: the state_dict names), to a .safetensors file; a transformers model "
        "loads it with from_pretrained beside its config.json. The optimizer state is left out.",
    )
    export.add_argument(
        "run", metavar="RUN", help="a checkpoint directory, or a run's --out (its newest one)"
    )
    export.add_argument("--out", required=True, metavar="FILE", help="the .safetensors file")
    export.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default="saved",
        help="floating-point tensors in this dtype (default: saved, the model's own)",
    )
    export.set_defaults(handler=_export)


def _export(args: argparse.Namespace) -> int:
    from funcpipe.train import checkpoint

    done = checkpoint.export(args.run, args.out, dtype=_DTYPES[args.dtype])
    mib = done["bytes"] / 2**20
    print(
        f"exported {done['tensors']} tensors ({mib:.1f} MiB, step {done['step']}) from "
        f"{done['checkpoint']} to {done['out']}"
    )
    return 0
