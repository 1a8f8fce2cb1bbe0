"""Same-host point-to-point sockets: exact bytes for every dtype and shape, no deadlock when both
sides send more than the kernel buffers hold, clear errors (mismatch, peer gone, timeout)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from funcpipe.errors import CommunicationError
from funcpipe.runtime import sockets

pytestmark = pytest.mark.skipif(not sockets.supported(), reason="no Unix-domain sockets")


def _error(e: BaseException, what: str) -> BaseException:
    return CommunicationError(f"{what}: {e}")


def _pair(timeout: float = 10.0, key: str = "k") -> tuple[sockets.Channels, sockets.Channels]:
    """Channels of ranks 0 and 1, set up concurrently (as two processes would)."""
    store = dist.HashStore()
    made: dict[int, sockets.Channels] = {}
    errors: list[BaseException] = []

    def make(rank: int) -> None:
        try:
            made[rank] = sockets.Channels(
                rank, [1 - rank], store, key=key, timeout=timeout, on_error=_error
            )
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=make, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    return made[0], made[1]


def _both(a: Callable[[], Any], b: Callable[[], Any]) -> tuple[Any, Any]:
    """Run a and b at once (two ranks); re-raise the first error."""
    out: dict[str, Any] = {}

    def run(name: str, fn: Callable[[], Any]) -> None:
        try:
            out[name] = fn()
        except BaseException as e:
            out[name + "!"] = e

    threads = [
        threading.Thread(target=run, args=(n, f), daemon=True) for n, f in (("a", a), ("b", b))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a side hung"
    for name in ("a!", "b!"):
        if name in out:
            raise out[name]
    return out["a"], out["b"]


TENSORS = [
    torch.randn(3, 5),
    torch.randn(4, dtype=torch.float64),
    torch.randn(2, 3).to(torch.bfloat16),
    torch.randn(2, 2, dtype=torch.complex64),
    torch.tensor([True, False, True]),
    torch.arange(7, dtype=torch.int64),
    torch.tensor(3.5),  # 0-d
    torch.empty(0, 4),  # no bytes at all
    torch.randn(6, 4).t().contiguous(),
]


def test_every_dtype_and_shape_arrives_exactly() -> None:
    a, b = _pair()
    try:
        bufs = [torch.empty_like(t) for t in TENSORS]

        def send() -> None:
            for t in TENSORS:
                a.send(t, 1)
            a.flush("send")

        def recv() -> None:
            h = b.recv(bufs, 0, "recv")
            h.wait()
            assert h.ready()

        _both(send, recv)
        for got, want in zip(bufs, TENSORS, strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want)
    finally:
        a.close()
        b.close()


def test_both_sides_sending_more_than_the_kernel_holds_do_not_deadlock() -> None:
    """Each side sends 32 MB, then waits for the other's: with blocking sends this hangs."""
    a, b = _pair()
    big = [torch.randn(8 << 20), torch.randn(8 << 20)]
    try:

        def side(me: sockets.Channels, peer: int, mine: torch.Tensor) -> torch.Tensor:
            me.send(mine, peer)  # queued: the kernel takes only a few hundred KB
            buf = torch.empty_like(mine)
            me.recv([buf], peer, "recv").wait()
            me.flush("send")
            return buf

        got_a, got_b = _both(lambda: side(a, 1, big[0]), lambda: side(b, 0, big[1]))
        assert torch.equal(got_a, big[1]) and torch.equal(got_b, big[0])
    finally:
        a.close()
        b.close()


def test_many_messages_keep_their_order() -> None:
    a, b = _pair()
    try:
        n = 200
        sent = [torch.full((k % 7 + 1,), float(k)) for k in range(n)]

        def send() -> None:
            for t in sent:
                a.send(t, 1)
            a.flush("send")

        def recv() -> list[torch.Tensor]:
            bufs = [torch.empty_like(t) for t in sent]
            handles = [b.recv([buf], 0, "recv") for buf in bufs]  # all posted early
            for h in reversed(handles):
                h.wait()
            return bufs

        _, got = _both(send, recv)
        assert all(torch.equal(x, y) for x, y in zip(got, sent, strict=True))
    finally:
        a.close()
        b.close()


