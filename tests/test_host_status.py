"""A host's heartbeat verdict from its backend's health: cordon, and when a backend outage
counts towards failing the host's rollouts. Unit tests with a stand-in backend; the real
Docker path (dockerd stopped and started) is in tests/faults/."""

from __future__ import annotations

import pytest

from orchestrator.queue import worker
from orchestrator.sandbox.backend import HostHealth
from orchestrator.state.heartbeat import HostFinding


class _Backend:
    def __init__(self, health: HostHealth) -> None:
        self.health = health

    def host_health(self) -> HostHealth:
        return self.health


def _status(monkeypatch: pytest.MonkeyPatch, health: HostHealth, failures: int) -> HostFinding:
    monkeypatch.setattr(worker, "backend", lambda: _Backend(health))
    return worker.host_status(HostFinding(docker_failures=failures))


def test_a_failed_docker_probe_counts_towards_failing_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    down = HostHealth(docker_ok=False, disk_free_bytes=2**40, sandboxes=3, error="refused")
    status = _status(monkeypatch, down, 2)
    assert status.docker_failures == 3
    assert any(reason.startswith("daemon: refused") for reason in status.cordon_reasons)


def test_an_api_server_outage_cordons_but_never_fails_the_rollouts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Pods run on while the API server is away: new sandboxes wait, live ones are served.
    down = HostHealth(
        docker_ok=False,
        disk_free_bytes=2**40,
        sandboxes=3,
        error="api server unreachable",
        outage_loses_sandboxes=False,
    )
    status = _status(monkeypatch, down, 0)
    assert status.docker_failures == 0
    assert "daemon: api server unreachable" in status.cordon_reasons


def test_a_healthy_probe_resets_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    up = HostHealth(docker_ok=True, disk_free_bytes=2**40, sandboxes=0)
    status = _status(monkeypatch, up, 2)
    assert status.docker_failures == 0
    assert not any(reason.startswith("daemon") for reason in status.cordon_reasons)
