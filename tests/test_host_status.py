"""A host's heartbeat verdict from its backend's health: cordon, and when a backend outage
counts towards failing the host's rollouts. Unit tests with a stand-in backend; the real
Docker path (dockerd stopped and started) is in tests/faults/."""

from __future__ import annotations

import json
from typing import cast

from orchestrator.config import Settings
from orchestrator.queue.worker import Host
from orchestrator.sandbox.backend import HostHealth
from orchestrator.sandbox.factory import HostBackend
from orchestrator.state.heartbeat import Heartbeat, HostFinding


class _Backend:
    def __init__(self, health: HostHealth) -> None:
        self.health = health

    def host_health(self) -> HostHealth:
        return self.health


def _status(health: HostHealth, failures: int) -> HostFinding:
    host = Host(Settings(), backend=cast(HostBackend, _Backend(health)))
    return host.status(HostFinding(backend_failures=failures))


def test_a_failed_docker_probe_counts_towards_failing_the_host() -> None:
    down = HostHealth(backend_ok=False, disk_free_bytes=2**40, sandboxes=3, error="refused")
    status = _status(down, 2)
    assert status.backend_failures == 3
    assert any(reason.startswith("daemon: refused") for reason in status.cordon_reasons)


def test_an_api_server_outage_cordons_but_never_fails_the_rollouts() -> None:
    # Pods run on while the API server is away: new sandboxes wait, live ones are served.
    down = HostHealth(
        backend_ok=False,
        disk_free_bytes=2**40,
        sandboxes=3,
        error="api server unreachable",
        outage_loses_sandboxes=False,
    )
    status = _status(down, 0)
    assert status.backend_failures == 0
    assert "daemon: api server unreachable" in status.cordon_reasons


def test_a_healthy_probe_resets_the_count() -> None:
    up = HostHealth(backend_ok=True, disk_free_bytes=2**40, sandboxes=0)
    status = _status(up, 2)
    assert status.backend_failures == 0
    assert not any(reason.startswith("daemon") for reason in status.cordon_reasons)


def test_a_heartbeat_under_the_old_names_reads_and_is_still_written_with_them() -> None:
    """A worker and an API of the release before (``docker_*``) and of this one
    (``backend_*``) understand each other's heartbeats during a rolling upgrade."""
    old = {"host": "h", "instance": "i", "time": 1.0, "docker_ok": True, "docker_failures": 2}
    beat = Heartbeat.model_validate({**old, "docker_ping_ms": 1.5})
    assert (beat.backend_ok, beat.backend_failures, beat.backend_ping_ms) == (True, 2, 1.5)
    wire = json.loads(beat.model_dump_json())
    assert wire["backend_ok"] is wire["docker_ok"] is True
    assert wire["backend_failures"] == wire["docker_failures"] == 2
    assert Heartbeat.model_validate_json(beat.model_dump_json()) == beat
