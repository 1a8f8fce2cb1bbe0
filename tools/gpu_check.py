"""``make gpu-check``: everything funcpipe checks on a CUDA machine, in one report.

Run from the repository root::

    python3 tools/gpu_check.py [--out gpu-check] [--steps 20]   # works with funcpipe not importable

It is a script of the repository, not part of the installed package.

``--out`` is a folder (on the device tool: ``--out $OUT/gpu-check``). Everything is written there
as it happens, so a check killed at any point still leaves what ran: ``gpu-check.md`` (the report,
rewritten after each part), ``pytest.log`` and ``demo.log`` (streamed), ``junit.xml``, and the
demo's ``summary.json`` and ``step_timeline.png``. By default the tests get 270 s and the demo
180 s: the whole check fits 8 minutes of one device session. A part that runs past its time is
killed with every process it started (the demo's rank processes too).

Without CUDA it prints one line, ``no CUDA device: gpu-check skipped (<why>)``, writes a report
that says so and exits 0. With CUDA it runs

1. ``pytest tests/test_cuda.py tests/test_devices.py`` (every schedule against the reference on
   the GPU, bf16 autocast, the GPT, a one-rank NCCL group through ``transport="dist"``,
   checkpoints, clipping, kernel timing), each test's result read from pytest's JUnit XML;
2. the demo on CUDA for a few steps (``funcpipe demo --device cuda``, one GPU per rank): its
   tokens/s, model FLOPs utilisation, each rank's peak
   ``torch.cuda.max_memory_allocated``, measured and simulated bubble (its ``summary.json``);

and writes ``gpu-check.md``: the date, the device, torch, CUDA and NCCL versions,
each check's result (pass, fail or skip with the reason) and the demo's numbers. The exit status
is 1 when a check failed, else 0.

This module imports nothing from funcpipe at the top (its own process only needs torch), so it
can say what is missing (optree, say: docs/gpu.md) on a machine where funcpipe does not import.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["main"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = ("tests/test_cuda.py", "tests/test_devices.py")
NEEDED = ("optree", "einops", "pytest", "hypothesis")  # beside torch, for funcpipe and its tests
SKIP_LINE = "no CUDA device: gpu-check skipped"
SUMMARY_KEYS = (  # the demo's summary.json numbers the report shows beside tokens/s and MFU
    "final_train_loss",
    "final_val_loss",
    "bubble_measured",
    "bubble_simulated",
    "makespan_measured_ms",
    "makespan_simulated_ms",
)


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``result`` is ``pass``, ``fail`` or ``skip``."""

    name: str
    result: str
    detail: str = ""


@dataclass
class Demo:
    """What the demo run gave (``ran`` False: ``note`` says why it did not run)."""

    ran: bool = False
    ok: bool = False
    note: str = ""
    command: str = ""
    seconds: float = 0.0
    tokens_per_s: float | None = None
    mfu: float | None = None
    numbers: dict[str, float] = field(default_factory=dict)  # more of the demo's summary
    peaks: dict[int, int] = field(default_factory=dict)  # rank -> max_memory_allocated bytes
    tail: str = ""


# ----------------------------------------------------------------------------- the machine
def no_cuda_reason() -> str | None:
    """Why this process cannot use CUDA, or None when it can."""
    try:
        import torch
    except ImportError as e:
        return f"torch does not import: {e}"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f"; CUDA_VISIBLE_DEVICES={seen!r}" if seen is not None else ""
        return (
            f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no device: "
            f"torch.cuda.is_available() is False{where}"
        )
    return None


