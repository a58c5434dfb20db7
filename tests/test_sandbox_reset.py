"""A sandbox reset for another rollout (DockerBackend.reset, issue 13's recycling): one
rollout plants state everywhere it can, the reset's audit finds the sandbox as a fresh one
is, and the next rollout on it finds none of it. Real dockerd, real sandboxes (crun for
runtime runc where registered, and gVisor)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import Runtime, Settings
from orchestrator.images.codebases import add_codebase, codebase_image, remove_codebase
from orchestrator.sandbox.backend import (
    ExecResult,
    ResetWay,
    SandboxHandle,
    SandboxSpec,
    ScratchDir,
)
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.sandbox.docker.states import manifest_differences, spec_key

pytestmark = pytest.mark.xdist_group("reset")

# Everything the agent's user can leave behind, each in its own way.
PLANT = r"""
set -e
echo planted > /tmp/planted
mkdir -p /tmp/deep/er && echo x > /tmp/deep/er/file
echo 'echo hijacked' >> ~/.bashrc
git config --global user.name planted
echo planted > /dev/shm/planted
echo planted > /scratch/planted
echo planted >> /workspace/README.md
echo planted > /workspace/new-file
rm /workspace/src/a.py
nohup sleep 1000 > /dev/null 2>&1 &
setsid sleep 1001 > /dev/null 2>&1 < /dev/null &
(setsid sh -c 'sleep 1002 & exec sleep 1003' > /dev/null 2>&1 < /dev/null &)
bash -c 'trap "" TERM HUP INT; exec sleep 1004' > /dev/null 2>&1 < /dev/null &
flock /tmp/lock sleep 1005 > /dev/null 2>&1 < /dev/null &
python3 -c 'import os, time; os.setsid(); time.sleep(1006)' > /dev/null 2>&1 < /dev/null &
# The agent ends what is left in the command's process group when it returns: wait until
# the four detached ones (sleep 1001, 1002, 1003, the python) are in sessions of their own.
me=$(ps -o sid= -p $$ | tr -d ' ')
for i in $(seq 400); do
  detached=$(ps -eo uid=,sid=,comm= | awk -v me="$me" \
    '$1 == 1000 && $2 != me && ($3 == "sleep" || $3 == "python3")' | wc -l)
  [ "$detached" -ge 4 ] && break
  sleep 0.05
