"""Run a whole deployment (API, worker, beat) on this machine for the length of a ``with``
block: what ``make demo`` and the benchmarks use. The same processes as ``orchestrator up``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
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


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


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
