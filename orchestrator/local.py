"""Run a whole deployment (API, worker, reaper) on this machine for the length of a ``with``
block: what ``make demo`` and the benchmarks use. The same processes as ``orchestrator up``."""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from orchestrator.config import Settings
from orchestrator.environments.loader import EnvironmentRegistry
from orchestrator.sandbox.factory import make_backend
from orchestrator.sandbox.gc import collect_expired
from orchestrator.state.connection import worker_client
from orchestrator.state.forget import forget_deployment
from orchestrator.state.keys import Keys
from orchestrator.state.pool_sizing import targets
from orchestrator.state.pools import PoolFiller
from orchestrator.tls import tls

# Destroys at once at the local stack's end: each mostly waits on dockerd, which takes
# them in parallel (2 cores, 32 idle runc sandboxes: 12 a second one at a time, 21 eight at
# a time).
TEARDOWN_PARALLEL = 8


_PICKED: dict[int, int] = {}
"""Ports this process picked, each with the descriptor of its lock, held while it lives."""
PORTS_BELOW_EPHEMERAL = 12_000
"""How many ports below the kernel's ephemeral range :func:`free_port` picks from."""


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now, for a listener started
    soon (an API, a metrics endpoint, a test's model server). Picked below the kernel's
    ephemeral range: a port picked by binding port 0 is one the kernel also gives outgoing
    connections, and a Redis or HTTP client took one as its own address between the pick
    and the listener's bind (a test's judge server failed with EADDRINUSE). Held by a lock
    file (``<tmp>/orchestrator-ports/<port>``) while this process lives, so processes picking at
    once (the suite's xdist workers) never pick the same one; a process's end frees it."""
    low = _ephemeral_low()
    locks = Path(tempfile.gettempdir()) / "orchestrator-ports"
    locks.mkdir(exist_ok=True)
    for _ in range(1000):
        port = random.randrange(max(1024, low - PORTS_BELOW_EPHEMERAL), low)  # noqa: S311
        if port in _PICKED:
            continue
        fd = os.open(locks / str(port), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
        except OSError:  # another process holds it, or something listens there
            os.close(fd)
            continue
        _PICKED[port] = fd
        return port
    raise RuntimeError(f"no free port among the {PORTS_BELOW_EPHEMERAL} below {low}")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment that makes child processes see ``settings``."""
    env = dict(os.environ)
    for name, value in settings.model_dump(mode="json").items():
        if value is None:
            continue
        # pydantic-settings reads complex fields (maps, lists) from the environment as JSON.
        text = json.dumps(value) if isinstance(value, dict | list) else str(value)
        env[f"ORCH_{name.upper()}"] = text
    return env


def end_sandboxes(settings: Settings, environments: EnvironmentRegistry) -> tuple[int, int]:
    """Destroy every sandbox of this deployment on this machine (warm pools' included) and
    drop the pool entries that named them: the local stack's end, once its worker stopped
    (rollouts/teardown.py ended their rollouts first). Returns (destroyed, pool entries
    dropped)."""
    report = collect_expired(make_backend(settings), everything=True, parallel=TEARDOWN_PARALLEL)
    client = worker_client(settings.redis_url, Keys.of(settings.deployment).client_name("up"))
    try:
        filler = PoolFiller(settings, client)
        dropped = sum(
            filler.forget_missing(pool, settings.host_id, live=set())
            for pool in targets(environments, settings, filler.demand())
        )
    finally:
        client.close()
    return len(report.destroyed), dropped


@contextmanager
def local_stack(
    settings: Settings, *, log: Path | None = None, forget: bool = False
) -> Iterator[str]:
    """Start ``orchestrator up`` with ``settings``; yield its base URL once ready.

    The deployment is this block's own: when it ends, every sandbox it still has is
    destroyed, and with ``forget`` every key it left in Redis (its records included: a
    benchmark's thousands of rollouts are kept for days otherwise)."""
    out = log.open("ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "up"],
        env=settings_env(settings),
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    base = f"http://{settings.api_host}:{settings.api_port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the stack exited with {proc.returncode} (log: {log})")
            try:
                if httpx.get(f"{base}/readyz", timeout=2, verify=tls()).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stack was not ready within 90 s (log: {log})")
            time.sleep(0.3)
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        collect_expired(make_backend(settings), everything=True)
        if forget:
            forget_deployment(settings.redis_url, settings.deployment)
