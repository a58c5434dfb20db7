"""Filesystem snapshots of sandboxes, kept on the host that took them, to start new
sandboxes from (docs/snapshots.md).

A sandbox's filesystem state is all in two places, its root filesystem being read-only:
/workspace's upper layer (on the host: workspace.py) and its other writable trees (tmpfs:
/tmp, the user's home, scratch directories; under gVisor only the sandbox can read them).
A snapshot is a directory ``<state_dir>/snapshots/<deployment>/<snapshot id>`` holding

- ``layer/``: a copy of the upper layer as it was (its whiteouts and opaque directories
  too), which a sandbox made from the snapshot mounts as its top lower layer, over the
  lower layers its parent had;
- ``lowers``: those lower layers, top first: the image's /workspace, or a commit's stack;
  never another snapshot's. A snapshot of a sandbox made from a snapshot squashes the
  parent snapshot's layer and the sandbox's upper layer into one (:meth:`HostSnapshots.
  copy_layers`), so however many generations of snapshots (or pauses and resumes) follow
  one another, a sandbox's /workspace has one snapshot layer, and a snapshot needs no
  other to stay;
- ``scratch.tar``: the user's files in the other writable trees (exec agent ``pack``),
  restored in each new sandbox before its first call (``unpack``);
- ``taken.json``: what was taken (:class:`SnapshotTaken`).

It is made in a directory of its own and renamed into place: a snapshot present is whole.
Memory (processes, open files) is not kept: a sandbox made from a snapshot starts with the
filesystem only, as E2B's ``mode="filesystem"`` does.

A snapshot's directory goes when it is deleted and no sandbox, nor another snapshot, has
its layer among its lower layers; until then the host's sweep keeps it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from orchestrator.sandbox.backend import SandboxError, SnapshotRefused, SnapshotTaken
from orchestrator.sandbox.docker import mounts

SNAPSHOT_ID_RE = re.compile(r"snap-[0-9a-f]{20}")
"""A snapshot's id: also the E2B template a client creates sandboxes from it with."""
LAYER = "layer"
LOWERS = "lowers"
ARCHIVE = "scratch.tar"
TAKEN = "taken.json"
PARTIAL = ".partial-"
COPY_TIMEOUT_S = 600.0
OVERLAY_OPTIONS_MAX = 4000
"""The longest an overlay's mount options may be: the kernel reads them as one page (4096
bytes), and a sandbox's own upper and work directories take their share of it."""
_SAMPLE_UPPER = Path("/" + "u" * 120)
"""The upper and work directories' paths as long as a sandbox's get, for the room check."""


