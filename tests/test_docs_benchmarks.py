"""Every benchmark command shown in docs/benchmarks.md names a script and options that exist.

Each command's arguments go through the script's own ``main`` up to its argument parser, which
is stopped right after parsing: nothing is measured, but a renamed script, a removed option or
a bad choice in the docs fails here.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"


class _Parsed(Exception):
    pass


def _commands(text: str) -> list[list[str]]:
    """The ``python benchmarks/<name>.py ...`` lines of the doc's ``sh`` blocks, as argv lists."""
    out = []
    blocks = re.findall(r"^[ \t]*```sh\n(.*?)^[ \t]*```", text, flags=re.MULTILINE | re.DOTALL)
    for block in blocks:  # (a block may be indented under a list item)
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and "=" in words[0] and not words[0].startswith("-"):
                words = words[1:]  # environment assignments before the command
            if len(words) > 1 and words[0] == "python" and words[1].startswith("benchmarks/"):
                out.append(words[1:])
    return out


COMMANDS = _commands(DOC.read_text())


def test_the_doc_shows_commands() -> None:
    scripts = {argv[0] for argv in COMMANDS}
    assert {
        "benchmarks/vs_peer.py",
        "benchmarks/vs_simulated.py",
        "benchmarks/memory.py",
    } <= scripts


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(a)[:80] for a in COMMANDS])
def test_doc_command_parses(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    script = ROOT / argv[0]
    assert script.is_file(), f"docs/benchmarks.md runs {argv[0]}, which does not exist"
    module = importlib.import_module("benchmarks." + script.stem)
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(
        self: argparse.ArgumentParser, args: Any = None, namespace: Any = None
    ) -> Any:
        parse(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(_Parsed):
        if inspect.signature(module.main).parameters:
            module.main(argv[1:])
        else:  # a main() that reads sys.argv itself
            module.main()


def test_the_benchmarks_readme_lists_every_script() -> None:
    """benchmarks/README.md's table names each script once, and only scripts that exist."""
    text = (ROOT / "benchmarks" / "README.md").read_text()
    listed = set(re.findall(r"^\| `(\w+\.py)` \|", text, flags=re.MULTILINE))
    scripts = {
        p.name
        for p in (ROOT / "benchmarks").glob("*.py")
        if not p.name.startswith("_") and "def main(" in p.read_text()
    }
    assert listed == scripts
