"""Every deployment the suite starts, made one way: a real API, Celery worker and reaper as
subprocesses on real Redis and dockerd (or a Kubernetes control plane), with a deployment
name, ports, host id and logs of its own.

- :func:`deployment` makes a :class:`Stack` (not started): the test run's base settings
  with a deployment named after it, fields on top, and the environment its processes see
  derived from those settings (``orchestrator.local.settings_env``), so the settings a test
  reads and the ones its processes run with cannot differ.
- :func:`running` starts a stack's processes, waits for it to be ready, and at the end
  stops them, destroys what its hosts still hold and forgets its Redis keys.
- :class:`Stacks` is the session's shelf of shared deployments: the first test that asks
  for one by name starts it, later ones borrow it, and the session's end stops it. Tests
  that differ only by the environments they run borrow one stack whose environments file
  holds them all (tests/e2e/conftest.py's ``side_stack``), rather than each starting one.

A stack's settings are the fixture ``settings`` (tests/conftest.py) plus :data:`TEST_FIELDS`
plus the caller's fields; its deployment is ``<run's deployment>-<name>``, under the
run's prefix, so the leak check and the session's Redis sweep find whatever it leaves.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from orchestrator.cli.serve import api_command, reaper_command, worker_command
from orchestrator.config import Settings
from orchestrator.local import free_port, settings_env
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.sandbox.gc import collect_expired
from orchestrator.state.forget import forget_deployment
from orchestrator.tls import tls

TOKEN = "e2e-token-" + uuid.uuid4().hex[:8]

Role = Literal["worker", "reaper", "api"]
ROLES: tuple[Role, ...] = ("worker", "reaper", "api")

TEST_FIELDS: dict[str, Any] = {
    "api_tokens": TOKEN,
    "log_format": "json",  # the tests read the processes' logs line by line
    # Beats and reaper passes within a test's patience.
    "heartbeat_interval_s": 1.0,
    "reaper_interval_s": 2.0,
    # Every test reaches a stack from 127.0.0.1, and the fuzz tests fail authentication by
    # the thousand on purpose: the lock-out of guessing is tested on an API of its own
    # (tests/e2e/test_tenancy.py).
    "auth_failures_max": 1_000_000,
}
"""What every test deployment runs with besides the product's defaults."""


@dataclass
class Stack:
    """One deployment's processes, by name, and how to reach them."""

    settings: Settings
    env: dict[str, str]
    codebase: str
    logs: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.api_port}"

    def client(self, **kw: Any) -> httpx.Client:
        """An HTTP client of the stack's API, with the token (on the process's one TLS
        context: see orchestrator/tls.py for what a client of its own costs)."""
        return httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=60,
            verify=tls(),
            **kw,
        )

    def async_client(self, **kw: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=60,
            verify=tls(),
            **kw,
        )

    def command(self, role: Role) -> list[str]:
        """The command line of one of the deployment's processes."""
        if role == "worker":
            return worker_command(self.settings)
        if role == "reaper":
            return reaper_command(self.settings)
        return api_command(self.settings)

    def start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> None:
        log = (self.logs / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            command, env=env or self.env, stdout=log, stderr=subprocess.STDOUT
        )

    def start_role(self, role: Role, **env: str) -> None:
        """Start the deployment's ``role`` process, with ``env`` on top of its own."""
        self.start(role, self.command(role), env={**self.env, **env})

    def stop(self, name: str, sig: int = 15) -> None:
        proc = self.procs.pop(name)
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def restart(self, *roles: Role, **env: str) -> None:
        """Stop ``roles`` (those running) and start them again with ``env`` on top of the
        stack's own (none: as configured), then wait until the stack is ready."""
        for role in roles:
            if role in self.procs:
                self.stop(role)
        for role in roles:
            self.start_role(role, **env)
        self.wait_ready()

    def restart_worker(self, **env: str) -> None:
        """Stop the worker (if running) and start a new one, with ``env`` on top."""
        self.restart("worker", **env)

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited: see {self.logs}/{name}.log")
            try:
                response = httpx.get(f"{self.base_url}/readyz", timeout=2, verify=tls())
                if response.status_code == 200:
                    return
                last = response.text
            except httpx.HTTPError as exc:
                last = str(exc)
            time.sleep(0.2)
        raise RuntimeError(f"stack not ready in {timeout_s} s: {last}")

    def stop_all(self) -> None:
        """Stop every process, the reaper first: its passes would wait for a worker that
        is gone."""
        for name in sorted(self.procs, key=lambda name: name != "reaper"):
            self.stop(name)

    def shut_down(self, *hosts: Settings) -> None:
        """Stop every process, destroy what the hosts' daemons still hold for this
        deployment, and forget its Redis keys."""
        self.stop_all()
        for host in hosts or (self.settings,):
            backend = DockerBackend(host)
            try:
                collect_expired(backend, everything=True)
            finally:
                backend.client.close()
        flush_redis(self.settings)


