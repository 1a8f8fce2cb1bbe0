"""`funcpipe demo --experts`: the MoE GPT over pipeline 2 x expert 2 processes trains, reports
each expert's load, resumes exactly, resumes at another expert layout, and refuses bad
options before any process starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.test_demo import _demo

MODEL = ["--experts", "4", "--top-k", "2", "--pipeline", "2"]
MOE = [*MODEL, "--expert", "2"]


@pytest.mark.timeout(300)
def test_the_moe_demo_trains_and_reports_the_expert_load(tmp_path: Path) -> None:
    out = _demo(*MOE, "--steps", "4", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    o = s["options"]
    assert (o["tensor"], o["data"], o["expert"], s["zero"]) == (1, 2, 2, 1)  # ZeRO-1
    assert s["final_val_loss"] < s["first_val_loss"]
    # every token of validation batch 0 (4 sequences of 16) goes to 2 of the 4 experts
    assert set(s["expert_load"]) == {"0", "1"}
    for block in ("0", "1"):
        assert sum(s["expert_load"][block]) == sum(s["expert_load_init"][block]) == 4 * 16 * 2
        assert len(s["expert_load"][block]) == 4
    assert "expert load" in out.stdout and "(expert 2)" in out.stdout


@pytest.mark.timeout(400)
def test_the_moe_demo_resumes_exactly_and_at_another_expert_layout(tmp_path: Path) -> None:
    """Stopped at step 2 and resumed: the same losses as the straight run; resumed at pipeline
    1 x tensor 2 x expert 2 with --moe-tensor tokens instead (each tensor rank routing half
    the tokens, one of the 4 experts on each of the 4 processes, read from the checkpoint the
    pipeline-2 x expert-2 run wrote, where each held 2): the same losses to float32
    rounding."""
    common = [*MOE, "--steps", "4", "--eval-every", "0"]
    runs = {k: tmp_path / k for k in ("straight", "again", "moved")}
    assert _demo(*common, "--out", str(runs["straight"])).returncode == 0
    assert _demo(*common, "--stop-after", "2", "--out", str(runs["again"])).returncode == 0
    shutil.copytree(runs["again"], runs["moved"])  # (the same stopped run, resumed two ways)
    assert _demo(*common, "--out", str(runs["again"]), "--resume").returncode == 0
    moved = ["--experts", "4", "--top-k", "2", "--pipeline", "1", "--expert", "2", "--tensor",
             "2", "--data", "2", "--moe-tensor", "tokens", "--steps", "4",
             "--eval-every", "0"]  # fmt: skip
    out = _demo(*moved, "--out", str(runs["moved"]), "--resume")
    assert out.returncode == 0, out.stderr[-3000:]
    hist = {k: json.loads((v / "history.json").read_text())["train"] for k, v in runs.items()}
    assert hist["again"] == hist["straight"]
    assert [r[0] for r in hist["moved"]] == [r[0] for r in hist["straight"]]
    for (_, want, *_), (_, got, *_) in zip(hist["straight"], hist["moved"], strict=True):
        assert got == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--expert", "2"], "--expert 2 splits the experts"),
        (["--experts", "3", "--expert", "2"], "--experts 3 do not divide over --expert 2"),
        (["--experts", "6", "--expert", "3", "--data", "4"], "expert=3 does not divide"),
        (
            ["--experts", "4", "--expert", "2", "--tensor", "4", "--moe-tensor", "tokens"],
            "do not divide over --expert 2 x --tensor 4 (--moe-tensor tokens)",
        ),
        (
            [
                "--experts",
                "3",
                "--tensor",
                "3",
                "--moe-tensor",
                "tokens",
                "--heads",
                "3",
                "--d-model",
                "48",
                "--context",
                "16",
                "--batch",
                "1",
                "--microbatches",
                "1",
            ],
            "1 x 16 tokens do not divide over --tensor 3",
        ),
        (["--experts", "4", "--top-k", "5"], "top_k=5"),
    ],
)
def test_bad_expert_options_are_refused(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from funcpipe.cli.app import main

    assert main(["demo", *argv]) == 2
    assert said in capsys.readouterr().err