def test_a_receive_is_ready_only_when_all_its_tensors_are_in() -> None:
    a, b = _pair()
    try:
        assert b.recv([], 0, "nothing").ready()  # no tensors: nothing to wait for
        bufs = [torch.empty(3), torch.empty(4)]
        h = b.recv(bufs, 0, "recv")
        assert not h.ready()
        a.send(torch.ones(3), 1)
        a.flush("send")
        deadline = time.monotonic() + 10
        while not h.items[0].done:  # the first tensor is in, the second not yet sent
            assert not h.ready()
            assert time.monotonic() < deadline, "the first tensor never arrived"
        assert not h.ready()
        a.send(torch.full((4,), 2.0), 1)
        h.wait()
        assert torch.equal(bufs[0], torch.ones(3)) and torch.equal(bufs[1], torch.full((4,), 2.0))
    finally:
        a.close()
        b.close()


def test_a_size_mismatch_is_named() -> None:
    a, b = _pair()
    try:
        a.send(torch.zeros(5), 1)
        a.flush("send")
        with pytest.raises(CommunicationError, match=r"message #0 from rank 0 has 20 bytes"):
            b.recv([torch.empty(4)], 0, "recv").wait()
    finally:
        a.close()
        b.close()


def test_a_peer_that_goes_away_ends_the_wait_at_once() -> None:
    a, b = _pair(timeout=60.0)
    a.close()
    start = time.monotonic()
    with pytest.raises(CommunicationError, match="receive from rank 0"):
        b.recv([torch.empty(4)], 0, "receive from rank 0").wait()
    assert time.monotonic() - start < 5
    b.close()


def test_a_silent_peer_times_out() -> None:
    a, b = _pair(timeout=0.5)
    try:
        start = time.monotonic()
        with pytest.raises(CommunicationError, match="timed out"):
            b.recv([torch.empty(4)], 0, "receive from rank 0").wait()
        assert time.monotonic() - start < 5
    finally:
        a.close()
        b.close()


def test_no_socket_file_is_left_behind(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    a, b = _pair()
    a.close()
    b.close()
    assert list(tmp_path.iterdir()) == []


def test_a_setup_without_the_peer_fails_with_a_clear_error() -> None:
    store = dist.HashStore()
    store.set_timeout(__import__("datetime").timedelta(seconds=1))
    with pytest.raises(CommunicationError, match="every process must build the same Pipeline"):
        sockets.Channels(0, [1], store, key="lonely", timeout=1.0, on_error=_error)


def test_a_connection_without_the_token_is_refused() -> None:
    import socket
    import struct

    store = dist.HashStore()
    caught: list[BaseException] = []

    def listen() -> None:
        try:
            sockets.Channels(1, [0], store, key="k", timeout=5.0, on_error=_error)
        except BaseException as e:
            caught.append(e)

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    path = store.get("k/path/1").decode()  # waits until rank 1 listens
    intruder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    intruder.connect(path)
    intruder.sendall(struct.pack("<Q", 0) + b"x" * 16)
    t.join(timeout=10)
    intruder.close()
    assert len(caught) == 1 and isinstance(caught[0], CommunicationError)
    assert "token" in str(caught[0])


def test_messages_of_many_sizes_leave_no_garbage() -> None:
    import gc

    a, b = _pair()
    try:
        gc.collect()
        gc.disable()
        for n in range(1, 40):
            t = torch.randn(n)
            a.send(t, 1)
            buf = torch.empty(n)
            b.recv([buf], 0, "recv").wait()
            assert torch.equal(buf, t)
        a.flush("send")
        assert gc.collect() == 0  # nothing cyclic was made per message
    finally:
        gc.enable()
        a.close()
        b.close()


def test_a_send_is_done_once_the_kernel_has_its_bytes_and_lets_the_tensor_go() -> None:
    import weakref

    a, b = _pair()
    try:
        small = torch.randn(16)
        gone = weakref.ref(small)
        sent = a.send(small, 1)
        assert sent.ready()  # a few bytes: the kernel took them at once
        del small
        assert gone() is None  # the channel kept nothing of it
        big = torch.randn(8 << 20)  # 32 MB: more than the kernel buffers hold
        sent_big = a.send(big, 1)
        assert not sent_big.ready()  # still queued until rank 1 reads
        buf_small, buf_big = torch.empty(16), torch.empty(8 << 20)

        def recv() -> None:
            b.recv([buf_small, buf_big], 0, "recv").wait()

        _both(sent_big.wait, recv)
        assert sent_big.ready() and torch.equal(buf_big, big)
    finally:
        a.close()
        b.close()
