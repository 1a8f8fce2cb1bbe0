"""The promises of docs/security.md, one test each (or more).

1. Nothing received over the wire during a pipeline step is unpickled: only tensors travel, into
   buffers sized by local shape inference.
2. Checkpoints load without running code from the checkpoint: DCP metadata through a restricted
   unpickler, tensors with ``torch.load(weights_only=True)``.
3. The schedule text and CSV parsers never evaluate their input.
4. The launcher binds to loopback (127.0.0.1) by default, and says so.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import funcpipe as fp
from funcpipe.errors import FuncpipeError, InvalidArgument, ScheduleError
from funcpipe.schedule import parse_instr, parse_program, read_csv
from funcpipe.train import checkpoint
from tests import jobs_faults
from tests.jobs_runtime import data, tied_reference, toy

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "security.md"


# ------------------------------------------------------------------------------ 1. the wire
@pytest.mark.timeout(120)
def test_a_pipeline_step_unpickles_nothing(pool: Any) -> None:
    """Pipeline construction, two training steps (ties, two batch shapes, traced) and an
    evaluation, on 2 gloo processes, with pickle.loads/load/Unpickler, torch.load and every
    object collective of torch.distributed patched to raise."""
    results = pool(2).run(jobs_faults.step_without_unpickling)
    for res in results:
        assert res["calls"] == []
        assert "pickle.loads" in res["patched"] and "torch.load" in res["patched"]
        assert any(name.endswith("recv_object_list") for name in res["patched"])
        assert any(name.endswith("broadcast_object_list") for name in res["patched"])
    stages, params = toy(2, tied=True)
    ties = {"E": [(0, "E"), (1, "E")]}
    for k, size in enumerate((8, 6)):
        x, y = data(size)
        ref, _ = tied_reference(stages, params, x, y, 4, ties)
        assert all(abs(res["losses"][k] - float(ref)) < 1e-12 for res in results)


# ------------------------------------------------------------------------------ 2. checkpoints
def _stack_global(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle that calls ``module.name(arg)`` (dotted ``name`` allowed)."""

    def text(s: str) -> bytes:
        raw = s.encode()
        return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw + pickle.MEMOIZE

    return (
        pickle.PROTO
        + b"\x04"
        + text(module)
        + text(name)
        + pickle.STACK_GLOBAL
        + pickle.MEMOIZE
        + text(arg)
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP
    )


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("os", "system"),
        ("builtins", "eval"),
        # DCP's metadata module imports os and torch: attribute paths through it
        ("torch.distributed.checkpoint.metadata", "os.system"),
        ("torch.distributed.checkpoint.metadata", "torch.os.system"),
        ("torch", "os.system"),
    ],
)
def test_malicious_checkpoint_metadata_is_refused(tmp_path: Path, module: str, name: str) -> None:
    path = checkpoint.save(tmp_path / "ck", {"w": torch.ones(3)})
    victim = tmp_path / "pwned"
    if name == "eval":
        arg = f"open({str(victim)!r}, 'w').close()"
    else:
        arg = f"touch {victim}"
    Path(path, ".metadata").write_bytes(_stack_global(module, name, arg))
    with pytest.raises(FuncpipeError, match="cannot read the checkpoint metadata"):
        checkpoint.load(path, {"w": torch.ones(3)})
    assert not victim.exists()


class _Evil:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self) -> Any:
        return (os.makedirs, (self.target,))


