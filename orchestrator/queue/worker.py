"""Per-worker-process state: the sandbox backend, the environments, and the heartbeat that
tells the API this host is alive and its daemon answers."""

from __future__ import annotations

import json
import threading
import time
from functools import lru_cache
from typing import Any

import redis

from orchestrator.config import get_settings
from orchestrator.environments.loader import EnvironmentRegistry, load_environments
from orchestrator.observability.logging import get_logger
from orchestrator.sandbox.backend import SandboxError
from orchestrator.sandbox.docker import DockerBackend

log = get_logger(__name__)


@lru_cache(maxsize=1)
def backend() -> DockerBackend:
    return DockerBackend(get_settings())


@lru_cache(maxsize=1)
def environments() -> EnvironmentRegistry:
    return load_environments(get_settings())


@lru_cache(maxsize=1)
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(get_settings().redis_url, max_connections=256)


def reply(payload: dict[str, Any], result: dict[str, Any]) -> None:
    """Push a task's reply to the list its caller waits on (see queue/client.py)."""
    key = payload.get("reply_to")
    if not key:
        return
    client = redis_client()
    with client.pipeline(transaction=False) as pipe:
        pipe.rpush(key, json.dumps(result))
        pipe.expire(key, 300)
        pipe.execute()


def heartbeat_key(host_id: str) -> str:
    return f"{get_settings().key_prefix}worker:{host_id}"


def host_status() -> dict[str, Any]:
    """One heartbeat: is the daemon answering, how many sandboxes does this host hold."""
    settings = get_settings()
    status: dict[str, Any] = {"host": settings.host_id, "time": time.time()}
    try:
        started = time.monotonic()
        docker = backend()
        docker.client.ping()
        status["docker_ok"] = True
        status["docker_ping_ms"] = round((time.monotonic() - started) * 1000, 2)
        status["sandboxes"] = len(docker.list_owned())
    except (SandboxError, Exception) as exc:  # noqa: BLE001 - any failure is evidence
        status["docker_ok"] = False
        status["docker_error"] = str(exc)[:500]
    return status


def start_heartbeat() -> threading.Thread:
    """Publish this host's status every ``heartbeat_interval_s`` with a TTL of three beats,
    so a dead worker's key vanishes on its own.

    Liveness and the daemon's health are measured apart: a daemon slowed by a burst of
    creations must not make a live worker look dead, so the beat never waits on Docker; a
    second thread probes the daemon and the beat publishes its latest finding."""
    settings = get_settings()
    client = redis_client()
    # Replaced whole by the probe (never mutated), so the beat always reads one finding.
    latest: list[dict[str, Any]] = [{"docker_ok": False, "docker_error": "not probed yet"}]

    def probe() -> None:
        while True:
            try:
                latest[0] = host_status()
            except Exception as exc:  # noqa: BLE001 - the probe must outlive any failure
                latest[0] = {"docker_ok": False, "docker_error": f"probe failed: {exc!r}"}
            time.sleep(settings.heartbeat_interval_s)

    def beat() -> None:
        while True:
            status = {**latest[0], "host": settings.host_id, "time": time.time()}
            try:
                ttl = max(1, int(settings.heartbeat_interval_s * 3))
                client.set(heartbeat_key(settings.host_id), json.dumps(status), ex=ttl)
                client.sadd(f"{settings.key_prefix}hosts", settings.host_id)
            except Exception as exc:  # noqa: BLE001 - a dead beat makes a live worker look dead
                log.warning("worker.heartbeat_failed", host=settings.host_id, error=repr(exc))
            time.sleep(settings.heartbeat_interval_s)

    threading.Thread(target=probe, name="docker-probe", daemon=True).start()
    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    return thread
