"""sandbox/docker/mounts.py on this host's real kernel (the suite runs as root): what the host's
mounts of a sandbox's /workspace rest on. That they reach a running container is
tests/test_sandbox_reset.py's (a reset in place) and tests/test_sandbox_backend.py's."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.sandbox.docker import mounts


@pytest.fixture()
def point(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "with space\tand tab"
    path.mkdir()
    yield path
    mounts.unmount_all(path)


def test_a_directory_bound_onto_itself_is_counted(point: Path) -> None:
    """os.path.ismount cannot see it (same device as its parent); the count can, escapes
    and all."""
    assert mounts.mounted_at(point) == 0
    mounts.bind_shared(point)
    assert not point.is_mount() and mounts.mounted_at(point) == 1
    assert not mounts.covered(point)  # its own filesystem still shows
    shared = [
        line for line in Path("/proc/self/mountinfo").read_text().splitlines() if "shared:" in line
    ]
    assert any("with\\040space\\011and\\040tab" in line for line in shared)
    mounts.mount("tmpfs", point, "tmpfs", 0, "size=1m")
    assert mounts.mounted_at(point) == 2 and mounts.covered(point)
    mounts.unmount_all(point)  # both, without reading the table
    assert mounts.mounted_at(point) == 0 and not mounts.covered(point)


def test_a_busy_mount_is_refused_or_detached(point: Path) -> None:
    mounts.mount("tmpfs", point, "tmpfs", 0, "size=1m")
    held = (point / "held").open("w")
    try:
        with pytest.raises(mounts.MountError) as refused:
            mounts.unmount(point, detach_if_busy=False)
        assert refused.value.errno == errno.EBUSY
        assert mounts.mounted_at(point) == 1
        mounts.unmount(point)  # detached: gone from the table, alive for its user
        assert mounts.mounted_at(point) == 0
        held.write("still writable")
    finally:
        held.close()


def test_nothing_mounted_is_no_error(point: Path) -> None:
    mounts.unmount(point)
    mounts.unmount_all(point)
    with pytest.raises(mounts.MountError) as failed:
        mounts.mount("overlay", point / "missing", "overlay", 0, "lowerdir=/nonexistent")
    assert failed.value.errno == errno.ENOENT
