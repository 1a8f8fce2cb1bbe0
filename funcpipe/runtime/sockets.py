"""Point-to-point messages between processes of one host, over Unix-domain stream sockets.

gloo moves a CPU tensor through its TCP stack and a background thread on each side; between two
processes of one machine that costs 0.1-2 ms per message (more when the cores are busy), which is
as long as a small stage's forward. A Unix-domain socket between the two processes carries the
same bytes in 7-18 us (measured here): the kernel copies them, no thread has to wake up.

Messages between two ranks arrive in the order they were sent, which is the order the program's
receives expect (the checker proves it, per pair and direction), so a message is just its bytes
after a 16-byte header (length and sequence number) that the receiver checks. Nothing but tensor
bytes travels; nothing is unpickled.

Nothing blocks the sender: a message the kernel cannot take yet waits in a queue. A send pushes
its own link's queue; every check for data and every wait moves all queued bytes forward in both
directions, so two ranks waiting on each other always progress. Posting a receive makes no system
call (its data has usually not been sent yet): the next check reads it. A wait gives up after the
process group's timeout; a peer that exits closes its socket, which the waiting rank sees at once.

Set-up: each process listens on a socket file in a private directory (mode 0700), publishes its
path in the process group's store, and every pair that exchanges messages connects, the lower
rank dialling the higher one. A connecting peer first sends a random token from the store, so no
other local process can inject data.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import select
import socket
import struct
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from funcpipe.errors import CommunicationError

__all__ = ["Channels", "supported"]

Tensor = torch.Tensor
_HEADER = struct.Struct("<QQ")  # payload bytes, sequence number
_BUFFER = 4 << 20  # requested socket buffer (the kernel caps it at its wmem/rmem maximum)


def supported() -> bool:
    """Unix-domain sockets exist here (not on Windows)."""
    return hasattr(socket, "AF_UNIX")


def _memory_view_factory() -> Callable[[int, int], memoryview] | None:
    """CPython's ``PyMemoryView_FromMemory`` (writable): a view of raw memory that creates no
    new type per size (a ctypes array type per message size would be cyclic garbage)."""
    try:
        fn = ctypes.pythonapi.PyMemoryView_FromMemory
    except AttributeError:  # not CPython
        return None
    fn.restype = ctypes.py_object
    fn.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
    return lambda address, n: fn(address, n, 0x200)  # PyBUF_WRITE


_VIEW = _memory_view_factory()


def _bytes(t: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the caller keeps ``t`` alive)."""
    n = t.nbytes
    if n == 0:
        return memoryview(bytearray())
    if _VIEW is not None:
        return _VIEW(t.data_ptr(), n)
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class _Outgoing:
    """One message: header then payload, sent with one system call while the kernel takes it.
    ``done`` once the kernel has all of it (the tensor may then be released)."""

    __slots__ = ("done", "header", "keep", "offset", "view")

    def __init__(self, header: bytes, view: memoryview, keep: Tensor) -> None:
        self.header, self.view, self.offset = header, view, 0
        self.keep: Tensor | None = keep
        self.done = False

    def release(self) -> None:
        """All bytes are out: let the tensor go (the view points into it)."""
        self.done = True
        self.keep, self.view = None, memoryview(b"")


class _Incoming:
    """One expected message: its header, then its payload into ``view``."""

    __slots__ = ("done", "header", "offset", "seq", "tensor", "view")

    def __init__(self, tensor: Tensor, seq: int) -> None:
        self.tensor, self.view, self.seq = tensor, _bytes(tensor), seq
        self.header = bytearray(_HEADER.size)
        self.offset = 0  # bytes of header + payload received
        self.done = False


