"""The worker's and the reaper's exec probes (helm/orchestrator/files/probes/), run as the
kubelet runs them, against the real Redis and a real heartbeat."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import redis

from orchestrator.config import Settings
from orchestrator.state.forget import forget_deployment
from tests.chart.conftest import CHART

PROBES = CHART / "files" / "probes"
HOST = "worker-probe-0"


def probe_env(settings: Settings, **overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ORCH_")}
    env.update(
        ORCH_DEPLOYMENT=settings.deployment,
        ORCH_STATE_DIR=str(settings.state_dir),
        ORCH_REDIS_URL=settings.redis_url,
        ORCH_HOST_ID=HOST,
    )
    env.update(overrides)
    return env


def run_probe(script: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(PROBES / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture
def redis_keys(settings: Settings) -> Iterator[redis.Redis]:
    """The test's Redis, emptied of this deployment's keys afterwards."""
    client = redis.Redis.from_url(settings.redis_url)
    try:
        yield client
    finally:
        client.close()
        forget_deployment(settings.redis_url, settings.deployment)


def test_worker_probe_follows_the_real_heartbeat(
    settings: Settings, redis_keys: redis.Redis
) -> None:
    env = probe_env(settings)
    assert run_probe("worker_probe.py", env, "ready").returncode == 1
    assert run_probe("worker_probe.py", env, "alive").returncode == 1
    # What a worker publishes, written by the worker's own code in a process of its own.
    beat = (
        "from orchestrator.queue.worker import current; "
        "from orchestrator.state.heartbeat import HostFinding; "
        "current().publish_heartbeat(HostFinding())"
    )
    subprocess.run([sys.executable, "-c", beat], env=env, check=True, timeout=60)
    ready = run_probe("worker_probe.py", env, "ready")
    assert ready.returncode == 0, ready.stdout + ready.stderr
    assert run_probe("worker_probe.py", env, "alive").returncode == 0
    # Another pod's heartbeat is not this pod's.
    other = probe_env(settings, ORCH_HOST_ID="worker-probe-1")
    assert run_probe("worker_probe.py", other, "ready").returncode == 1


def test_worker_probe_does_not_restart_workers_for_a_redis_outage(settings: Settings) -> None:
    # A port nothing listens on: Redis is down for this probe.
    env = probe_env(settings, ORCH_REDIS_URL="redis://127.0.0.1:1/0")
    alive = run_probe("worker_probe.py", env, "alive")
    assert alive.returncode == 0, alive.stdout + alive.stderr
    assert "redis unreachable" in alive.stdout
    assert run_probe("worker_probe.py", env, "ready").returncode == 1


def test_reaper_probe_follows_the_real_reapers_loop(
    settings: Settings, redis_keys: redis.Redis
) -> None:
    """The real reaper (a process of its own, ``orchestrator reaper``) touches its file
    after each turn of its loop; the probe reads its age."""
    env = probe_env(settings, ORCH_REAPER_INTERVAL_S="0.2", ORCH_REAPER_METRICS_PORT="0")
    alive = settings.reaper_alive_file
    alive.unlink(missing_ok=True)
    try:
        missing = run_probe("reaper_probe.py", env)
        assert missing.returncode == 1
        assert "has not finished a first try" in missing.stdout
        reaper = subprocess.Popen(
            [sys.executable, "-m", "orchestrator.cli", "reaper"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 60
            while not alive.exists():
                assert reaper.poll() is None, reaper.stderr.read() if reaper.stderr else ""
                assert time.monotonic() < deadline, "the reaper never turned"
                time.sleep(0.1)
            fresh = run_probe("reaper_probe.py", env)
            assert fresh.returncode == 0, fresh.stdout + fresh.stderr
        finally:
            reaper.terminate()
            assert reaper.wait(timeout=30) == 0
        # Three intervals and the pass allowance: a loop stuck that long is restarted.
        stale = time.time() - (3 * 0.2 + 121)
        os.utime(alive, (stale, stale))
        old = run_probe("reaper_probe.py", env)
        assert old.returncode == 1
        assert "last turned" in old.stdout
    finally:
        alive.unlink(missing_ok=True)
