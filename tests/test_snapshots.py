"""Filesystem snapshots on the Docker backend (sandbox/docker/snapshots.py): a sandbox made from a
snapshot starts with its parent's /workspace and writable trees as they were, and from
then on nothing one of them does reaches another. Real dockerd, real sandboxes (crun for
runtime runc where registered, and gVisor)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.config import Runtime, Settings
from orchestrator.images.codebases import add_codebase, codebase_image, remove_codebase
from orchestrator.sandbox.backend import (
    SandboxHandle,
    SandboxSpec,
    ScratchDir,
    SnapshotRefused,
)
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.sandbox.docker.snapshots import HostSnapshots
from orchestrator.state.snapshots import new_snapshot_id
from tests.conftest import runsc_available

pytestmark = pytest.mark.xdist_group("snapshots")

# A set-up step: every kind of change a sandbox's filesystem can take.
SET_UP = r"""
set -e
echo changed >> /workspace/README.md
echo new > /workspace/new-file
rm /workspace/src/a.py
rm -r /workspace/lib && mkdir /workspace/lib && echo fresh > /workspace/lib/only
mkdir -p /workspace/venv/bin && printf '#!/bin/sh\necho tool ran\n' > /workspace/venv/bin/tool
chmod 0755 /workspace/venv/bin/tool
echo planted > /tmp/planted && ln -s /workspace/README.md /tmp/link
mkdir -p ~/.local/bin && echo home > ~/.local/bin/marker && chmod 0600 ~/.local/bin/marker
echo scratch > /scratch/file
mkdir /tmp/locked && echo inside > /tmp/locked/f && chmod 0500 /tmp/locked
setsid sleep 1000 > /dev/null 2>&1 < /dev/null &
# (until it is sleep, it may still be in this command's process group, which ends with it)
for i in $(seq 200); do pgrep -x sleep > /dev/null && break; sleep 0.05; done
echo done
"""
LOOK = r"""
cat /workspace/README.md; ls /workspace /workspace/src /workspace/lib
/workspace/venv/bin/tool; cat /tmp/planted; readlink /tmp/link; cat ~/.local/bin/marker
stat -c '%a %U' ~/.local/bin/marker /tmp/locked; cat /tmp/locked/f /scratch/file
pgrep -x sleep || echo no sleep
"""


@pytest.fixture(scope="module")
def codebase(
    settings: Settings, base_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    tree = tmp_path_factory.mktemp("snapshot-tree")
    (tree / "README.md").write_text("the codebase\n")
    (tree / "src").mkdir()
    (tree / "src" / "a.py").write_text("print('a')\n")
    (tree / "src" / "b.py").write_text("print('b')\n")
    (tree / "lib").mkdir()
    (tree / "lib" / "old").write_text("old\n")
    name = f"snap-{uuid.uuid4().hex[:8]}"
    add_codebase(settings, name, tree)
    try:
        yield codebase_image(settings, name)
    finally:
        remove_codebase(settings, name)


def _spec(
    settings: Settings, image: str, runtime: Runtime, snapshot: str | None = None
) -> SandboxSpec:
    spec = SandboxSpec.from_settings(settings, image=image, rollout_id="snap", runtime=runtime)
    return spec.model_copy(
        update={"scratch_dirs": (ScratchDir(path="/scratch", size_mb=8),), "snapshot": snapshot}
    )


def _run(backend: DockerBackend, handle: SandboxHandle, command: str) -> str:
    result = backend.exec(handle, command, timeout_s=30, output_budget_bytes=1 << 20)
    assert result.exit_code == 0, (command, result.stderr.head, result.stdout.head)
    return result.stdout.head + result.stdout.tail


@pytest.fixture()
def sandboxes(backend: DockerBackend) -> Iterator[list[SandboxHandle]]:
    made: list[SandboxHandle] = []
    yield made
    for handle in made:
        backend.destroy(handle)


def test_sandboxes_from_a_snapshot_start_where_their_parent_was(
    backend: DockerBackend,
    settings: Settings,
    codebase: str,
    runtime: Runtime,
    sandboxes: list[SandboxHandle],
) -> None:
    parent = backend.create(_spec(settings, codebase, runtime))
    sandboxes.append(parent)
    assert "done" in _run(backend, parent, SET_UP)
    seen = _run(backend, parent, LOOK)
    snapshot_id = new_snapshot_id()
    taken = backend.snapshot(parent, snapshot_id)
    assert taken.snapshot_id == snapshot_id and taken.host == settings.host_id
    assert taken.files >= 4 and taken.bytes > 0 and taken.skipped == []
    assert 0 < taken.paused_ms <= taken.ms
    # The parent runs on, its processes too, and is not frozen.
    assert "sleep" in _run(backend, parent, "pgrep -a sleep")

    children = [backend.create(_spec(settings, codebase, runtime, snapshot_id)) for _ in range(2)]
    sandboxes.extend(children)
    for child in children:
        look = _run(backend, child, LOOK)
        # The filesystem as the parent had it; no process of the parent's.
        assert "the codebase\nchanged\n" in look
        assert "a.py" not in look and "b.py" in look and "only" in look and "old" not in look
        assert "tool ran" in look and "planted" in look and "/workspace/README.md" in look
        assert "home" in look and "600 agent" in look and "500 agent" in look
        assert "inside" in look and "scratch" in look
        assert "no sleep" in look
        assert _without_processes(look) == _without_processes(seen)

    # From now on, each is its own: what one writes, no other sees.
    first, second = children
    _run(backend, first, "echo mine > /workspace/new-file; echo mine > /tmp/planted")
    _run(backend, parent, "echo parent > /workspace/later")
    for other in (second, parent):
        assert "mine" not in _run(backend, other, "cat /workspace/new-file /tmp/planted")
    assert "later" not in _run(backend, second, "ls /workspace")
    assert "later" not in _run(backend, first, "ls /workspace")


def _without_processes(look: str) -> str:
    return "\n".join(
        line for line in look.splitlines() if "sleep" not in line and not line.isdigit()
    )


def test_a_snapshot_of_a_sandbox_made_from_one_and_its_removal(
    backend: DockerBackend,
    settings: Settings,
    codebase: str,
    sandboxes: list[SandboxHandle],
) -> None:
    parent = backend.create(_spec(settings, codebase, "runc"))
    sandboxes.append(parent)
    _run(backend, parent, "echo one > /workspace/gen && echo one > /tmp/gen")
    first = new_snapshot_id()
    backend.snapshot(parent, first)
    child = backend.create(_spec(settings, codebase, "runc", first))
    sandboxes.append(child)
    _run(backend, child, "echo two >> /workspace/gen && rm /workspace/README.md")
    second = new_snapshot_id()
    backend.snapshot(child, second)
    grandchild = backend.create(_spec(settings, codebase, "runc", second))
    sandboxes.append(grandchild)
    assert _run(backend, grandchild, "cat /workspace/gen /tmp/gen") == "one\ntwo\none\n"
    assert "README" not in _run(backend, grandchild, "ls /workspace")

    # One snapshot layer however many generations: the second holds the first's changes.
    layers = backend.workspaces.lowers_of(grandchild.sandbox_id)
    assert [backend.snapshots.owns(layer) for layer in layers] == [True, False]
    # Sandboxes are made over both: neither goes, until nothing is made over it.
    assert backend.drop_snapshot(first) is False
    assert backend.drop_snapshot(second) is False
    for handle in (grandchild, child):
        backend.destroy(handle)
        sandboxes.remove(handle)
    assert backend.drop_snapshot(second) is True
    assert backend.drop_snapshot(first) is True
    assert not backend.snapshots.path(first).exists()


def test_a_snapshot_is_swept_once_forgotten_and_free(
    backend: DockerBackend, settings: Settings, codebase: str, sandboxes: list[SandboxHandle]
) -> None:
    parent = backend.create(_spec(settings, codebase, "runc"))
    sandboxes.append(parent)
    kept, forgotten = new_snapshot_id(), new_snapshot_id()
    for snapshot_id in (kept, forgotten):
        backend.snapshot(parent, snapshot_id)
    # Young: a snapshot whose record is still being written is never swept.
    backend.sweep_snapshots(keep={kept})
    assert backend.snapshots.has(forgotten)
    backend.snapshots.sweep({kept}, backend.workspaces.in_use(), settled=float("inf"))
    assert backend.snapshots.has(kept) and not backend.snapshots.has(forgotten)
    backend.drop_snapshot(kept)


def test_too_many_generations_are_refused(tmp_path: Path) -> None:
    snapshots = HostSnapshots(tmp_path, "deep")
    lowers = [tmp_path / f"{'x' * 90}-{i}" for i in range(40)]
    with pytest.raises(SnapshotRefused, match="more than one overlay mount holds"):
        snapshots.check_room(lowers, new_snapshot_id(), snapshots.root)
    snapshots.check_room(lowers[:5], new_snapshot_id(), snapshots.root)


# Each generation changes what the one before made: a file over a directory, a directory
# over a file, a deletion of a file the base has and of one a generation made, a directory
# replaced whole (opaque), a file made again after its deletion; then two more.
GENERATIONS = [
    "mkdir -p d/e && echo 1 > d/e/f && echo 1 > x && rm src/a.py && echo 1 > gen",
    "rm -r d && echo file > d && rm x && mkdir x && echo 2 > x/y && echo 2 >> gen",
    "rm d && mkdir -p d/new && rm -r lib && mkdir lib && echo 3 > lib/n && echo 3 >> gen",
    "echo again > src/a.py && rm -r x && echo 4 >> gen",
    *(f"echo {n} >> gen" for n in range(5, 7)),
]
LOOK_TREE = (
    "ls -A d; echo --; ls -A d/new; echo --; test -e x && echo x || echo no-x; "
    "cat src/a.py; ls src; ls -A lib; cat README.md gen"
)
EXPECTED_TREE = "new\n--\n--\nno-x\nagain\na.py\nb.py\nn\nthe codebase\n" + "".join(
    f"{n}\n" for n in range(1, 7)
)


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_generations_of_snapshots_squash_into_one_layer(
    backend: DockerBackend,
    settings: Settings,
    codebase: str,
    runtime: Runtime,
    sandboxes: list[SandboxHandle],
) -> None:
    if runtime == "runsc" and not runsc_available():
        pytest.skip("gVisor (runsc) is not registered with dockerd")
    snapshot_id: str | None = None
    taken: list[str] = []
    try:
        for step in GENERATIONS:
            handle = backend.create(_spec(settings, codebase, runtime, snapshot_id))
            try:
                _run(backend, handle, step)
                snapshot_id = new_snapshot_id()
                backend.snapshot(handle, snapshot_id)
                taken.append(snapshot_id)
            finally:
                backend.destroy(handle)
        final = backend.create(_spec(settings, codebase, runtime, snapshot_id))
        sandboxes.append(final)
        assert _run(backend, final, LOOK_TREE) == EXPECTED_TREE
        layers = backend.workspaces.lowers_of(final.sandbox_id)
        assert sum(backend.snapshots.owns(layer) for layer in layers) == 1, layers
    finally:
        for old in taken[:-1]:  # nothing is made over these
            assert backend.drop_snapshot(old) is True