class _Link:
    """One connected peer: queued outgoing bytes and the receives expected, in order."""

    def __init__(self, sock: socket.socket, peer: int) -> None:
        self.sock, self.peer = sock, peer
        self.out: deque[_Outgoing] = deque()
        self.expect: deque[_Incoming] = deque()
        self.sent = self.received = 0  # messages, for the sequence numbers
        self.hung_up = False

    def flush(self) -> None:
        h = _HEADER.size
        while self.out:
            item = self.out[0]
            total = h + len(item.view)
            try:
                if item.offset < h:
                    n = self.sock.sendmsg([item.header[item.offset :], item.view])
                else:
                    n = self.sock.send(item.view[item.offset - h :])
            except (BlockingIOError, InterruptedError):
                return
            item.offset += n
            if item.offset < total:
                continue  # the kernel took part: try again (it says when it is full)
            self.out.popleft()
            item.release()

    def drain(self, me: int) -> None:
        h = _HEADER.size
        while self.expect:
            item = self.expect[0]
            total = h + len(item.view)
            if item.offset < total:
                try:
                    if item.offset < h:
                        n = self.sock.recvmsg_into(
                            [memoryview(item.header)[item.offset :], item.view]
                        )[0]
                    else:
                        n = self.sock.recv_into(item.view[item.offset - h :])
                except (BlockingIOError, InterruptedError):
                    return
                if n == 0:
                    raise ConnectionResetError(f"rank {self.peer} closed the connection")
                was = item.offset
                item.offset += n
                if was < h <= item.offset:
                    size, seq = _HEADER.unpack(item.header)
                    if size != len(item.view) or seq != item.seq:
                        raise CommunicationError(
                            f"rank {me}: message #{seq} from rank {self.peer} has {size} bytes "
                            f"where message #{item.seq} of {len(item.view)} bytes was expected "
                            "(the two ranks run different programs or shapes)"
                        )
                if item.offset < total:
                    continue
            item.done = True
            self.expect.popleft()


class _Receive:
    """The handle of one receive (several tensors from one peer)."""

    def __init__(self, channels: Channels, items: list[_Incoming], what: str) -> None:
        self.channels, self.items, self.what = channels, items, what

    def done(self) -> bool:
        # a link's receives complete in the order they were posted: the last one decides
        return not self.items or self.items[-1].done

    def ready(self) -> bool:
        if self.done():
            return True
        self.channels.progress()
        return self.done()

    def wait(self) -> None:
        if not self.ready():
            self.channels.wait_until(self.done, self.what)


class _Sent:
    """The handle of one send: done once the kernel holds all its bytes."""

    def __init__(self, channels: Channels, item: _Outgoing, what: str) -> None:
        self.channels, self.item, self.what = channels, item, what

    def done(self) -> bool:
        return self.item.done

    def ready(self) -> bool:
        if not self.item.done:
            self.channels.progress()
        return self.item.done

    def wait(self) -> None:
        if not self.ready():
            self.channels.wait_until(self.done, self.what)


