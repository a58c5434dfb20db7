"""Loopback addresses for a container that listens as a pod does (test_agent_tcp.py's agent).

Test traffic to a plain container goes only to loopback, never to Docker's bridge addresses
(CI machines may not route to them). So the container runs with the host's network and
listens on an address of its own in 127.0.0.0/8, which Linux answers on ``lo`` with no
setup. Addresses are drawn at random
from about sixteen million, never in 127.0.0.0/16 (127.0.0.1, Debian's 127.0.1.1 for the
host name), never one another caller of this process holds, and only once the port binds there:
parallel test processes each draw their own, and the bind catches the rare collision.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from collections.abc import Iterator

_held: set[str] = set()
_lock = threading.Lock()
_ATTEMPTS = 64


class AddressTaken(RuntimeError):
    """No address with the port free was found."""


def port_binds(address: str, port: int) -> int | None:
    """The port bound on ``address`` (a free one for ``port`` 0), or None if it is taken."""
    with socket.socket() as sock:
        # As the exec agent binds (SO_REUSEADDR): a previous pod's connections in TIME_WAIT
        # do not keep its address from the next pod.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError:
            return None
        bound: int = sock.getsockname()[1]
        return bound


def claim(port: int = 0) -> tuple[str, int]:
    """An address in 127.0.0.0/8 held for the caller until ``release``, and a port free on
    it (``port`` itself, or a free one for 0)."""
    with _lock:
        for _ in range(_ATTEMPTS):
            address = (
                f"127.{random.randint(1, 255)}.{random.randint(0, 255)}.{random.randint(1, 254)}"
            )
            if address in _held:
                continue
            bound = port_binds(address, port)
            if bound is not None:
                _held.add(address)
                return address, bound
    raise AddressTaken(f"no loopback address with port {port} free after {_ATTEMPTS} draws")


def release(address: str) -> None:
    """Give ``address`` back (once nothing listens there any more); idempotent."""
    with _lock:
        _held.discard(address)


@contextlib.contextmanager
def held(port: int = 0) -> Iterator[tuple[str, int]]:
    """``claim`` for the length of a ``with`` block."""
    address, bound = claim(port)
    try:
        yield address, bound
    finally:
        release(address)