def environment() -> dict[str, str]:
    """The date, the machine, Python, torch, CUDA, NCCL and the devices, as report lines."""
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "python": platform.python_version(),
        "funcpipe commit": _git_commit(),
    }
    try:
        import torch
    except ImportError:
        env["torch"] = "not importable"
        return env
    env["torch"] = torch.__version__
    env["CUDA (torch built with)"] = str(torch.version.cuda)
    if torch.cuda.is_available():
        try:
            nccl = torch.cuda.nccl.version()
            env["NCCL"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        except Exception as e:  # a build without NCCL
            env["NCCL"] = f"not available ({type(e).__name__})"
        for k in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(k)
            env[f"cuda:{k}"] = (
                f"{p.name}, {p.total_memory / 2**30:.1f} GiB, compute capability "
                f"{p.major}.{p.minor}, {p.multi_processor_count} SMs"
            )
    return env


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    dirty = ""
    if out.returncode == 0:
        status = subprocess.run(
            ["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = " (with uncommitted changes)" if status.stdout.strip() else ""
    return out.stdout.strip() + dirty if out.returncode == 0 else "unknown (not a git checkout)"


def missing_packages() -> list[str]:
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def _env() -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH."""
    env = dict(os.environ)
    rest = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = ROOT + (os.pathsep + rest if rest else "")
    return env


def run_logged(cmd: Sequence[str], log: str, timeout: float) -> tuple[int, str]:
    """Run ``cmd`` in a process session of its own with its output streamed to ``log``; past
    ``timeout`` seconds kill the whole session (every process it started). Returns the exit
    status (-1: timed out) and the output."""
    with open(log, "w") as f:
        proc = subprocess.Popen(
            list(cmd),
            cwd=ROOT,
            env=_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_session(proc)
            code = -1
    with open(log, errors="replace") as f:
        text = f.read()
    return code, text


def _kill_session(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM to the whole session, 10 s to end, then SIGKILL to whatever of it is left (the
    leader may be gone while its children are not)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


# ----------------------------------------------------------------------------- the tests
def run_tests(out: str, timeout: float) -> tuple[list[Check], str]:
    """Run the CUDA tests (output streamed to ``out/pytest.log``, results in ``out/junit.xml``);
    each test's result and, when pytest failed, the end of its output."""
    xml = os.path.join(out, "junit.xml")
    cmd = [sys.executable, "-m", "pytest", *TESTS, "-v", "-rA", "-p", "no:cacheprovider"]
    cmd += [f"--junitxml={xml}", "-o", "junit_family=xunit1"]
    if importlib.util.find_spec("pytest_timeout") is None:  # pyproject's `timeout` is unknown then
        cmd += ["-W", "ignore::pytest.PytestConfigWarning"]
    code, text = run_logged(cmd, os.path.join(out, "pytest.log"), timeout)
    if code == -1:
        text += f"\n(gpu-check: pytest stopped after {timeout:.0f} s)"
    checks = parse_junit(xml) if os.path.exists(xml) else []
    if code not in (0, 1) or not checks:  # 1: some tests failed (listed); else pytest broke
        reason = "timed out" if code == -1 else f"exit status {code}"
        if not checks:
            checks = parse_verbose(text)
        checks.append(Check("pytest " + " ".join(TESTS), "fail", f"pytest: {reason}"))
    return checks, ("" if code == 0 else _tail(text))


def parse_verbose(text: str) -> list[Check]:
    """Each result line of ``pytest -v`` output (``path::name PASSED``): what had finished when
    pytest was killed before writing its XML."""
    words = {"PASSED": "pass", "FAILED": "fail", "ERROR": "fail", "SKIPPED": "skip"}
    checks = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and "::" in parts[0] and parts[1] in words:
            checks.append(Check(parts[0], words[parts[1]], "before the kill"))
    return checks


def parse_junit(path: str) -> list[Check]:
    """Each test case of a JUnit XML file as a :class:`Check` (the reason of a skip or failure:
    the first line of its message)."""
    checks = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = _case_name(case)
        result, detail = "pass", ""
        for tag, outcome in (("failure", "fail"), ("error", "fail"), ("skipped", "skip")):
            found = case.find(tag)
            if found is not None:
                result = outcome
                message = found.get("message") or (found.text or "")
                detail = _first_line(message)
                if tag == "error":
                    detail = "error: " + detail
                break
        checks.append(Check(name, result, detail))
    return checks


def _case_name(case: ET.Element) -> str:
    file, classname, name = case.get("file"), case.get("classname", ""), case.get("name", "")
    if not file:  # xunit2: classname is the dotted module path
        file = classname.replace(".", "/") + ".py" if classname else "?"
    return f"{file}::{name}"


def _first_line(text: str) -> str:
    text = text.strip()
    if text.startswith(("Skipped: ", "skip: ")):
        text = text.split(": ", 1)[1]
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= 160 else line[:157] + "..."


# ----------------------------------------------------------------------------- the demo
def run_demo(
    work: str,
    *,
    out: str | None = None,
    device: str = "cuda",
    steps: int,
    pipeline: int,
    tensor: int,
    extra: Sequence[str] = (),
    timeout: float,
) -> Demo:
    """``funcpipe demo --device <device>`` for ``steps`` steps (``pipeline x tensor`` ranks, one
    GPU each); its numbers from the ``summary.json`` it writes in ``work/demo``. With ``out``, its
    output is streamed to ``out/demo.log`` and its summary and timeline picture copied there."""
    folder = os.path.join(work, "demo")
    args = ["--device", device, "--steps", str(steps), "--pipeline", str(pipeline)]
    args += ["--tensor", str(tensor), "--data", "1", "--out", folder, *extra]
    demo = Demo(ran=True, command="funcpipe demo " + shlex.join(args))
    start = time.perf_counter()
    log = os.path.join(out if out is not None else work, "demo.log")
    code, text = run_logged([sys.executable, "-m", "funcpipe", "demo", *args], log, timeout)
    if code == -1:
        text += f"\n(gpu-check: the demo was stopped after {timeout:.0f} s)"
    demo.seconds = time.perf_counter() - start
    demo.ok = code == 0
    if not demo.ok:
        demo.note = "timed out" if code == -1 else f"exit status {code}"
        demo.tail = _tail(text)
    if out is not None:
        for name in ("summary.json", "step_timeline.png"):
            if os.path.exists(os.path.join(folder, name)):
                shutil.copy(os.path.join(folder, name), os.path.join(out, name))
    summary = _read_json(os.path.join(folder, "summary.json"))
    if not isinstance(summary, dict):
        if demo.ok:
            demo.ok, demo.note, demo.tail = False, "the demo wrote no summary.json", _tail(text)
        return demo
    demo.tokens_per_s = _number(summary.get("tokens_per_s"))
    demo.mfu = _number(summary.get("mfu"))  # a fraction of the devices' peak
    demo.numbers = {k: v for k in SUMMARY_KEYS if (v := _number(summary.get(k))) is not None}
    peaks = summary.get("peak_memory_bytes_per_rank")
    if isinstance(peaks, list):
        demo.peaks = {r: int(b) for r, b in enumerate(peaks) if _number(b) is not None}
    return demo


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# ----------------------------------------------------------------------------- the report
def render(
    env: dict[str, str],
    *,
    skipped: str | None = None,
    checks: Sequence[Check] = (),
    test_tail: str = "",
    demo: Demo | None = None,
) -> str:
    """The report as markdown."""
    lines = ["# funcpipe gpu-check", ""]
    lines += [f"- {key}: {value}" for key, value in env.items()]
    lines.append("")
    if skipped is not None:
        lines += [f"**{SKIP_LINE}** ({skipped}).", ""]
        lines += [
            "Nothing ran on a GPU. Run `make gpu-check` on a machine with CUDA (docs/gpu.md).",
            "",
        ]
        return "\n".join(lines)
    counts = {r: sum(c.result == r for c in checks) for r in ("pass", "fail", "skip")}
    demo_word = "not run" if demo is None or not demo.ran else ("ok" if demo.ok else "failed")
    lines += [
        f"**Result: {'FAIL' if failed(checks, demo) else 'PASS'}**: {counts['pass']} passed, "
        f"{counts['fail']} failed, {counts['skip']} skipped; demo {demo_word}.",
        "",
        "## Checks",
        "",
        "| check | result | detail |",
        "| --- | --- | --- |",
    ]
    for c in checks:
        detail = c.detail.replace("|", "\\|")
        lines.append(f"| `{c.name}` | {c.result} | {detail} |")
    if test_tail:
        lines += ["", "The end of pytest's output:", "", "```", test_tail, "```"]
    lines += ["", "## Demo on CUDA", ""]
    if demo is None or not demo.ran:
        lines.append(f"Not run: {demo.note if demo is not None else 'not asked for'}.")
    else:
        lines.append(f"- command: `{demo.command}` ({demo.seconds:.0f} s)")
        lines.append(f"- result: {'ok' if demo.ok else 'FAILED: ' + demo.note}")
        tps = f"{demo.tokens_per_s:,.0f}" if demo.tokens_per_s is not None else "not reported"
        lines.append(f"- throughput: {tps} tokens/s")
        mfu = f"{100 * demo.mfu:.2f}%" if demo.mfu is not None else "not reported by the demo"
        lines.append(f"- model FLOPs utilisation: {mfu}")
        lines += [f"- {key}: {value:.4g}" for key, value in demo.numbers.items()]
        if demo.peaks:
            for rank, peak in sorted(demo.peaks.items()):
                lines.append(
                    f"- peak memory, rank {rank}: {peak / 2**30:.2f} GiB "
                    "(torch.cuda.max_memory_allocated)"
                )
        else:
            lines.append("- peak memory per rank: not reported by the demo")
        if demo.tail:
            lines += ["", "The end of the demo's output:", "", "```", demo.tail, "```"]
    lines.append("")
    return "\n".join(lines)


def failed(checks: Sequence[Check], demo: Demo | None) -> bool:
    return any(c.result == "fail" for c in checks) or (
        demo is not None and demo.ran and not demo.ok
    )


# ----------------------------------------------------------------------------- the command
def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python tools/gpu_check.py",
        description="Run funcpipe's CUDA checks and the demo on CUDA; write one report. "
        "Without CUDA: say so and exit 0.",
    )
    ap.add_argument(
        "--out",
        default="gpu-check",
        help="the folder written as the check goes: gpu-check.md, logs, junit.xml, the demo's "
        "summary.json and timeline (default gpu-check; on the device tool: $OUT/gpu-check)",
    )
    ap.add_argument("--steps", type=int, default=20, help="demo steps (default 20)")
    ap.add_argument("--pipeline", type=int, default=1, help="demo pipeline ranks (default 1)")
    ap.add_argument("--tensor", type=int, default=1, help="demo tensor size (default 1)")
    ap.add_argument(
        "--demo-args", default="", help="more demo options, one string (e.g. '--size small')"
    )
    ap.add_argument("--no-demo", action="store_true", help="run the tests only")
    ap.add_argument("--test-timeout", type=float, default=270.0, help="seconds (default 270)")
    ap.add_argument("--demo-timeout", type=float, default=180.0, help="seconds (default 180)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    o = parse(argv)
    os.makedirs(o.out, exist_ok=True)
    report = os.path.join(o.out, "gpu-check.md")
    env = environment()
    reason = no_cuda_reason()
    if reason is not None:
        print(f"{SKIP_LINE} ({reason})", flush=True)
        _write(report, render(env, skipped=reason))
        return 0
    print(f"gpu-check: {env.get('cuda:0', 'cuda')}; torch {env['torch']}", flush=True)
    missing = missing_packages()
    if missing:
        note = (
            f"missing Python packages: {', '.join(missing)} (funcpipe or its tests need them; "
            "docs/gpu.md says how to install wheels on a machine without internet)"
        )
        print(f"gpu-check: {note}", file=sys.stderr, flush=True)
        checks = [Check("python packages", "fail", note)]
        _write(report, render(env, checks=checks, demo=Demo(note="packages missing")))
        return 1
    pending = [Check("pytest " + " ".join(TESTS), "skip", "running (the check was killed here)")]
    _write(report, render(env, checks=pending, demo=Demo(note="not reached")))
    print("gpu-check: running " + " ".join(TESTS), flush=True)
    checks, tail = run_tests(o.out, o.test_timeout)
    counts = {r: sum(c.result == r for c in checks) for r in ("pass", "fail", "skip")}
    print(
        f"gpu-check: {counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped",
        flush=True,
    )
    demo = Demo(note="--no-demo was given")
    if not o.no_demo:
        running = Demo(note="running (the check was killed here)")
        _write(report, render(env, checks=checks, test_tail=tail, demo=running))
        print(f"gpu-check: the demo on CUDA, {o.steps} steps", flush=True)
        with tempfile.TemporaryDirectory(prefix="funcpipe-gpu-check-") as work:
            demo = run_demo(
                work,
                out=o.out,
                steps=o.steps,
                pipeline=o.pipeline,
                tensor=o.tensor,
                extra=shlex.split(o.demo_args),
                timeout=o.demo_timeout,
            )
        print(f"gpu-check: demo: {_demo_line(demo)}", flush=True)
    _write(report, render(env, checks=checks, test_tail=tail, demo=demo))
    bad = failed(checks, demo)
    print(f"gpu-check: {'FAIL' if bad else 'PASS'}; report: {report}", flush=True)
    return 1 if bad else 0


def _demo_line(demo: Demo) -> str:
    if not demo.ran:
        return "not run: " + demo.note
    if not demo.ok:
        return "FAILED: " + demo.note
    parts = [f"{demo.tokens_per_s:,.0f} tokens/s" if demo.tokens_per_s else "no tokens/s"]
    parts.append(f"MFU {100 * demo.mfu:.2f}%" if demo.mfu is not None else "no MFU")
    parts += [f"rank {r} peak {b / 2**30:.2f} GiB" for r, b in sorted(demo.peaks.items())]
    return ", ".join(parts)


def _write(path: str, text: str) -> None:
    """Whole or not at all: a kill mid-write leaves the previous report."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    if not __package__:  # run as a file: funcpipe/ must not shadow the standard library
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        sys.path.insert(0, ROOT)
    sys.exit(main())