def flush_redis(settings: Settings) -> None:
    """Forget the deployment's keys: state, queues and kombu's bindings of them."""
    forget_deployment(settings.redis_url, settings.deployment)


def deployment(
    base: Settings,
    name: str,
    *,
    logs: Path,
    codebase: str = "",
    env: Mapping[str, str] | None = None,
    **fields: Any,
) -> Stack:
    """A stack (not started) of deployment ``<base.deployment>-<name>``: ``base`` with
    :data:`TEST_FIELDS`, a free API port, no worker or reaper metrics port unless asked,
    host id ``<name>-<random>``, and ``fields`` on top. Its processes' environment is those
    settings (``orchestrator.local.settings_env``) and ``env`` (what is not a setting:
    ``KUBECONFIG``, ``PYTHONPATH``, a debug switch)."""
    settings = base.model_copy(
        update={
            **TEST_FIELDS,
            "deployment": f"{base.deployment}-{name}",
            "api_port": free_port(),
            "worker_metrics_port": 0,
            "reaper_metrics_port": 0,
            "host_id": f"{name}-{uuid.uuid4().hex[:6]}",
            **fields,
        }
    )
    logs.mkdir(parents=True, exist_ok=True)
    return Stack(
        settings=settings,
        env={**settings_env(settings), **(env or {})},
        codebase=codebase,
        logs=logs,
    )


@contextlib.contextmanager
def running(
    stack: Stack, roles: tuple[Role, ...] = ROLES, *, hosts: tuple[Settings, ...] = ()
) -> Iterator[Stack]:
    """``stack`` with ``roles`` started and ready; stopped, its sandboxes destroyed (on
    ``hosts``' daemons, default its own) and its Redis keys forgotten at the end, whatever
    the block did to it."""
    try:
        for role in roles:
            stack.start_role(role)
        stack.wait_ready()
        yield stack
    finally:
        stack.shut_down(*hosts)


@contextlib.contextmanager
def another_api(stack: Stack, logs: Path, **fields: Any) -> Iterator[Stack]:
    """A second API process of ``stack``'s deployment (its Redis keys, its worker), with
    ``fields`` on top of its settings and a port of its own: for a test about the API
    alone (a debug switch, several worker processes), which need not start a deployment."""
    settings = stack.settings.model_copy(update={"api_port": free_port(), **fields})
    api = Stack(settings=settings, env=settings_env(settings), codebase=stack.codebase, logs=logs)
    api.start_role("api")
    try:
        api.wait_ready()
        yield api
    finally:
        api.stop_all()


@dataclass(frozen=True)
class _Shelved:
    spec: tuple[Any, ...]
    stack: Stack


class Stacks:
    """The session's shared deployments (the fixture ``stacks``): :meth:`borrow` starts a
    stack the first time a name is asked for and hands the same one out after; the
    session's end stops them all. One xdist worker's: workers share nothing."""

    def __init__(self, base: Settings, root: Path) -> None:
        self.base = base
        self.root = root
        self._shelf: dict[str, _Shelved] = {}
        self._exit = contextlib.ExitStack()

    def borrow(
        self,
        name: str,
        *,
        codebase: str = "",
        roles: tuple[Role, ...] = ROLES,
        env: Mapping[str, str] | None = None,
        **fields: Any,
    ) -> Stack:
        """The shared stack ``name``, started on first use with these settings. Asking for
        a name with other settings is a mistake in the suite, and fails loudly."""
        spec = (codebase, roles, sorted((env or {}).items()), sorted(fields.items(), key=str))
        shelved = self._shelf.get(name)
        if shelved is not None:
            if shelved.spec != spec:
                raise AssertionError(f"stack {name!r} was borrowed before with other settings")
            return shelved.stack
        stack = deployment(
            self.base, name, logs=self.root / name, codebase=codebase, env=env, **fields
        )
        self._exit.enter_context(running(stack, roles))
        self._shelf[name] = _Shelved(spec, stack)
        return stack

    def close(self) -> None:
        self._exit.close()
