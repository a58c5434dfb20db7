"""Writable /workspace for a read-only sandbox, in constant time: an overlay mount whose
lower layer is the image's /workspace, extracted once per image per host, and whose upper
layer is the sandbox's own (removed with it).

Two ways to mount it, by runtime:

- runc and crun (the host-mounted way, :meth:`Workspaces.mount_point`): the container binds
  a directory of the host at /workspace with ``rslave`` propagation, and the host mounts the
  overlay on that directory once the container runs; the mount propagates into the
  container. A reset for another rollout then needs no restart of the container: the host
  unmounts the overlay, empties the upper layer and mounts it again
  (:meth:`Workspaces.renew`), and the container sees the image's /workspace again.
- gVisor: its gofer opens the container's mounts when the sandbox starts and never sees a
  later one, so Docker mounts the overlay itself, as a ``local`` volume with overlay
  options, when the container starts, and a reset restarts the container.

The lower layer is the image's /workspace, or a stack of layers of a repository at a
commit (sandbox/repos.py); either way a sandbox's lower layers are written in its own
directory (``lowers``) when it is made and kept for its life: a reset mounts the same ones.

Either way, compared with a plain volume (which Docker seeds by copying the image's
/workspace on first mount), creating a sandbox costs no copy of the codebase in time and
disk.

The upper layer is capped: it lives on the sandbox's own ext4 filesystem, a sparse image
file of the cap's size loop-mounted (autoclear) at the upper root, so a write past the cap
fails with ENOSPC inside the sandbox instead of filling the host's disk. These kernels have
no quota support (project quotas on XFS or ext4 fail), so a filesystem of its own is the cap.
Making one adds about 15 ms to a create (mkfs of a sparse file, then a loop mount); the image takes
only what the sandbox wrote (about 1 MB of metadata when empty).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tarfile
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
from docker.errors import DockerException, NotFound
from requests.exceptions import RequestException

from orchestrator.observability.logging import get_logger
from orchestrator.sandbox import labels
from orchestrator.sandbox.backend import SandboxError
from orchestrator.sandbox.docker import mounts

log = get_logger(__name__)

WORKSPACE = "/workspace"
IMAGE_SUFFIX = ".img"
# No journal (nothing survives the sandbox, so nothing to recover), nothing reserved for
# root (the cap is all the sandbox's), no discard pass (the file is sparse already).
MKFS = ["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", "-E", "nodiscard"]
# noinit_itable: no background zeroing of inode tables; holes of the sparse file read as
# zeros already, and zeroing would write tens of MB per sandbox to the host's disk.
MOUNT_OPTIONS = "loop,nosuid,nodev,noatime,noinit_itable"
TOOL_TIMEOUT_S = 30.0
# The host-mounted way (Workspaces.mount_point): the directory the container binds.
MERGED = "merged"
# A sandbox's lower layers, one path a line, top first: what a reset mounts again.
LOWERS = "lowers"


class Workspaces:
    """Lower layers under ``<state_dir>/layers/<image id>``, upper layers under
    ``<state_dir>/upper/<deployment>/<sandbox id>``."""

    def __init__(self, client: docker.DockerClient, state_dir: Path, deployment: str) -> None:
        self.client = client
        self.deployment = deployment
        self.layers = state_dir / "layers"
        self.uppers = state_dir / "upper" / deployment
        # Snapshots list their lower layers the way sandboxes do (sandbox/docker/snapshots.py).
        self.snapshots = state_dir / "snapshots"
        self.layers.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.uppers.mkdir(parents=True, exist_ok=True, mode=0o700)

    def volume_options(
        self, lowers: list[Path], sandbox_id: str, disk_mb: int = 0
    ) -> dict[str, str]:
        """Driver options of the sandbox's /workspace volume over ``lowers`` (top first;
        makes its upper layer, on a filesystem of ``disk_mb`` MB of its own unless that is
        0): Docker mounts it."""
        upper, work = self._make_layers(lowers, sandbox_id, disk_mb)
        return {
            "type": "overlay",
            "device": "overlay",
            "o": mounts.overlay_options(lowers, upper, work),
        }

    def mount_point(self, lowers: list[Path], sandbox_id: str, disk_mb: int = 0) -> Path:
        """The host-mounted way: make the sandbox's layers and the directory its container
        binds at /workspace (``rslave``), bound onto itself as a shared mount, so that the
        overlay :meth:`mount` puts on it once the container runs (and puts anew at each
        :meth:`renew`) propagates into the container. Docker is not asked to mount
        anything, and a reset needs no restart of the container."""
        self._make_layers(lowers, sandbox_id, disk_mb)
        top = self.uppers / sandbox_id
        point = top / MERGED
        point.mkdir()
        try:
            mounts.bind_shared(point)
        except mounts.MountError as exc:
            raise SandboxError(f"cannot make the /workspace mount point: {exc}") from exc
        return point

    def mount(self, sandbox_id: str) -> None:
        """Mount the sandbox's overlay on its mount point (:meth:`mount_point`)."""
        top = self.uppers / sandbox_id
        try:
            lowers = self.lowers_of(sandbox_id)
            mounts.mount_overlay(top / MERGED, lowers, top / "upper", top / "work")
        except OSError as exc:
            raise SandboxError(f"cannot mount /workspace of {sandbox_id}: {exc}") from exc

    def renew(self, sandbox_id: str) -> None:
        """Unmount the sandbox's overlay (from its running container too), empty its upper
        layer and mount it again: its /workspace is the image's again. Nothing of the
        sandbox's may hold a file there (its processes are gone): a busy mount raises."""
        top = self.uppers / sandbox_id
        point = top / MERGED
        if not mounts.covered(point):  # the overlay, on the bind of the point
            raise SandboxError(f"/workspace of {sandbox_id} is not mounted")
        try:
            mounts.unmount(point, detach_if_busy=False)
        except mounts.MountError as exc:
            raise SandboxError(f"cannot unmount /workspace of {sandbox_id}: {exc}") from exc
        for layer in ("upper", "work"):
            shutil.rmtree(top / layer)
        self._layers_in(self.lowers_of(sandbox_id), top)
        self.mount(sandbox_id)

    def host_mounted(self, sandbox_id: str) -> bool:
        """Whether the sandbox's /workspace was made by :meth:`mount_point`."""
        return (self.uppers / sandbox_id / MERGED).is_dir()

    def lowers_of(self, sandbox_id: str) -> list[Path]:
        """The sandbox's lower layers, top first, as written when it was made."""
        try:
            listed = (self.uppers / sandbox_id / LOWERS).read_text().splitlines()
        except OSError as exc:
            raise SandboxError(f"the /workspace layers of {sandbox_id} are unknown: {exc}") from exc
        return [Path(line) for line in listed if line]

    def _make_layers(self, lowers: list[Path], sandbox_id: str, disk_mb: int) -> tuple[Path, Path]:
        top = self.uppers / sandbox_id
        top.mkdir(mode=0o700)
        if disk_mb:
            self._mount_disk(sandbox_id, top, disk_mb)
        (top / LOWERS).write_text("".join(f"{lower}\n" for lower in lowers))
        return self._layers_in(lowers, top)

    @staticmethod
    def _layers_in(lowers: list[Path], top: Path) -> tuple[Path, Path]:
        upper, work = top / "upper", top / "work"
        upper.mkdir()
        work.mkdir()
        # The merged root takes its owner and mode from the upper layer's root.
        info = lowers[0].stat()
        os.chown(upper, info.st_uid, info.st_gid)
        upper.chmod(info.st_mode & 0o7777)
        return upper, work

    def remake(self, sandbox_id: str, disk_mb: int = 0) -> None:
        """Discard the sandbox's upper layer and make a new, empty one at the same paths
        over the same lower layers (the volume's options name them): a reset sandbox's
        /workspace is as it was made again. Docker must have unmounted the overlay first
        (the container stopped)."""
        lowers = self.lowers_of(sandbox_id)
        self.remove(sandbox_id)
        if (self.uppers / sandbox_id).exists():
            raise SandboxError(f"the /workspace upper layer of {sandbox_id} is still in use")
        self.volume_options(lowers, sandbox_id, disk_mb)

    @contextlib.contextmanager
    def pristine(self, sandbox_id: str) -> Iterator[Path]:
        """The sandbox's /workspace as it was made, which no sandbox can change: its one
        lower layer, or its stack of them mounted read-only for the length of the block."""
        lowers = self.lowers_of(sandbox_id)
        if len(lowers) == 1:
            yield lowers[0]
            return
        view = Path(tempfile.mkdtemp(prefix=".view-", dir=self.uppers))
        try:
            try:
                mounts.mount_overlay(view, lowers, None, None)
            except OSError as exc:
                raise SandboxError(f"cannot show the pristine /workspace: {exc}") from exc
            try:
                yield view
            finally:
                mounts.unmount(view)
        finally:
            view.rmdir()

    def in_use(self) -> set[Path]:
        """Lower layers some sandbox, or some snapshot, of any deployment on this host was
        made over."""
        used: set[Path] = set()
        listings = [
            *self.uppers.parent.glob(f"*/*/{LOWERS}"),
            *self.snapshots.glob(f"*/*/{LOWERS}"),
        ]
        for listed in listings:
            with contextlib.suppress(OSError):
                used.update(Path(line) for line in listed.read_text().splitlines() if line)
        return used

    def upper(self, sandbox_id: str) -> Path:
        """The sandbox's upper layer: what it wrote to /workspace."""
        return self.uppers / sandbox_id / "upper"

    def upper_entries(self, sandbox_id: str) -> list[str]:
        """What the sandbox has written to /workspace (its upper layer's top entries)."""
        return sorted(entry.name for entry in self.upper(sandbox_id).iterdir())

    def image_path(self, sandbox_id: str) -> Path:
        """The sandbox's filesystem image (present only when its /workspace is capped)."""
        return self.uppers / f"{sandbox_id}{IMAGE_SUFFIX}"

    def _mount_disk(self, sandbox_id: str, top: Path, disk_mb: int) -> None:
        image = self.image_path(sandbox_id)
        # O_EXCL: a sandbox id is never reused, so an existing image is someone else's.
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, disk_mb << 20)
        finally:
            os.close(fd)
        _run([*MKFS, str(image)], f"make the {disk_mb} MB /workspace filesystem")
        _run(
            ["mount", "-t", "ext4", "-o", MOUNT_OPTIONS, str(image), str(top)],
            "loop-mount the /workspace filesystem",
        )
        top.chmod(0o700)

    def remove(self, sandbox_id: str) -> None:
        """Remove the sandbox's upper layer: unmount its overlay and mount point (when the
        host mounted them) and its filesystem, delete its image. Docker must have
        unmounted its own overlay first (the container and volume are gone)."""
        top = self.uppers / sandbox_id
        merged = top / MERGED
        # A failed unmount is logged, never raised (as the `umount` children before it
        # were): a destroy must go on, and a later sweep tries again.
        stuck = False
        try:
            mounts.unmount_all(merged)
            if top.is_mount():
                mounts.unmount(top)
        except mounts.MountError as exc:
            stuck = True
            log.warning("sandbox.workspace_umount_failed", sandbox_id=sandbox_id, error=str(exc))
        if stuck or top.is_mount():
            # Still mounted: rmtree would empty a filesystem something still uses.
            log.warning("sandbox.workspace_busy", sandbox_id=sandbox_id, path=str(top))
        else:
            shutil.rmtree(top, ignore_errors=True)
        self.image_path(sandbox_id).unlink(missing_ok=True)

    def sweep_uppers(self, live: set[str], settled: float) -> int:
        """Remove upper layers (mounts, images, directories) of sandboxes not in ``live``
        and older than ``settled`` (a Unix time: younger ones may belong to a sandbox being
        created right now). A crashed worker leaves these behind. Returns how many went."""
        removed = 0
        for entry in list(self.uppers.iterdir()):
            sandbox_id = entry.name.removesuffix(IMAGE_SUFFIX)
            if not sandbox_id.startswith("sbx-") or sandbox_id in live:
                continue
            try:
                if entry.stat().st_mtime >= settled:
                    continue
            except FileNotFoundError:
                continue  # removed with its pair (directory and image) just now
            self.remove(sandbox_id)
            removed += 1
        return removed

    def sweep_layers(self) -> int:
        """Remove lower layers of images the daemon no longer has. An image cannot go while
        a container uses it (Docker keeps it, untagged, until the last one is removed), so
        no mounted layer is touched; a snapshot made over one keeps it. Returns how many
        were removed."""
        try:
            present = {
                str(i["Id"]).removeprefix("sha256:")[:32] for i in self.client.api.images(all=True)
            }
        except (DockerException, RequestException):
            return 0
        removed = 0
        held: set[Path] | None = None
        for entry in self.layers.iterdir():
            if entry.is_dir() and not entry.name.startswith(".") and entry.name not in present:
                if held is None:
                    held = self.in_use()
                if entry / WORKSPACE.strip("/") in held:
                    continue
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
        return removed

    def lower(self, image: str) -> Path:
        """The image's /workspace on the host, extracted on first use (races are safe:
        every extractor works in its own directory and the first rename wins)."""
        try:
            image_id = str(self.client.images.get(image).id).removeprefix("sha256:")
        except NotFound as exc:
            raise SandboxError(f"sandbox image {image!r} not found") from exc
        except (DockerException, RequestException) as exc:
            raise SandboxError(f"cannot inspect image {image!r}: {exc}") from exc
        final = self.layers / image_id[:32]
        if not (final / "workspace").is_dir():
            self._extract(image, final)
        return final / "workspace"

    def _extract(self, image: str, final: Path) -> None:
        scratch = Path(tempfile.mkdtemp(prefix=".extract-", dir=self.layers))
        stamp = {
            labels.MANAGED: "true",
            labels.DEPLOYMENT: self.deployment,
            labels.SANDBOX: "extract-" + uuid.uuid4().hex[:8],
        }
        try:
            container = self.client.api.create_container(
                image, command=["true"], labels=stamp, network_disabled=True
            )
            try:
                stream, _ = self.client.api.get_archive(container["Id"], WORKSPACE)
                with tempfile.TemporaryFile(dir=self.layers) as archive:
                    for chunk in stream:
                        archive.write(chunk)
                    archive.seek(0)
                    with tarfile.open(fileobj=archive) as tar:
                        # "tar" keeps owners and modes (the tree belongs to the sandbox
                        # user) but refuses members that would land outside the directory.
                        tar.extractall(scratch, numeric_owner=True, filter="tar")
            finally:
                self.client.api.remove_container(container["Id"], force=True)
            try:
                scratch.rename(final)
            except OSError:
                if not (final / "workspace").is_dir():
                    raise
        except (DockerException, RequestException) as exc:
            raise SandboxError(f"cannot extract /workspace of {image!r}: {exc}") from exc
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def _run(argv: list[str], action: str) -> None:
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxError(f"cannot {action}: {exc}") from exc
    if result.returncode != 0:
        raise SandboxError(
            f"cannot {action}: {' '.join(argv[:1])} exited {result.returncode}: "
            f"{result.stderr.strip()[-500:]} (ORCH_SANDBOX_DISK_MB=0 leaves /workspace uncapped)"
        )
