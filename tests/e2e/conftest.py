"""A real stack for end-to-end tests: Redis (started by `make test`'s host set-up), a Celery
worker and the API (uvicorn) as subprocesses, real sandboxes, a real codebase.

The stack gets its own deployment name, so its Redis keys, queues and sandboxes are its own.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from orchestrator.config import Settings
from orchestrator.environments.examples import ensure_requests_codebase
from orchestrator.images.codebases import remove_codebase
from orchestrator.local import free_port
from orchestrator.sandbox.docker import DockerBackend
from orchestrator.sandbox.gc import collect_expired
from orchestrator.state.keys import Keys
from tests.redis_units import delete_keys

TOKEN = "e2e-token-" + uuid.uuid4().hex[:8]


@dataclass
class Stack:
    settings: Settings
    env: dict[str, str]
    base_url: str
    codebase: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: Path | None = None

    def client(self, **kw: Any) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60, **kw
        )

    def async_client(self, **kw: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60, **kw
        )

    def start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> None:
        assert self.logs is not None
        log = (self.logs / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            command, env=env or self.env, stdout=log, stderr=subprocess.STDOUT
        )

    def stop(self, name: str, sig: int = 15) -> None:
        proc = self.procs.pop(name)
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def shut_down(self, *hosts: Settings) -> None:
        """Stop every process, destroy what the hosts' daemons still hold for this
        deployment, and forget its Redis keys."""
        for name in list(self.procs):
            self.stop(name)
        for host in hosts or (self.settings,):
            collect_expired(DockerBackend(host), everything=True)
        flush_redis(self.settings)

    def restart_worker(self, **env: str) -> None:
        """Stop the worker (if running) and start a new one, with ``env`` on top."""
        from orchestrator.cli.serve import worker_command

        if "worker" in self.procs:
            self.stop("worker")
        self.start("worker", worker_command(self.settings), env={**self.env, **env})
        self.wait_ready()

    def wait_ready(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited: see {self.logs}/{name}.log")
            try:
                response = httpx.get(f"{self.base_url}/readyz", timeout=2)
                if response.status_code == 200:
                    return
                last = response.text
            except httpx.HTTPError as exc:
                last = str(exc)
            time.sleep(0.2)
        raise RuntimeError(f"stack not ready in {timeout_s} s: {last}")


def stack_env(settings: Settings) -> dict[str, str]:
    return {
        **os.environ,
        "ORCH_DEPLOYMENT": settings.deployment,
        "ORCH_STATE_DIR": str(settings.state_dir),
        "ORCH_API_TOKENS": TOKEN,
        "ORCH_API_PORT": str(settings.api_port),
        "ORCH_HOST_ID": settings.host_id,
        "ORCH_HEARTBEAT_INTERVAL_S": "1",
        "ORCH_REAPER_INTERVAL_S": "2",
        "ORCH_LOG_FORMAT": "json",
        # Several workers run on this machine: each stack names its own port (0: none).
        "ORCH_WORKER_METRICS_PORT": str(settings.worker_metrics_port),
    }


@pytest.fixture(scope="session")
def stack(
    settings: Settings, base_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    stack_settings = settings.model_copy(
        update={
            "deployment": settings.deployment + "-e2e",
            "api_port": free_port(),
            "worker_metrics_port": free_port(),
            "host_id": f"h1-{uuid.uuid4().hex[:6]}",
            "api_tokens": TOKEN,
            "log_format": "json",  # as stack_env says: commands built from it agree
        }
    )
    codebase = f"e2e-requests-{uuid.uuid4().hex[:6]}"
    # A real open-source codebase, offline: the `requests` library as a git repository.
    ensure_requests_codebase(stack_settings, codebase)
    stack = Stack(
        settings=stack_settings,
        env=stack_env(stack_settings),
        base_url=f"http://127.0.0.1:{stack_settings.api_port}",
        codebase=codebase,
        logs=tmp_path_factory.mktemp("logs"),
    )
    from orchestrator.cli.serve import api_command, worker_command

    try:
        stack.start("worker", worker_command(stack_settings))
        stack.start("api", api_command(stack_settings))
        stack.wait_ready()
        yield stack
    finally:
        stack.shut_down()
        remove_codebase(stack_settings, codebase)


def flush_redis(settings: Settings) -> None:
    delete_keys(settings.redis_url, Keys.of(settings.deployment).prefix + "*")


def python() -> str:
    return sys.executable


# --- fixtures added for the end-to-end suite (issue 3) -------------------------------------


@pytest.fixture(scope="session")
def finqa_codebase(stack: Stack) -> str:
    """The `finqa-corpus` codebase the `finqa-demo` environment runs (built if missing)."""
    from orchestrator.environments.examples import FINQA_CODEBASE, ensure_finqa_corpus

    ensure_finqa_corpus(stack.settings)
    return FINQA_CODEBASE


@pytest.fixture()
def planning_item(stack: Stack) -> dict[str, Any]:
    """A codebase-planning dataset row on the stack's real codebase."""
    return {
        "codebase": stack.codebase,
        "prompt": "Make Session.request honour a default timeout.",
        "gold_files": ["src/requests/sessions.py", "src/requests/adapters.py"],
    }


