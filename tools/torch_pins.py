"""The pins that keep this venv's torch when the ``[models]`` extra (timm, transformers) is
installed: ``make setup`` uses them; docs/models.md explains them.

``pip install timm`` alone resolves ``torchvision`` to its newest release, which requires the
newest torch, so pip replaces a CPU torch with another (CUDA) build. Installing the
torchvision that belongs to the torch already there, with that torch pinned on the same
command line, leaves torch alone. torchvision ``0.(m + 15).p`` is built for torch ``2.m.p``.

    python tools/torch_pins.py torch          # torch==2.13.0+cpu   (the installed one)
    python tools/torch_pins.py torchvision    # torchvision==0.28.0 (its match)
    python tools/torch_pins.py check SPEC     # exit 1 if the installed torch is not SPEC
"""

from __future__ import annotations

import re
import sys

__all__ = ["torchvision_for"]


def torchvision_for(torch_version: str) -> str:
    """The torchvision release built for ``torch_version`` (a local label such as ``+cpu`` is
    ignored): ``"2.13.0" -> "0.28.0"``."""
    found = re.fullmatch(r"2\.(\d+)\.(\d+)(?:[.a-z0-9]*)?(?:\+.*)?", torch_version)
    if found is None or int(found.group(1)) < 1:
        raise ValueError(
            f"torch {torch_version!r}: no torchvision is known to match it (torch 2.1 or later "
            "has torchvision 0.(minor + 15).patch); install torchvision by hand."
        )
    return f"0.{int(found.group(1)) + 15}.{found.group(2)}"


def main(argv: list[str]) -> int:
    import torch

    installed = torch.__version__
    if argv == ["torch"]:
        print(f"torch=={installed}")
    elif argv == ["torchvision"]:
        print(f"torchvision=={torchvision_for(installed)}")
    elif len(argv) == 2 and argv[0] == "check":
        if f"torch=={installed}" != argv[1]:
            print(
                f"torch_pins: the venv's torch is now {installed}, not {argv[1]}: an install "
                "replaced it (see docs/models.md, 'Installing the models extra')",
                file=sys.stderr,
            )
            return 1
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
