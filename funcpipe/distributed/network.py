"""Where a launched job listens: on the host it is given only, the loopback by default.

The launcher's rendezvous store serves on a socket bound to that host (:func:`listen`), and a
gloo rank on the loopback is told to use the loopback interface (:func:`loopback_interface`),
so that nothing of a job listens on another interface unless asked (see docs/security.md).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket

__all__ = ["is_loopback", "listen", "loopback_interface"]


def listen(host: str) -> tuple[int, int]:
    """A listening socket bound to ``host`` only (port chosen by the OS): ``(fd, port)``.

    The launcher's store serves on this socket. Given a host alone, torch's ``TCPStore`` listens
    on every interface; handing it a socket bound to ``host`` keeps it there (loopback by
    default), and there is no window between choosing a port and binding it.
    """
    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    s = socket.socket(family, kind, proto)
    try:
        s.bind(addr[:2] if family == socket.AF_INET else addr)
        s.listen(1024)
        port = int(s.getsockname()[1])
    except BaseException:
        s.close()
        raise
    return s.detach(), port  # the store owns (and closes) the descriptor from now on


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS)."""
    with contextlib.suppress(OSError):
        names = [name for _, name in socket.if_nameindex()]
        for name in ("lo", "lo0"):
            if name in names:
                return name
    return None