REAPER_ENVIRONMENTS = {
    # Tiny timeouts so the reaper (beat every second) acts within the test's patience.
    "codebase-planning": {"idle_timeout_s": 4, "grace_after_grade_s": 2},
}


def reaper_environments_yaml(path: Path) -> Path:
    import yaml

    from orchestrator.environments.loader import default_environments_text

    data = yaml.safe_load(default_environments_text())
    for env in data["environments"]:
        env.update(REAPER_ENVIRONMENTS.get(env["name"], {}))
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@contextlib.contextmanager
def side_stack(
    stack: Stack,
    root: Path,
    *,
    name: str,
    environments_file: Path,
    env: dict[str, str] | None = None,
    **settings: Any,
) -> Iterator[Stack]:
    """A separate stack beside ``stack`` (own deployment, worker, beat, API port, Redis
    keys), on ``environments_file``, sharing ``stack``'s codebase image and state dir
    (sandbox socket paths must stay short; they are per sandbox id, so deployments never
    collide there). ``env``: more ORCH_* variables; ``settings``: the same, as fields."""
    side = stack.settings.model_copy(
        update={
            "deployment": f"{stack.settings.deployment}-{name}",
            "api_port": free_port(),
            "worker_metrics_port": free_port(),
            "host_id": f"{name}-{uuid.uuid4().hex[:6]}",
            "environments_file": environments_file,
            "reaper_interval_s": 1.0,
            "heartbeat_interval_s": 1.0,
            **settings,
        }
    )
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = Stack(
        settings=side,
        env={
            **stack_env(side),
            "ORCH_ENVIRONMENTS_FILE": str(environments_file),
            "ORCH_REAPER_INTERVAL_S": "1",
            **(env or {}),
        },
        base_url=f"http://127.0.0.1:{side.api_port}",
        codebase=stack.codebase,
        logs=logs,
    )
    from orchestrator.cli.serve import api_command, beat_command, worker_command

    try:
        started.start("worker", worker_command(side))
        started.start("beat", beat_command(side))
        started.start("api", api_command(side))
        started.wait_ready()
        yield started
    finally:
        started.shut_down()


@pytest.fixture(scope="session")
def reaper_stack(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A second, separate stack that also runs beat: the reaper every second, with
    environments whose idle timeout and grace after grading are a few seconds."""
    root = tmp_path_factory.mktemp("reaper-stack")
    env_file = reaper_environments_yaml(root / "environments.yaml")
    with side_stack(stack, root, name="r", environments_file=env_file) as second:
        yield second