class Channels:
    """Sockets to the peers of one process, for one pipeline.

    ``me`` and ``peers`` are global ranks; ``store`` is the process group's store (the set-up
    exchanges socket paths and a token through it under ``key``, which must be the same on every
    process and new for each set-up). ``on_error(exc, what)`` makes the exception to raise.
    Every process listed in some ``peers`` must construct its Channels at the same point.
    """

    def __init__(
        self,
        me: int,
        peers: Iterable[int],
        store: Any,
        *,
        key: str,
        timeout: float,
        on_error: Callable[[BaseException, str], BaseException],
    ) -> None:
        self.me, self.timeout, self.on_error = me, timeout, on_error
        self.links: dict[int, _Link] = {}
        self._finalizer: weakref.finalize[Any, Any] | None = None
        peers = sorted(set(peers) - {me})
        if not peers:
            return
        deadline = time.monotonic() + timeout
        token = self._token(store, key)
        listener, path = None, None
        if any(p < me for p in peers):  # lower ranks dial us
            folder = tempfile.mkdtemp(prefix="funcpipe-")
            os.chmod(folder, 0o700)
            path = os.path.join(folder, f"{me}.sock")
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(path)
            listener.listen(len(peers))
            store.set(f"{key}/path/{me}", path)
        try:
            for p in peers:
                if p > me:
                    self._dial(p, store, key, token, deadline)
            if listener is not None:
                listener.settimeout(max(0.1, deadline - time.monotonic()))
                for _ in range(sum(p < me for p in peers)):
                    sock, _ = listener.accept()
                    sock.settimeout(max(0.1, deadline - time.monotonic()))
                    hello = _read_exactly(sock, 8 + len(token))
                    peer = struct.unpack("<Q", hello[:8])[0]
                    if not secrets.compare_digest(hello[8:], token) or peer not in peers:
                        sock.close()
                        raise CommunicationError(
                            f"rank {me}: a process without the pipeline's token connected to its "
                            "point-to-point socket; refusing it"
                        )
                    self._add(sock, peer)
        except (OSError, TimeoutError, RuntimeError) as e:  # RuntimeError: a store timeout
            self.close()
            raise CommunicationError(
                f"rank {me}: could not connect point-to-point sockets to ranks {peers} within "
                f"{timeout:.0f} s ({e}); every process must build the same Pipeline"
            ) from e
        finally:
            if listener is not None:
                listener.close()
            if path is not None:
                os.unlink(path)
                os.rmdir(os.path.dirname(path))

    @staticmethod
    def _token(store: Any, key: str) -> bytes:
        mine = secrets.token_bytes(16)
        # the first process to get here sets the token; compare_set returns what is stored
        got = store.compare_set(f"{key}/token", b"", mine)
        return bytes(got)

    def _dial(self, peer: int, store: Any, key: str, token: bytes, deadline: float) -> None:
        path = store.get(f"{key}/path/{peer}").decode()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        sock.connect(path)
        sock.sendall(struct.pack("<Q", self.me) + token)
        self._add(sock, peer)

    def _add(self, sock: socket.socket, peer: int) -> None:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, _BUFFER)
        sock.setblocking(False)
        self.links[peer] = _Link(sock, peer)
        if self._finalizer is None:
            self._finalizer = weakref.finalize(self, _close, self.links)

    def has(self, peer: int) -> bool:
        return peer in self.links

    # ------------------------------------------------------------------ messages
    def send(self, tensor: Tensor, peer: int, what: str = "") -> _Sent:
        """Queue ``tensor`` (contiguous, CPU; kept alive until its bytes are out) for ``peer``;
        the handle is ready once the kernel holds all its bytes."""
        link = self.links[peer]
        view = _bytes(tensor)
        item = _Outgoing(_HEADER.pack(len(view), link.sent), view, tensor)
        link.out.append(item)
        link.sent += 1
        try:
            link.flush()
        except OSError as e:
            raise self.on_error(e, f"rank {self.me}: send to rank {peer}") from e
        return _Sent(self, item, what or f"rank {self.me}: send to rank {peer}")

    def recv(self, buffers: Sequence[Tensor], peer: int, what: str) -> _Receive:
        """Expect ``buffers`` (contiguous CPU tensors) next from ``peer``, in this order."""
        link = self.links[peer]
        items = []
        for b in buffers:
            items.append(_Incoming(b, link.received))
            link.received += 1
        link.expect.extend(items)
        # no read here: a receive is usually posted before its data is sent; the next check for
        # data (ready or wait, on any receive) reads whatever has arrived
        return _Receive(self, items, what)

    def progress(self) -> None:
        """Move every queued byte forward, in both directions, without blocking."""
        for link in self.links.values():
            try:
                if link.out:
                    link.flush()
            except OSError as e:
                raise self.on_error(e, f"rank {self.me}: send to rank {link.peer}") from e
            try:
                if link.expect:
                    link.drain(self.me)
            except OSError as e:
                raise self.on_error(e, f"rank {self.me}: receive from rank {link.peer}") from e

    def flush(self, what: str) -> None:
        """Wait until every queued message has been handed to the kernel."""
        self.wait_until(lambda: not any(link.out for link in self.links.values()), what)

    def wait_until(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout
        poller = select.poll()
        registered: dict[int, int] = {}
        while True:
            self.progress()
            if done():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.on_error(
                    TimeoutError(f"no data within {self.timeout:.0f} s"), f"{what} (timed out)"
                )
            by_fd = {}
            for link in self.links.values():
                fd = link.sock.fileno()
                by_fd[fd] = link
                mask = (select.POLLIN if link.expect else 0) | (select.POLLOUT if link.out else 0)
                if link.hung_up and not mask:
                    mask = 0  # a closed peer we need nothing from: do not wake up for it
                if registered.get(fd) != mask:
                    if fd in registered:
                        poller.unregister(fd)
                        del registered[fd]
                    if mask:
                        poller.register(fd, mask)
                        registered[fd] = mask
            for fd, event in poller.poll(min(left, 1.0) * 1000):
                if event & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                    by_fd[fd].hung_up = True  # progress() raises if we still need that peer

    def close(self) -> None:
        _close(self.links)


def _close(links: dict[int, _Link]) -> None:
    for link in links.values():
        with contextlib.suppress(OSError):
            link.sock.close()
    links.clear()


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("the peer closed the connection during set-up")
        data += chunk
    return bytes(data)
