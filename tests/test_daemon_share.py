"""sandbox/daemon_share.py on this host's real kernel and dockerd (the suite runs as root):
the daemons that create sandboxes run at a low CPU weight, what they start inherits it,
and the sandboxes themselves never run at it.

The deployment's default leaves the daemons alone (ORCH_DOCKER_DAEMON_CPU_WEIGHT=0), so
each test here puts them back where they were and as they were weighted
(:func:`restored`); one xdist group, so no two of them overlap."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.config import Settings
from orchestrator.sandbox import cgroups, daemon_share
from orchestrator.sandbox.backend import SandboxHandle
from orchestrator.sandbox.docker.backend import DockerBackend

pytestmark = pytest.mark.xdist_group("daemon-share")

WEIGHT = 10
DOCKER_SOCKET = Path("/var/run/docker.sock")


@pytest.fixture(autouse=True)
def restored() -> Iterator[None]:
    """The daemons' cgroups and those cgroups' weights, as they were before the test."""
    version, _ = cgroups.cpu_cgroup(1)
    root = cgroups.hierarchy(version)
    assert root is not None
    weight_file = "cpu.shares" if version == "v1" else "cpu.weight"
    before = {pid: cgroups.cpu_cgroup(pid)[1] for pid in daemon_share.daemon_pids(DOCKER_SOCKET)}
    weights = {
        path: (root / path.lstrip("/") / weight_file).read_text()
        for path in {*before.values(), f"/{daemon_share.GROUP}"} - {"/"}  # root's is fixed
        if (root / path.lstrip("/") / weight_file).exists()
    }
    yield
    for pid, path in before.items():
        (root / path.lstrip("/") / "cgroup.procs").write_text(str(pid))
    for path, value in weights.items():
        (root / path.lstrip("/") / weight_file).write_text(value)


def _cpu_cgroup(pid: int) -> str:
    return cgroups.cpu_cgroup(pid)[1]


def _weight_file(path: str) -> tuple[Path, str]:
    """The weight file of cgroup ``path`` and what it should hold at :data:`WEIGHT`."""
    version, _ = cgroups.cpu_cgroup(1)
    root = cgroups.hierarchy(version)
    assert root is not None
    group = root / path.lstrip("/")
    if version == "v1":
        return group / "cpu.shares", str(round(WEIGHT * 1024 / 100))
    return group / "cpu.weight", str(WEIGHT)


def test_the_daemons_run_at_the_weight_and_placing_them_again_changes_nothing() -> None:
    """The daemons are the socket's dockerd (its own pidfile says which) and the containerd
    it runs (containerd's pidfile), or the system's containerd (its socket's peer)."""
    dockerd = int(Path("/var/run/docker.pid").read_text())
    managed = Path("/var/run/docker/containerd/containerd.pid")
    containerd = (
        int(managed.read_text())
        if managed.exists()
        else daemon_share.peer_pid(daemon_share.SYSTEM_CONTAINERD)
    )
    assert daemon_share.daemon_pids(DOCKER_SOCKET) == [dockerd, containerd]
    first = daemon_share.bound_daemons(WEIGHT, DOCKER_SOCKET)
    assert first.enforced, first.detail
    assert first.pids == [dockerd, containerd]
    for pid in first.pids:
        path = _cpu_cgroup(pid)
        assert path in first.cgroups
        weight_file, expected = _weight_file(path)
        assert weight_file.read_text().strip() == expected
    again = daemon_share.bound_daemons(WEIGHT, DOCKER_SOCKET)
    assert again == first
    assert again.daemons_alive()


def test_a_process_merely_named_dockerd_is_left_alone(tmp_path: Path) -> None:
    """Another dockerd on the machine (a test's, another deployment's) is not this
    worker's: only the one behind its socket is placed."""
    impostor = tmp_path / "dockerd"
    impostor.write_bytes(Path("/bin/sleep").read_bytes())
    impostor.chmod(0o755)
    process = subprocess.Popen([str(impostor), "30"])
    try:
        before = _cpu_cgroup(process.pid)
        share = daemon_share.bound_daemons(WEIGHT, DOCKER_SOCKET)
        assert process.pid not in share.pids
        assert _cpu_cgroup(process.pid) == before
    finally:
        process.kill()
        process.wait()


def test_a_new_sandbox_s_shim_inherits_the_weight_and_the_sandbox_does_not(
    make_sandbox: object,
) -> None:
    """The shim containerd starts for a container created after the placing is in the
    daemons' cgroup; the container's own processes (the agent, every command) are in
    the container's cgroup, at the default weight."""
    daemon_share.bound_daemons(WEIGHT, DOCKER_SOCKET)
    handle: SandboxHandle = make_sandbox()  # type: ignore[operator]
    inspected = subprocess.run(
        ["docker", "inspect", "-f", "{{.Id}} {{.State.Pid}}", handle.native_id],
        capture_output=True,
        text=True,
        check=True,
    )
    container_id, init_pid = inspected.stdout.split()
    shims = [pid for pid in _shims() if f"-id {container_id} " in _cmdline(pid)]
    assert shims, "no shim names the new container"
    daemons_group = _cpu_cgroup(daemon_share.daemon_pids(DOCKER_SOCKET)[-1])
    assert all(_cpu_cgroup(pid) == daemons_group for pid in shims)
    sandbox_group = _cpu_cgroup(int(init_pid))
    assert sandbox_group != daemons_group
    assert container_id in sandbox_group


def _shims() -> list[int]:
    """containerd's shims (their command name is cut to 15 bytes: ``containerd-shim``)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().startswith("containerd-shim"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() + " "


def test_the_heartbeat_says_so_and_a_weight_of_0_leaves_the_daemons_alone(
    settings: Settings, backend: DockerBackend
) -> None:
    weighted = DockerBackend(settings.model_copy(update={"docker_daemon_cpu_weight": WEIGHT}))
    health = weighted.host_health()
    assert health.daemon_cpu is not None and health.daemon_cpu.enforced, health.daemon_cpu
    assert health.daemon_cpu.weight == WEIGHT
    assert Settings.model_fields["docker_daemon_cpu_weight"].default == 0
    untouched = DockerBackend(settings.model_copy(update={"docker_daemon_cpu_weight": 0}))
    assert untouched.host_health().daemon_cpu is None


def test_a_restarted_daemon_is_noticed(tmp_path: Path) -> None:
    """A fake /proc: a placed daemon that is gone (restarted under another pid) makes the
    worker place them again; children are read from every thread."""
    for pid in (10, 11):
        (tmp_path / str(pid) / "task" / str(pid)).mkdir(parents=True)
    (tmp_path / "10" / "task" / "10" / "children").write_text("11 ")
    (tmp_path / "10" / "task" / "12").mkdir()
    (tmp_path / "10" / "task" / "12" / "children").write_text("13 14\n")
    (tmp_path / "11" / "task" / "11" / "children").write_text("")
    assert sorted(daemon_share.children(10, tmp_path)) == [11, 13, 14]
    share = daemon_share.DaemonShare(weight=WEIGHT, enforced=True, pids=[10, 11])
    assert share.daemons_alive(tmp_path)
    (tmp_path / "11" / "task" / "11" / "children").unlink()
    (tmp_path / "11" / "task" / "11").rmdir()
    (tmp_path / "11" / "task").rmdir()
    (tmp_path / "11").rmdir()
    assert not share.daemons_alive(tmp_path)
