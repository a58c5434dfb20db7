"""The loopback addresses test_agent_tcp.py's agent listens on: real sockets on ``lo``."""

from __future__ import annotations

import ipaddress
import socket

from tests.k8s import loopback


def test_a_claimed_address_is_loopback_reachable_and_held_until_released() -> None:
    with loopback.held() as (address, port):
        ip = ipaddress.ip_address(address)
        assert ip.is_loopback and ip not in ipaddress.ip_network("127.0.0.0/16")
        with socket.socket() as server:
            server.bind((address, port))
            server.listen()
            with socket.create_connection((address, port), timeout=5):
                pass
        assert address in loopback._held  # not drawn by another caller meanwhile
    assert address not in loopback._held


def test_an_address_whose_port_is_taken_is_not_handed_out() -> None:
    with loopback.held() as (address, _):
        pass  # released: only its port stands in the way now
    with socket.socket() as squatter:
        squatter.bind((address, 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        assert loopback.port_binds(address, taken) is None
        # Drawn at random, the port is free on whatever address comes back.
        other, port = loopback.claim(taken)
        loopback.release(other)
        assert other != address and port == taken