class HostSnapshots:
    """The snapshots this host keeps for one deployment."""

    def __init__(self, state_dir: Path, deployment: str) -> None:
        self.root = state_dir / "snapshots" / deployment
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def path(self, snapshot_id: str) -> Path:
        if not SNAPSHOT_ID_RE.fullmatch(snapshot_id):
            raise SandboxError(f"{snapshot_id!r} is not a snapshot id")
        return self.root / snapshot_id

    def has(self, snapshot_id: str) -> bool:
        return (self.path(snapshot_id) / TAKEN).is_file()

    def lowers(self, snapshot_id: str) -> list[Path]:
        """The lower layers of a sandbox made from the snapshot, top first."""
        top = self.path(snapshot_id)
        try:
            listed = (top / LOWERS).read_text().splitlines()
        except OSError as exc:
            raise SandboxError(f"snapshot {snapshot_id} is not on this host: {exc}") from exc
        return [top / LAYER, *(Path(line) for line in listed if line)]

    def archive(self, snapshot_id: str) -> Path:
        """The snapshot's writable trees (exec agent ``pack``)."""
        return self.path(snapshot_id) / ARCHIVE

    @contextlib.contextmanager
    def making(self, snapshot_id: str) -> Iterator[Path]:
        """A directory to make the snapshot in, gone when the block fails; the caller
        :meth:`commit`s it."""
        if self.path(snapshot_id).exists():
            raise SandboxError(f"snapshot {snapshot_id} exists already")
        partial = Path(tempfile.mkdtemp(prefix=f"{PARTIAL}{snapshot_id}-", dir=self.root))
        try:
            yield partial
        finally:
            shutil.rmtree(partial, ignore_errors=True)

    @staticmethod
    def check_room(lowers: list[Path], snapshot_id: str, root: Path) -> None:
        """:class:`SnapshotRefused` when a sandbox over ``lowers`` and one more layer (the
        snapshot's) could not be mounted: too deep a line of snapshots of snapshots."""
        stack = [root / snapshot_id / LAYER, *lowers]
        wanted = len(mounts.overlay_options(stack, _SAMPLE_UPPER, _SAMPLE_UPPER))
        if wanted > OVERLAY_OPTIONS_MAX:
            raise SnapshotRefused(
                f"a sandbox made from this snapshot would have {len(stack)} /workspace layers, "
                f"more than one overlay mount holds ({wanted} bytes of options, at most "
                f"{OVERLAY_OPTIONS_MAX}): snapshot a sandbox made fresh, or from a snapshot "
                "fewer generations back"
            )

    def owns(self, layer: Path) -> bool:
        """Whether ``layer`` is a snapshot's (of any deployment on this host)."""
        return layer.is_relative_to(self.root.parent)

    @staticmethod
    def copy_layer(layer: Path, into: Path) -> None:
        """Copy the overlay layer ``layer`` onto ``into`` (empty, or holding the layers
        below it, copied before), as overlayfs would see it on top: where ``layer`` has a
        whiteout (a character device), an opaque directory (its contents replace the
        ones below) or an entry of another kind than below, what is below goes first.
        Then ``cp -a``: owners, modes, times, whiteouts and extended attributes (the
        opaque marks) as they are; a reflink where the filesystem can."""
        for top, dirs, files in os.walk(layer):
            below = into / Path(top).relative_to(layer)
            for name in [*dirs, *files]:
                entry, there = Path(top) / name, below / name
                if not there.exists() and not there.is_symlink():
                    continue
                if _replaces(entry, there):
                    if there.is_dir() and not there.is_symlink():
                        shutil.rmtree(there)
                    else:
                        there.unlink()
        try:
            done = subprocess.run(
                ["cp", "-a", "--reflink=auto", f"{layer}/.", str(into)],
                capture_output=True,
                text=True,
                timeout=COPY_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxError(f"cannot copy a /workspace layer: {exc}") from exc
        if done.returncode != 0:
            raise SandboxError(f"cannot copy a /workspace layer: {done.stderr[-500:]}")

    @staticmethod
    def measure(layer: Path) -> tuple[int, int]:
        """A layer's files and bytes."""
        files = size = 0
        for top, _dirs, names in os.walk(layer):
            for name in names:
                with contextlib.suppress(OSError):
                    size += (Path(top) / name).lstat().st_size
                files += 1
        return files, size

    def commit(
        self, partial: Path, snapshot_id: str, lowers: list[Path], taken: SnapshotTaken
    ) -> None:
        """Put a snapshot made in ``partial`` in place."""
        (partial / LOWERS).write_text("".join(f"{lower}\n" for lower in lowers))
        (partial / TAKEN).write_text(taken.model_dump_json())
        partial.chmod(0o700)
        partial.rename(self.path(snapshot_id))

    def remove(self, snapshot_id: str, in_use: set[Path]) -> bool:
        """Remove the snapshot unless a sandbox or a snapshot is made over its layer;
        False when it stays (the sweep removes it once it is free)."""
        top = self.path(snapshot_id)
        if top / LAYER in in_use:
            return False
        shutil.rmtree(top, ignore_errors=True)
        return True

    def held(self) -> set[Path]:
        """The lower layers snapshots are made over (a commit's layer, an image's, another
        snapshot's): none of them may go while the snapshot stays."""
        used: set[Path] = set()
        for listed in self.root.parent.glob(f"*/*/{LOWERS}"):
            with contextlib.suppress(OSError):
                used.update(Path(line) for line in listed.read_text().splitlines() if line)
        return used

    def ids(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if SNAPSHOT_ID_RE.fullmatch(p.name))

    def sweep(self, keep: set[str], in_use: set[Path], settled: float) -> int:
        """Remove snapshots not in ``keep`` (deleted, or made for a fork that has made its
        sandboxes) whose layer is not ``in_use``, and halves of snapshots a crash left;
        nothing younger than ``settled`` (a Unix time). Returns how many went."""
        removed = 0
        for entry in list(self.root.iterdir()):
            try:
                if entry.stat().st_mtime >= settled:
                    continue
            except FileNotFoundError:
                continue
            if entry.name.startswith(PARTIAL):
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
            elif SNAPSHOT_ID_RE.fullmatch(entry.name) and entry.name not in keep:
                removed += self.remove(entry.name, in_use)
        return removed


OPAQUE = "trusted.overlay.opaque"


def _replaces(entry: Path, below: Path) -> bool:
    """Whether the upper ``entry`` hides ``below`` whole (rather than merging into it)."""
    info = entry.lstat()
    if stat.S_ISCHR(info.st_mode) and info.st_rdev == 0:
        return True  # a whiteout
    if stat.S_ISDIR(info.st_mode):
        try:
            if os.getxattr(entry, OPAQUE, follow_symlinks=False) == b"y":
                return True
        except OSError:
            pass
        return not (below.is_dir() and not below.is_symlink())
    return True  # a file or a link replaces whatever was there


def elapsed_ms(since: float) -> float:
    return round((time.perf_counter() - since) * 1000, 1)