done
echo done
"""

# What the next rollout looks at: every planted thing, and who runs.
LOOK = r"""
ls -A /tmp /dev/shm /scratch ~ 2>&1
git config --global --list 2>&1 || true
cat /workspace/README.md
ls /workspace /workspace/src
"""
# Who runs, besides this command itself (its shell and ps).
WHO = "ps -eo uid=,comm="


@pytest.fixture(scope="module")
def codebase(
    settings: Settings, base_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    tree = tmp_path_factory.mktemp("reset-tree")
    (tree / "README.md").write_text("the codebase\n")
    (tree / "src").mkdir()
    (tree / "src" / "a.py").write_text("print('a')\n")
    name = f"reset-{uuid.uuid4().hex[:8]}"
    add_codebase(settings, name, tree)
    try:
        yield codebase_image(settings, name)
    finally:
        remove_codebase(settings, name)


def _spec(settings: Settings, image: str, runtime: Runtime) -> SandboxSpec:
    spec = SandboxSpec.from_settings(settings, image=image, rollout_id="r1", runtime=runtime)
    return spec.model_copy(update={"scratch_dirs": (ScratchDir(path="/scratch", size_mb=8),)})


def _run(backend: DockerBackend, handle: SandboxHandle, command: str) -> ExecResult:
    return backend.exec(handle, command, timeout_s=30, output_budget_bytes=1 << 20)


@pytest.fixture()
def sandbox(
    backend: DockerBackend, settings: Settings, codebase: str, runtime: Runtime
) -> Iterator[tuple[SandboxHandle, SandboxSpec]]:
    spec = _spec(settings, codebase, runtime)
    handle = backend.create(spec)
    try:
        yield handle, spec
    finally:
        backend.destroy(handle)


def _stdout(result: ExecResult) -> str:
    return result.stdout.head + result.stdout.tail


def test_planted_state_is_gone_after_a_reset(
    backend: DockerBackend, sandbox: tuple[SandboxHandle, SandboxSpec], runtime: Runtime
) -> None:
    handle, spec = sandbox
    fresh_view = _stdout(_run(backend, handle, LOOK))
    planted = _run(backend, handle, PLANT)
    assert planted.exit_code == 0 and "done" in _stdout(planted), planted
    dirty = backend.manifest(handle)
    key = spec_key(spec)
    seen = manifest_differences(backend._fresh[key], dirty)
    # The audit sees what was planted: processes, /tmp, home, /dev/shm, the scratch dir.
    assert any(d.startswith("processes") for d in seen), seen
    for place in ("/tmp", "/home/agent", "/dev/shm", "/scratch"):
        assert any(d.startswith(f"{place}:") for d in seen), (place, seen)

    started = backend.client.api.inspect_container(handle.native_id)["State"]["StartedAt"]
    report = backend.reset(handle, spec)
    assert report.clean, report.differences
    assert report.digest and report.ms > 0
    # In place (the container kept running) but under gVisor, whose gofer never sees the
    # host's mount of a new /workspace.
    assert report.way == (ResetWay.RESTART if runtime == "runsc" else ResetWay.IN_PLACE)
    again = backend.client.api.inspect_container(handle.native_id)["State"]["StartedAt"]
    assert (again == started) == (report.way == ResetWay.IN_PLACE)

    after = _stdout(_run(backend, handle, LOOK))
    assert "planted" not in after and "hijacked" not in after and "new-file" not in after
    assert "a.py" in after, "a file the rollout deleted is back"
    assert after == fresh_view, (fresh_view, after)
    # Nothing runs but the sandbox's init, the agent, and this command (its shell and ps).
    running = sorted(
        tuple(line.split()) for line in _stdout(_run(backend, handle, WHO)).splitlines()
    )
    assert running == [("0", "docker-init"), ("0", "python3"), ("1000", "bash"), ("1000", "ps")]


def test_a_reset_sandbox_serves_like_a_fresh_one_again_and_again(
    backend: DockerBackend, sandbox: tuple[SandboxHandle, SandboxSpec]
) -> None:
    handle, spec = sandbox
    digests = set()
    for generation in range(3):
        wrote = _run(backend, handle, f"echo {generation} > /workspace/gen; cat /workspace/gen")
        assert _stdout(wrote).strip() == str(generation)
        report = backend.reset(handle, spec)
        assert report.clean, report.differences
        digests.add(report.digest)
        assert _stdout(_run(backend, handle, "ls /workspace")).split() == ["README.md", "src"]
    assert len(digests) == 1, "every reset ends in the same state"
    probe = backend.probe(handle)
    assert probe.alive and probe.agent_ok, probe


def test_an_audit_that_finds_a_difference_says_so(
    backend: DockerBackend, sandbox: tuple[SandboxHandle, SandboxSpec]
) -> None:
    """The comparison is real: against a 'fresh' manifest that had a file in /tmp, a reset
    sandbox is not clean, and the difference is named."""
    handle, spec = sandbox
    _run(backend, handle, "echo x > /tmp/x")
    with_file = backend.manifest(handle)
    key = spec_key(spec)
    real = backend._fresh[key]
    backend._fresh[key] = with_file
    try:
        report = backend.reset(handle, spec)
    finally:
        backend._fresh[key] = real
    assert not report.clean
    assert any(d.startswith("/tmp:") and "'x'" in d.replace('"', "'") for d in report.differences)


def test_no_fresh_reference_no_reset(
    backend: DockerBackend, settings: Settings, codebase: str
) -> None:
    """A spec this process never made a sandbox of has nothing to be compared with."""
    spec = _spec(settings, codebase, "runc").model_copy(update={"scratch_dirs": ()})
    other: dict[str, Any] = {}
    handle = backend.create(spec)
    try:
        saved, backend._fresh = backend._fresh, other
        try:
            report = backend.reset(handle, spec)
        finally:
            backend._fresh = saved
        assert not report.clean and "no fresh sandbox" in report.differences[0]
    finally:
        backend.destroy(handle)


def test_reset_cleans_a_path_only_the_host_can_see(
    backend: DockerBackend, sandbox: tuple[SandboxHandle, SandboxSpec], settings: Settings
) -> None:
    """The /workspace upper layer on the host is a new, empty filesystem after a reset."""
    handle, spec = sandbox
    _run(backend, handle, "mkdir -p /workspace/a/b && echo x > /workspace/a/b/c")
    upper = Path(settings.state_dir) / "upper" / settings.deployment / handle.sandbox_id / "upper"
    assert sorted(p.name for p in upper.iterdir()) == ["a"]
    assert backend.reset(handle, spec).clean
    assert list(upper.iterdir()) == []
