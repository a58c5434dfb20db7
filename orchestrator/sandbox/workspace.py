"""Writable /workspace for a read-only sandbox, in constant time: an overlay mount whose
lower layer is the image's /workspace, extracted once per image per host, and whose upper
layer is the sandbox's own (removed with it).

Docker mounts the overlay itself, as a ``local`` volume with overlay options, when the
container starts, and unmounts it when the container goes. Compared with a plain volume
(which Docker seeds by copying the image's /workspace on first mount), creating a sandbox
no longer costs a copy of the codebase in time and disk.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
import uuid
from pathlib import Path

import docker
from docker.errors import DockerException, NotFound

from orchestrator.sandbox import labels
from orchestrator.sandbox.backend import SandboxError

WORKSPACE = "/workspace"


class Workspaces:
    """Lower layers under ``<state_dir>/layers/<image id>``, upper layers under
    ``<state_dir>/upper/<deployment>/<sandbox id>``."""

    def __init__(self, client: docker.DockerClient, state_dir: Path, deployment: str) -> None:
        self.client = client
        self.deployment = deployment
        self.layers = state_dir / "layers"
        self.uppers = state_dir / "upper" / deployment
        self.layers.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.uppers.mkdir(parents=True, exist_ok=True, mode=0o700)

    def volume_options(self, image: str, sandbox_id: str) -> dict[str, str]:
        """Driver options of the sandbox's /workspace volume (makes its upper layer)."""
        lower = self.lower(image)
        top = self.uppers / sandbox_id
        upper, work = top / "upper", top / "work"
        top.mkdir(mode=0o700)
        upper.mkdir()
        work.mkdir()
        # The merged root takes its owner and mode from the upper layer's root.
        info = lower.stat()
        os.chown(upper, info.st_uid, info.st_gid)
        upper.chmod(info.st_mode & 0o7777)
        return {
            "type": "overlay",
            "device": "overlay",
            "o": f"lowerdir={lower},upperdir={upper},workdir={work}",
        }

    def remove(self, sandbox_id: str) -> None:
        shutil.rmtree(self.uppers / sandbox_id, ignore_errors=True)

    def sweep_layers(self) -> int:
        """Remove lower layers of images the daemon no longer has. An image cannot go while
        a container uses it (Docker keeps it, untagged, until the last one is removed), so
        no mounted layer is touched. Returns how many were removed."""
        try:
            present = {
                str(i["Id"]).removeprefix("sha256:")[:32] for i in self.client.api.images(all=True)
            }
        except DockerException:
            return 0
        removed = 0
        for entry in self.layers.iterdir():
            if entry.is_dir() and not entry.name.startswith(".") and entry.name not in present:
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
        except DockerException as exc:
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
        except DockerException as exc:
            raise SandboxError(f"cannot extract /workspace of {image!r}: {exc}") from exc
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
