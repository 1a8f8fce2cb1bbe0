from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

from funcpipe.cli.app import _build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def test_demo_prints_comparison_and_falling_loss(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tour", "--microbatches", "3", "--stages", "3", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "3 microbatches" in out
    assert "stage 2" in out and "(fake)" in out
    match = re.search(r"loss (\S+) vs (\S+)\s+max \|grad diff\| (\S+)", out)
    assert match is not None
    assert match[1] == match[2] and float(match[3]) < 1e-10
    losses = [float(v) for v in re.findall(r"step\s+\d+\s+loss (\S+)", out)]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert "unchanged (values, identity, no .grad): True" in out


def test_demo_reports_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tour", "--stages", "99", "--steps", "1"]) == 2
    assert "stages=99" in capsys.readouterr().err


def test_parser_requires_a_command() -> None:
    with pytest.raises(SystemExit):
        _build_parser().parse_args([])


def test_every_subcommand_registers_a_parser_and_a_handler() -> None:
    """One ``register(subparsers)`` per module; the demo's options are a subparser like any."""
    parser = _build_parser()
    for argv in (
        ["demo", "--steps", "3", "--size", "tiny"],
        ["tour"],
        ["schedule", "1f1b", "-p", "2", "-m", "2"],
        ["check", "prog.txt"],
        ["plan", "--layers", "2", "--hidden", "8", "--heads", "2", "--vocab", "16", "--seq", "4",
         "--global-batch", "2", "--gpus", "1", "--gpu", "h100-sxm"],
    ):  # fmt: skip
        args = parser.parse_args(argv)
        assert args.command == argv[0] and callable(args.handler)
    args = parser.parse_args(["demo", "--steps", "3", "--size", "tiny"])
    assert (args.steps, args.size, args.compile_backend) == (3, "tiny", "inductor")


@pytest.mark.parametrize(
    "command", [["demo"], ["tour"], ["schedule", "1f1b", "-p", "2", "-m", "2"]]
)
def test_an_unknown_argument_is_reported_by_its_subcommand(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        main([*command, "--no-such-option"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: funcpipe {command[0]} " in err
    assert f"funcpipe {command[0]}: error: unrecognized arguments: --no-such-option" in err


def test_cli_modules_stay_small() -> None:
    """No module of funcpipe/cli over 600 lines, no function over 80, a docstring on each."""
    import ast

    for path in sorted((ROOT / "funcpipe" / "cli").glob("*.py")):
        text = path.read_text()
        assert len(text.splitlines()) <= 600, path.name
        tree = ast.parse(text)
        assert ast.get_docstring(tree), path.name
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                length = node.end_lineno - node.lineno + 1
                assert length <= 80, f"{path.name}: {node.name} is {length} lines"


def test_quickstart_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(ROOT / "examples" / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "max grad diff" in out and "step 9" in out
