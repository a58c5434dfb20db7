"""sandbox/daemon_share.py on this host's real kernel and dockerd (the suite runs as root):
the daemons that create sandboxes run at a low CPU weight, what they start inherits it,
and the sandboxes themselves never run at it.

Every worker of the suite places the daemons with the default weight, so these tests use
that weight too: they assert what every stack here relies on, and change nothing another
test sees."""

from __future__ import annotations

import subprocess
from pathlib import Path

from orchestrator.config import Settings
from orchestrator.sandbox import daemon_share
from orchestrator.sandbox.backend import SandboxHandle
from orchestrator.sandbox.docker import DockerBackend

WEIGHT = Settings.model_fields["docker_daemon_cpu_weight"].default


def _pids_of(name: str) -> list[int]:
    found = subprocess.run(["pidof", name], capture_output=True, text=True, check=False)
    return sorted(int(pid) for pid in found.stdout.split())


def _cpu_cgroup(pid: int) -> str:
    return daemon_share.cpu_cgroup(pid)[1]


def _weight_file(path: str) -> tuple[Path, str]:
    """The weight file of cgroup ``path`` and what it should hold at :data:`WEIGHT`."""
    version, _ = daemon_share.cpu_cgroup(1)
    root = daemon_share.hierarchy(version)
    assert root is not None
    group = root / path.lstrip("/")
    if version == "v1":
        return group / "cpu.shares", str(round(WEIGHT * 1024 / 100))
    return group / "cpu.weight", str(WEIGHT)


def test_the_daemons_run_at_the_weight_and_placing_them_again_changes_nothing() -> None:
    daemons = _pids_of("dockerd") + _pids_of("containerd")
    assert _pids_of("dockerd"), "the suite runs a real dockerd"
    first = daemon_share.bound_daemons(WEIGHT)
    assert first.enforced, first.detail
    assert sorted(first.pids) == sorted(daemons)
    for pid in daemons:
        path = _cpu_cgroup(pid)
        assert path in first.cgroups
        weight_file, expected = _weight_file(path)
        assert weight_file.read_text().strip() == expected
    again = daemon_share.bound_daemons(WEIGHT)
    assert again == first
    assert again.daemons_alive()


def test_a_new_sandbox_s_shim_inherits_the_weight_and_the_sandbox_does_not(
    make_sandbox: object,
) -> None:
    """The shim containerd starts for a container created after the placing is in the
    daemons' cgroup; the container's own processes (the agent, every command) are in
    the container's cgroup, at the default weight."""
    daemon_share.bound_daemons(WEIGHT)
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
    daemons_group = _cpu_cgroup(_pids_of("containerd")[0])
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
    health = backend.host_health()
    assert health.daemon_cpu is not None and health.daemon_cpu.enforced
    assert health.daemon_cpu.weight == WEIGHT
    untouched = DockerBackend(settings.model_copy(update={"docker_daemon_cpu_weight": 0}))
    assert untouched.host_health().daemon_cpu is None


def test_daemons_are_found_by_name_and_a_restarted_one_is_noticed(tmp_path: Path) -> None:
    """A fake /proc: the scan matches the command name exactly, and a placed daemon that
    is gone (restarted under another pid) makes the worker place them again."""
    for pid, name in ((10, "dockerd"), (11, "containerd"), (12, "containerd-shim"), (13, "bash")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "comm").write_text(name + "\n")
    (tmp_path / "self").mkdir()
    assert daemon_share.daemon_pids(tmp_path) == [10, 11]
    share = daemon_share.DaemonShare(weight=WEIGHT, enforced=True, pids=[10, 11])
    assert share.daemons_alive(tmp_path)
    (tmp_path / "11" / "comm").unlink()
    (tmp_path / "11").rmdir()
    assert not share.daemons_alive(tmp_path)
