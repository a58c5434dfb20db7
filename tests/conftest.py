"""Shared fixtures: a real dockerd, real sandboxes, and a check that nothing leaks.

Each pytest worker gets its own deployment name (``test-<run>-<worker>-...``), so its
sandboxes are told apart by label; the controlling process compares the daemon's
containers, volumes and networks, and the host's loop mounts, loop devices and workspace
images, before and after the whole run and fails the run if this run left any behind.
Resources of another run's deployment (another suite running at the same time on this
machine) are not this run's to answer for: labels say whose a container or volume is, and
a workspace filesystem's path holds its deployment (``.../upper/<deployment>/<sandbox>``).
Leaked loop mounts and devices are removed once reported, so that a failed run does not
leave the host holding them.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from orchestrator.config import Runtime, Settings
from orchestrator.images.base import BaseBuildResult, build_base_image
from orchestrator.sandbox.backend import SandboxHandle, SandboxSpec
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.sandbox.gc import collect_expired
from orchestrator.state.forget import forget_deployment
from tests import agent_caused
from tests.faults.report import REPORT_ENV, read_rows, table

# Fails the run when an xdist group is split across workers (tests/xdist_groups.py);
# records each phase's wall time and slowest tests (tests/timings.py).
pytest_plugins = ["tests.xdist_groups", "tests.timings"]

RUNTIMES: list[Runtime] = ["runc", "runsc"]


RUN_ID = os.environ.setdefault("ORCH_TEST_RUN", uuid.uuid4().hex[:6])
# Pools sized by demand (the product's default) would add pool sandboxes, holding host
# slots, to every stack that runs a reaper: the suite's counts of sandboxes and slots are
# exact, so its stacks keep only hand-set pools, and tests/e2e/test_pool_autosize.py runs
# the default (its stacks set ORCH_POOL_AUTOSIZE=true). Every subprocess inherits this.
os.environ.setdefault("ORCH_POOL_AUTOSIZE", "false")
# Likewise recycling (also the product's default): a sandbox that goes back to its pool
# after its rollout changes those counts; tests/e2e/test_recycling.py runs it.
os.environ.setdefault("ORCH_SANDBOX_REUSE", "false")


def _ours(labels: dict[str, str] | None) -> bool:
    deployment = (labels or {}).get("orchestrator.deployment")
    return deployment is None or deployment.startswith(f"test-{RUN_ID}-")


def _docker_inventory() -> dict[str, set[str]]:
    client = docker.from_env()
    try:
        containers = client.api.containers(all=True)
        volumes = client.api.volumes().get("Volumes") or []
        return {
            "containers": {c["Id"] for c in containers if _ours(c.get("Labels"))},
            "volumes": {v["Name"] for v in volumes if _ours(v.get("Labels"))},
            "networks": {str(n.id) for n in client.networks.list()},
        }
    finally:
        client.close()


def _our_workspace_path(path: str) -> bool:
    return f"/upper/test-{RUN_ID}-" in path


def _host_inventory() -> dict[str, set[str]]:
    """This run's workspace filesystems: mount points, loop devices and image files."""
    with open("/proc/self/mountinfo") as f:
        mounts = {line.split()[4] for line in f if _our_workspace_path(line.split()[4])}
    devices = set()
    for backing in glob.glob("/sys/block/loop*/loop/backing_file"):
        try:
            with open(backing) as f:
                target = f.read().strip()
        except OSError:
            continue  # detached meanwhile
        if _our_workspace_path(target):
            devices.add(f"/dev/{backing.split('/')[3]}={target}")
    images = set(glob.glob(f"/tmp/orch-*/upper/test-{RUN_ID}-*/*.img"))
    return {"loop mounts": mounts, "loop devices": devices, "workspace images": images}


def _inventory() -> dict[str, set[str]]:
    return {**_docker_inventory(), **_host_inventory()}


def _remove_host_leaks(leaked: dict[str, list[str]]) -> None:
    for mount in leaked.get("loop mounts", []):
        subprocess.run(["umount", "-l", mount], capture_output=True)
    for device in leaked.get("loop devices", []):
        subprocess.run(["losetup", "-d", device.split("=")[0]], capture_output=True)
    for image in leaked.get("workspace images", []):
        Path(image).unlink(missing_ok=True)


def _is_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if _is_controller(config):
        config.stash[_inventory_key] = _inventory()
        # The fault suite's rows (tests/faults/report.py) are written by xdist workers and
        # printed here, by the controller, which never loads tests/faults/conftest.py.
        report = Path(tempfile.mkdtemp(prefix=f"orch-faults-{RUN_ID}-")) / "rows.jsonl"
        config.stash[_fault_report_key] = report
        os.environ[REPORT_ENV] = str(report)
        # The same for the agent-caused table (tests/agent_caused.py).
        acts = Path(tempfile.mkdtemp(prefix=f"orch-acts-{RUN_ID}-")) / "rows.jsonl"
        config.stash[_acts_report_key] = acts
        os.environ[agent_caused.REPORT_ENV] = str(acts)


