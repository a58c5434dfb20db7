"""One TLS context per process, for every HTTP client the orchestrator makes.

httpx builds a new context for each client it is not handed one, loading every CA
certificate the machine trusts: 60 ms of CPU per client here (0.3 ms with a shared one),
paid even by a client that only ever speaks plain HTTP to loopback. An operator's
``orchestrator status`` paid it on every refresh, and the test suite's pollers spent a
third of the suite's own CPU on it.
"""

from __future__ import annotations

import ssl
from functools import cache

import httpx


@cache
def tls() -> ssl.SSLContext:
    """The process's TLS context (httpx's defaults: the trusted CAs, ``SSL_CERT_FILE``);
    pass it as ``verify=tls()``."""
    return httpx.create_ssl_context()
