"""The fault-injection suite's infrastructure and its report.

Everything a fault breaks is the suite's own, so the rest of the suite (running beside it
under xdist) never notices: a Redis server (AOF on) on a free port, a third dockerd
(tests/daemons.py) with its own socket, data root and bridge, and a deployment (API, one
worker, reaper) pointed at both, with short timeouts.

Each test appends one row per fault to a JSON-lines file named by ``ORCH_FAULTS_REPORT``,
which the controlling process creates in ``pytest_configure`` (xdist workers inherit it)
and prints as a table in ``pytest_terminal_summary``.

The deployment's logs (api.log, worker.log, reaper.log) live in its state directory, which
goes with the module; ``ORCH_FAULTS_KEEP_LOGS=<dir>`` copies them there first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from orchestrator.config import Settings
from orchestrator.environments.examples import REQUESTS_CODEBASE, ensure_requests_codebase
from orchestrator.local import free_port
from tests.daemons import DockerDaemon, machine_runtimes, running
from tests.faults.infra import FaultStack
from tests.redis_ha import RedisServer, Sentinels
from tests.stacks import ROLES, deployment, flush_redis

REPO = Path(__file__).resolve().parents[2]

ENVIRONMENT = "faults-requests"
BROKEN_GRADER_ENVIRONMENT = "faults-broken-grader"

# Short on purpose: the suite must run in a few minutes on two cores.
COMMAND_TIMEOUT_S = 5
TIMEOUTS = {
    "command_timeout_s": COMMAND_TIMEOUT_S,
    "command_timeout_max_s": 10,
    "queue_wait_s": 8,
    "heartbeat_interval_s": 1,
    "reaper_interval_s": 1,
    "host_lost_after_s": 5,
    "worker_shutdown_grace_s": 2,
    "sandbox_create_timeout_s": 20,
    "sandbox_memory_mb": 256,
    "sandbox_pids": 64,
    "sandbox_tmp_mb": 32,
    "sandbox_disk_mb": 64,
    "worker_concurrency": 16,
}
IDLE_TIMEOUT_S = 5
# Where upper layers (sandboxes' /workspace writes) go: a tmpfs of its own, so that even if
# the per-sandbox disk cap failed, an agent filling its disk could not fill the machine's.
UPPER_TMPFS = "size=1g,mode=0700"

DAEMON = DockerDaemon(
    name="docker3",
    bridge="orchdocker3",
    address="10.232.0.1/24",
    config={"runtimes": machine_runtimes()},
    shutdown_timeout_s=1,
)


# -- the infrastructure ----------------------------------------------------------------------


def environments_yaml() -> str:
    common = {
        "codebase": REQUESTS_CODEBASE,
        "tools": ["shell", "read_file"],
        "idle_timeout_s": IDLE_TIMEOUT_S,
        "grace_after_grade_s": 1,
        "max_lifetime_s": 300,
    }
    return yaml.safe_dump(
        {
            "environments": [
                {
                    "name": ENVIRONMENT,
                    "description": "Count things in the requests library; numeric answers.",
                    **common,
                    "grader": {"name": "numeric_match", "options": {}},
                },
                {
                    "name": BROKEN_GRADER_ENVIRONMENT,
                    "description": "The same, graded by a grader that always raises.",
                    **common,
                    "grader": {"name": "tests.faults.graders:ExplodingGrader"},
                },
            ]
        },
        sort_keys=False,
    )


def _mount_tmpfs(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", UPPER_TMPFS, "orch-faults-upper", str(path)], check=True
    )


def _umount(path: Path) -> None:
    if path.is_mount():
        # Lazy: a loop device of a sandbox's disk that is still being released must not
        # keep the directory from going.
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture(scope="module")
def fault_stack(settings: Settings, base_image: str) -> Iterator[FaultStack]:
    """Redis + the third dockerd + API, worker and reaper, for the module; everything
    stopped and removed afterwards, whatever the tests did to it."""
    with _running(settings, base_image, "f", sentinel=False) as faults:
        yield faults


@pytest.fixture(scope="module")
def failover_stack(settings: Settings, base_image: str) -> Iterator[FaultStack]:
    """:func:`fault_stack` on a Redis primary with two replicas and three Sentinels
    (tests/redis_ha.py), the deployment reaching it through them, with the worker's claims
    and results on a replica before they count (``redis_replicas_to_wait`` = 1)."""
    with _running(settings, base_image, "fo", sentinel=True) as faults:
        yield faults


@contextlib.contextmanager
def _running(
    settings: Settings, base_image: str, name: str, *, sentinel: bool
) -> Iterator[FaultStack]:
    # The codebase image on the machine's daemon (built once per machine), loaded into ours
    # with the base image (each only when our daemon's copy differs).
    requests_image = ensure_requests_codebase(settings)
    with contextlib.ExitStack() as cleanup:
        # Short path: sandbox sockets live under it, and Unix socket paths are short.
        state_dir = Path(tempfile.mkdtemp(prefix=f"orch-{name}-", dir="/tmp"))
        cleanup.callback(shutil.rmtree, state_dir, ignore_errors=True)
        _mount_tmpfs(state_dir / "upper")
        cleanup.callback(_umount, state_dir / "upper")

        daemon_client = cleanup.enter_context(running(DAEMON, base_image, requests_image))

        sentinels: Sentinels | None = None
        extra: dict[str, object] = {}
        if sentinel:
            sentinels = Sentinels(state_dir / "redis")
            cleanup.callback(sentinels.close)
            sentinels.start()
            server = sentinels.primary()
            redis_url = sentinels.url
            extra["redis_replicas_to_wait"] = 1
        else:
            server = RedisServer(state_dir / "redis", free_port())
            server.start()
            cleanup.callback(server.stop)
            redis_url = server.url

        envs_file = state_dir / "environments.yaml"
        envs_file.write_text(environments_yaml())
        stack = deployment(
            settings,
            name,
            logs=state_dir / "logs",
            codebase=REQUESTS_CODEBASE,
            # The custom grader's module, for the API and the worker.
            env={
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(REPO), os.environ.get("PYTHONPATH")])
                )
            },
            state_dir=state_dir,
            host_id=f"{name}1-{uuid.uuid4().hex[:6]}",
            redis_url=redis_url,
            docker_host=DAEMON.socket,
            environments_file=envs_file,
            default_environment=ENVIRONMENT,
            **TIMEOUTS,
            **extra,
        )
        faults = FaultStack(
            stack=stack,
            daemon=DAEMON,
            docker=daemon_client,
            redis=server,
            state_dir=state_dir,
            sentinels=sentinels,
        )
        cleanup.callback(lambda: faults.docker.close())
        cleanup.callback(_tear_down, faults)
        for role in ROLES:
            stack.start_role(role)
        faults.wait_healthy()
        yield faults


def _tear_down(faults: FaultStack) -> None:
    """Stop the deployment's processes, then remove what it left on our daemon and in our
    Redis (both brought back up if a test left them down)."""
    try:
        for name in list(faults.stack.procs):
            faults.stack.stop(name)
    finally:
        _restore(faults)
        faults.clean()
        flush_redis(faults.settings)
        keep = os.environ.get("ORCH_FAULTS_KEEP_LOGS")  # a directory to copy the logs to
        if keep and faults.stack.logs is not None:
            shutil.copytree(faults.stack.logs, keep, dirs_exist_ok=True)


def _restore(faults: FaultStack) -> None:
    """Daemon and Redis up again (a failed test may have left them down)."""
    if faults.daemon.proc is None or faults.daemon.proc.poll() is not None:
        faults.daemon.proc = None
        faults.daemon.start()
        faults.reconnect_docker()
    if faults.sentinels is not None:
        faults.sentinels.restore()
    elif faults.redis.proc is None or faults.redis.proc.poll() is not None:
        faults.redis.start()


@pytest.fixture()
def faults(fault_stack: FaultStack) -> Iterator[FaultStack]:
    """The stack, healthy; after the test it is made whole again (worker running, daemon and
    Redis up, no sandboxes left), so one test's failure does not become the next one's."""
    fault_stack.wait_healthy()
    yield fault_stack
    _restore(fault_stack)
    for role in ROLES:
        proc = fault_stack.stack.procs.get(role)
        if proc is None or proc.poll() is not None:
            fault_stack.stack.procs.pop(role, None)
            fault_stack.stack.start_role(role)
    fault_stack.clean()
    fault_stack.wait_healthy()