_fault_report_key = pytest.StashKey[Path]()
_acts_report_key = pytest.StashKey[Path]()


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    if _fault_report_key not in config.stash:
        return
    report = config.stash[_fault_report_key]
    rows = read_rows(report)
    shutil.rmtree(report.parent, ignore_errors=True)
    if rows:
        terminalreporter.write_sep("=", "fault injection")
        for line in table(rows):
            terminalreporter.write_line(line)
    acts = config.stash[_acts_report_key]
    act_rows = agent_caused.read_rows(acts)
    shutil.rmtree(acts.parent, ignore_errors=True)
    if act_rows:
        terminalreporter.write_sep("=", "agent-caused: scored, never discarded")
        for line in agent_caused.table(act_rows):
            terminalreporter.write_line(line)


_inventory_key = pytest.StashKey[dict[str, set[str]]]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if not _is_controller(config) or _inventory_key not in config.stash:
        return
    # What this run's deployments (test-<run>-*) left in Redis: a stack whose teardown was
    # cut short, kombu's bindings and empty queues (no expiry). Swept, not failed: the
    # containers and volumes below are what a user would pay for.
    swept = forget_deployment(Settings().redis_url, f"test-{RUN_ID}-*")
    before = config.stash[_inventory_key]
    after = _inventory()
    leaked = {kind: sorted(after[kind] - before.get(kind, set())) for kind in after}
    leaked = {kind: ids for kind, ids in leaked.items() if ids}
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if leaked:
        if reporter is not None:
            reporter.write_line(f"LEAK CHECK FAILED: the suite left behind {leaked}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        _remove_host_leaks(leaked)
    elif reporter is not None:
        reporter.write_line(
            "leak check: no container, volume, network, loop mount or workspace image left behind"
        )
    if reporter is not None:
        reporter.write_line(f"redis sweep: {swept} keys of this run's deployments deleted")


def runsc_available() -> bool:
    client = docker.from_env()
    try:
        runtimes: dict[str, Any] = client.info().get("Runtimes", {})
    finally:
        client.close()
    return "runsc" in runtimes


@pytest.fixture(scope="session")
def settings() -> Iterator[Settings]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    # Short on purpose: sandbox sockets live under it, and Unix socket paths are short.
    state_dir = Path(tempfile.mkdtemp(prefix="orch-", dir="/tmp"))
    try:
        yield Settings(
            deployment=f"test-{RUN_ID}-{worker}-{uuid.uuid4().hex[:4]}", state_dir=state_dir
        )
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def client() -> Iterator[docker.DockerClient]:
    """A client of the test machine's dockerd, for looking behind the backend's back."""
    client = docker.from_env()
    # Tests' threads use it while pytest rewrites PYTEST_CURRENT_TEST, and requests looks
    # for proxies in os.environ on every request: iterating os.environ as it changes raised
    # KeyError (seen cutting a pod's teardown short). A unix socket takes no proxy.
    client.api.trust_env = False
    yield client
    client.close()


@pytest.fixture(scope="session")
def base(settings: Settings) -> BaseBuildResult:
    """The base image, built once per run (a no-op when its inputs are unchanged)."""
    return build_base_image(settings)


@pytest.fixture(scope="session")
def base_image(settings: Settings, base: BaseBuildResult) -> str:
    return settings.base_image


@pytest.fixture(scope="session")
def backend(settings: Settings, base_image: str) -> Iterator[DockerBackend]:
    backend = DockerBackend(settings)
    yield backend
    collect_expired(backend, everything=True)


@pytest.fixture(scope="session", params=RUNTIMES)
def runtime(request: pytest.FixtureRequest) -> Runtime:
    runtime: Runtime = request.param
    if runtime == "runsc" and not runsc_available():
        pytest.skip("gVisor (runsc) is not registered with dockerd")
    return runtime


@pytest.fixture(scope="session")
def shared_sandbox(backend: DockerBackend, base_image: str) -> Iterator[SandboxHandle]:
    """One runc sandbox shared by tests that do not test isolation itself."""
    handle = backend.create(SandboxSpec(image=base_image, rollout_id="shared"))
    yield handle
    backend.destroy(handle)


@pytest.fixture()
def make_sandbox(backend: DockerBackend, base_image: str) -> Iterator[Any]:
    """Create sandboxes for one test; all of them are destroyed afterwards."""
    created: list[SandboxHandle] = []

    def make(**overrides: Any) -> SandboxHandle:
        spec = SandboxSpec(**{"image": base_image, "rollout_id": "test", **overrides})
        handle = backend.create(spec)
        created.append(handle)
        return handle

    yield make
    for handle in created:
        backend.destroy(handle)
