"""The fault suite's own infrastructure, so that breaking it disturbs no other test: a
Redis server (AOF on) and a deployment (API, one worker, reaper) on the suite's own dockerd.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import httpx
import redis
import requests

from orchestrator.config import Settings
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.sandbox.gc import collect_expired
from orchestrator.state.connection import redis_client
from orchestrator.state.keys import Keys
from orchestrator.tls import tls
from tests.daemons import DockerDaemon
from tests.redis_ha import RedisServer, Sentinels
from tests.stacks import TOKEN, Stack

DAEMON_BACK_S = 30.0
"""How long reading a ledger waits for a daemon a test stopped to answer again."""


@dataclass
class FaultStack:
    """The deployment under test and handles on everything it runs on."""

    stack: Stack
    daemon: DockerDaemon
    docker: docker.DockerClient
    redis: RedisServer
    state_dir: Path
    # Behind Sentinel (tests/faults/test_failover.py): the set ``redis`` is the first
    # primary of.
    sentinels: Sentinels | None = None

    @property
    def settings(self) -> Settings:
        return self.stack.settings

    @property
    def deployment(self) -> str:
        return self.settings.deployment

    @property
    def token(self) -> str:
        return TOKEN

    # -- processes ---------------------------------------------------------------------------

    def kill_worker(self) -> None:
        """kill -9 the worker: no shutdown hook, no retired heartbeat, no settled tickets."""
        proc = self.stack.procs.pop("worker")
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def start_worker(self) -> None:
        self.stack.start_role("worker")

    def reconnect_docker(self) -> None:
        self.docker.close()
        self.docker = self.daemon.wait_ready()

    def wait_healthy(self, timeout_s: float = 60) -> None:
        """API ready, and the worker's heartbeat says its daemon answers (schedulable)."""
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            for name, proc in self.stack.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited: see {self.stack.logs}/{name}.log")
            try:
                response = httpx.get(f"{self.stack.base_url}/readyz", timeout=3, verify=tls())
                last = response.text
                if response.status_code == 200 and self._schedulable():
                    return
            except (httpx.HTTPError, redis.RedisError) as exc:
                last = repr(exc)
            time.sleep(0.2)
        raise RuntimeError(f"the fault stack is not healthy after {timeout_s} s: {last}")

    def log_lines(self, rollout_id: str, limit: int = 80) -> list[str]:
        """The stack's log lines (api, worker, reaper) that name ``rollout_id``, by file."""
        found: list[str] = []
        for log in sorted(self.stack.logs.glob("*.log")) if self.stack.logs else []:
            with contextlib.suppress(OSError):
                for line in log.read_text(errors="replace").splitlines():
                    if rollout_id in line:
                        found.append(f"{log.stem}: {line[:400]}")
        return found[-limit:]

    def heartbeat_gone(self) -> bool:
        client = redis_client(self.settings.redis_url, socket_timeout=2)
        try:
            return not client.exists(
                Keys.of(self.settings.deployment).heartbeat(self.settings.host_id)
            )
        finally:
            client.close()

    def _schedulable(self) -> bool:
        client = redis_client(self.settings.redis_url, socket_timeout=2)
        try:
            raw = client.get(Keys.of(self.settings.deployment).heartbeat(self.settings.host_id))
        finally:
            client.close()
        return raw is not None and bool(json.loads(raw).get("schedulable"))

    # -- sandboxes ---------------------------------------------------------------------------

    def _filters(self, **labels: str) -> dict[str, Any]:
        wanted = {"orchestrator.deployment": self.deployment, **labels}
        return {"label": [f"{k}={v}" for k, v in wanted.items()]}

    def containers(self, **labels: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.docker.api.containers(
            all=True, filters=self._filters(**labels)
        )
        return found

    def volumes(self) -> list[dict[str, Any]]:
        found = self.docker.api.volumes(filters=self._filters()).get("Volumes") or []
        return list(found)

    def sandbox_of(self, trace_id: str) -> dict[str, Any] | None:
        found = self.containers(**{"orchestrator.rollout": trace_id})
        return found[0] if found else None

    def read_ledger(self, trace_id: str) -> list[str] | None:
        """The call ids in the rollout's ledger, whatever state its sandbox is in (running,
        paused, stopped): read from its /workspace's upper layer on the host, or through
        the daemon; None when the sandbox is gone."""
        # A rollout may end while a test has the daemon down (stopped, restarting): its
        # ledger is read once the daemon answers again, not given up as unreadable.
        deadline = time.monotonic() + DAEMON_BACK_S
        while True:
            try:
                container = self.sandbox_of(trace_id)
                break
            except (docker.errors.DockerException, requests.exceptions.ConnectionError):
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.2)
        if container is None:
            return None
        sandbox_id = str(container["Labels"].get("orchestrator.sandbox", ""))
        upper = self.state_dir / "upper" / self.deployment / sandbox_id / "upper"
        if upper.is_dir():
            ledger = upper / ".ledger"
            try:
                return ledger.read_text().split()
            except FileNotFoundError:
                return []
        if container.get("State") != "running":
            return None
        try:
            code, output = self.docker.containers.get(container["Id"]).exec_run(
                ["cat", "/workspace/.ledger"]
            )
        except docker.errors.DockerException:
            return None
        assert isinstance(output, bytes)
        return output.decode().split() if code == 0 else []

    def wait_until(
        self, predicate: Callable[[], bool], *, timeout_s: float, interval_s: float = 0.1
    ) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(interval_s)
        return predicate()

    def wait_reaped(self, timeout_s: float) -> tuple[int, int]:
        """Wait for the reaper to destroy every sandbox of the deployment; (containers,
        volumes) left when it did not within ``timeout_s``."""
        self.wait_until(lambda: not self.containers(), timeout_s=timeout_s, interval_s=0.25)
        # A volume goes just after its container.
        self.wait_until(lambda: not self.volumes(), timeout_s=3, interval_s=0.25)
        return len(self.containers()), len(self.volumes())

    def clean(self) -> None:
        """Destroy every sandbox of the deployment the way the product does (containers,
        volumes, upper layers, disks), then remove by force whatever that left."""
        for container in self.containers():
            if container.get("State") == "paused":
                with contextlib.suppress(docker.errors.DockerException):
                    self.docker.api.unpause(container["Id"])
        with contextlib.suppress(Exception):
            collect_expired(DockerBackend(self.settings), everything=True)
        self.remove_leftovers()

    def remove_leftovers(self) -> None:
        """After a test, whatever it left: paused sandboxes unpaused, all of the
        deployment's containers and volumes removed (their upper layers too)."""
        for container in self.containers():
            with contextlib.suppress(docker.errors.NotFound):
                handle = self.docker.containers.get(container["Id"])
                if handle.status == "paused":
                    handle.unpause()
                handle.remove(force=True)
        for volume in self.volumes():
            with contextlib.suppress(docker.errors.NotFound):
                self.docker.api.remove_volume(volume["Name"], force=True)

    def records(self, trace_ids: list[str]) -> dict[str, dict[str, Any] | None]:
        out: dict[str, dict[str, Any] | None] = {}
        with self.stack.client() as http:
            for trace_id in trace_ids:
                response = http.get(f"/v1/rollouts/{trace_id}")
                out[trace_id] = response.json() if response.status_code == 200 else None
        return out