def test_tensor_data_is_read_weights_only(tmp_path: Path) -> None:
    """Point the (valid) metadata at a tensor file that holds a pickled object with a
    ``__reduce__``: DCP reads tensors with torch.load(weights_only=True), which refuses it."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(checkpoint.save(tmp_path / "ck", {"w": torch.ones(3)}))
    victim = tmp_path / "pwned"
    evil = io.BytesIO()
    torch.save(_Evil(str(victim)), evil)
    (data_file,) = path.glob("*.distcp")
    data_file.write_bytes(evil.getvalue())
    meta: Metadata = pickle.loads((path / ".metadata").read_bytes())  # our own, trusted file
    for info in meta.storage_data.values():
        info.offset, info.length = 0, len(evil.getvalue())
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(
        FuncpipeError, match="Weights only load failed.*GLOBAL os.makedirs"
    ) as raised:
        checkpoint.load(path, {"w": torch.ones(3)})
    assert not victim.exists(), raised.value


@pytest.mark.parametrize("where", ["../outside.distcp", "/etc/hostname"])
def test_checkpoint_metadata_cannot_point_outside_the_checkpoint(
    tmp_path: Path, where: str
) -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(checkpoint.save(tmp_path / "ck", {"w": torch.ones(3)}))
    meta: Metadata = pickle.loads((path / ".metadata").read_bytes())  # our own, trusted file
    for info in meta.storage_data.values():
        info.relative_path = where
    (path / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(FuncpipeError, match="outside the checkpoint directory"):
        checkpoint.load(path, {"w": torch.ones(3)})


# ------------------------------------------------------------------------------ 3. the parsers
_EVENTS: list[tuple[str, Any]] = []
_WATCHING = False
_WATCHED = (
    "exec",
    "compile",
    "pickle.find_class",
    "marshal.loads",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.fork",
    "subprocess.Popen",
    "ctypes.dlopen",
    "socket.connect",
    "import",
)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _WATCHING and event in _WATCHED:
        _EVENTS.append((event, args))


sys.addaudithook(_audit)  # permanent for the process; a flag check when not watching


@contextlib.contextmanager
def _watching() -> Iterator[list[tuple[str, Any]]]:
    global _WATCHING
    import csv  # noqa: F401  (imported by the parsers' modules already; never inside a parse)

    _EVENTS.clear()
    _WATCHING = True
    try:
        yield _EVENTS
    finally:
        _WATCHING = False


_CODE = [
    "__import__('os').system('touch {victim}')",
    "eval(\"open('{victim}', 'w')\")",
    "exec('import os')",
    "import os; os.system('touch {victim}')",
    "{{'__reduce__': (os.system, ('touch {victim}',))}}",
    "cos\nsystem\n(S'touch {victim}'\ntR.",  # a protocol-0 pickle
    "!!python/object/apply:os.system ['touch {victim}']",  # a YAML tag
    "${{touch {victim}}}",
    "`touch {victim}`",
]
_SCHEDULE_TOKENS = [
    "placement 0 1",
    "microbatches 2",
    "rank 0",
    "rank 1",
    "F s0 m0",
    "B s1 m1",
    "SEND act s0>s1 m0 to r1",
    "name",
    "edges 0>1",
    "0F0",
    "1B0",
    ",",
    "\n",
    ";",
    "#",
]


@given(
    st.lists(
        st.one_of(st.sampled_from(_CODE), st.sampled_from(_SCHEDULE_TOKENS), st.text(max_size=20)),
        max_size=12,
    ),
    st.sampled_from(["\n", ",", " ", ";"]),
)
def test_schedule_parsers_never_evaluate_their_input(pieces: list[str], sep: str) -> None:
    """Fuzzed text mixing schedule syntax with Python, pickle, YAML and shell code: the
    parsers return a Program or raise ScheduleError/InvalidArgument, and nothing is executed,
    compiled, unpickled, imported, spawned or connected. (tests/schedule/test_mutations.py
    fuzzes the same parsers for crashes: test_program_parser_never_fails_otherwise and
    test_csv_parser_never_fails_otherwise.)"""
    victim = Path(os.environ.get("TMPDIR", "/tmp")) / f"fp-parser-victim-{os.getpid()}"
    text = sep.join(p.format(victim=victim) if "{victim}" in p else p for p in pieces)
    with _watching() as events:
        for parse in (parse_program, lambda t: read_csv(t + "\n"), parse_instr):
            with contextlib.suppress(ScheduleError, InvalidArgument):
                parse(text)
    assert events == [], events
    assert not victim.exists()


def test_the_audit_hook_sees_evaluation() -> None:
    """The watch above would notice: eval, exec and unpickling raise audit events."""
    with _watching() as events:
        eval("1 + 1")
        pickle.loads(pickle.dumps(fp.InvalidArgument("x")))
    assert {e for e, _ in events} >= {"exec", "compile", "pickle.find_class"}


# ------------------------------------------------------------------------------ 4. the launcher
def _loopback(address: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(address).is_loopback


@pytest.mark.timeout(120)
def test_the_launcher_listens_on_loopback_only(pool: Any) -> None:
    p = pool(2)
    mine = jobs_faults.listening(os.getpid())
    store = [(addr, port) for addr, port in mine if port == p.store.port]
    assert store and all(_loopback(addr) for addr, _ in store), store
    for rank, sockets in enumerate(p.run(jobs_faults.listening_sockets)):
        assert sockets, f"rank {rank} listens on nothing?"
        assert all(_loopback(addr) for addr, _ in sockets), (rank, sockets)


def test_the_docs_say_so() -> None:
    text = DOC.read_text()
    for promise in (
        "127.0.0.1",
        "loopback",
        "weights_only=True",
        "never unpickle",
        "multiprocessing pipes",
        "tests/test_security.py",
    ):
        assert promise in text, promise
    from funcpipe.distributed import launcher

    assert "127.0.0.1" in (launcher.__doc__ or "") + (fp.launch.__doc__ or "")
