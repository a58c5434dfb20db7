"""The base sandbox image: the OS image under it, and a cached build of ``sandbox_images/base``.

No registry is reachable on the machines this runs on, so the OS image a Dockerfile's ``FROM``
names is made locally with ``debootstrap`` when it cannot be pulled, and tagged with the same
name so the Dockerfiles stay unchanged where a registry exists. The base image is rebuilt only
when its inputs change: a hash of them is stored as a label on the image.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, DockerException, ImageNotFound
from pydantic import BaseModel, ConfigDict

from orchestrator.config import Settings
from orchestrator.docker_client import connect
from orchestrator.observability.logging import get_logger

log = get_logger(__name__)

INPUTS_HASH_LABEL = "orchestrator.inputs-hash"
"""Label on the base image: hash of everything its build read."""
OS_IMAGE_SOURCE_LABEL = "orchestrator.os-image.source"
"""Label on an OS image this module made: how it was made (``debootstrap <suite> <mirror>``)."""

# Builds print little for minutes (apt downloads), so the socket timeout must outlast them.
BUILD_TIMEOUT_S = 1800.0
DEBOOTSTRAP_TIMEOUT_S = 1800.0
PULL_TIMEOUT_S = 30.0

Progress = Callable[[str], None]
"""Receives one short line of human-readable progress."""


class ImageBuildError(RuntimeError):
    """An image could not be made; the message says which step failed and why."""


class BaseBuildResult(BaseModel):
    """What :func:`build_base_image` did."""

    model_config = ConfigDict(frozen=True)

    image: str
    image_id: str
    inputs_hash: str
    skipped: bool
    """True when an image with the same inputs hash already existed and nothing was built."""
    os_image: str
    os_image_id: str
    os_image_made: bool
    """True when the OS image was missing and made by debootstrap during this call."""
    duration_s: float


def _log_progress(line: str) -> None:
    log.info(line)


def sandbox_images_dir() -> Path:
    """The ``sandbox_images/`` directory of this checkout; :class:`ImageBuildError` if absent."""
    # Relative to this file, not ``orchestrator.__file__``: an editable install made before the
    # package had an ``__init__.py`` imports it as a namespace package whose __file__ is None.
    candidate = Path(__file__).resolve().parents[2] / "sandbox_images"
    if not (candidate / "base" / "Dockerfile").is_file():
        raise ImageBuildError(
            f"sandbox_images/ not found at {candidate}: image builds need a source checkout "
            "of the project (the Dockerfiles are not part of an installed wheel)"
        )
    return candidate


def _context_files(context: Path) -> list[Path]:
    # Sorted so the hash does not depend on directory listing order.
    return sorted(p for p in context.rglob("*") if p.is_file() or p.is_symlink())


def inputs_hash(context: Path, os_image_id: str, build_args: dict[str, str]) -> str:
    """Hash of everything a build of ``context`` reads: files, modes, base image, build args.

    Any change to these may change the image, so it is the cache key of :func:`build_base_image`.
    """
    h = hashlib.sha256()
    h.update(b"os-image\0" + os_image_id.encode() + b"\0")
    for key in sorted(build_args):
        h.update(f"arg\0{key}={build_args[key]}\0".encode())
    for path in _context_files(context):
        rel = path.relative_to(context).as_posix()
        if path.is_symlink():
            h.update(f"link\0{rel}\0{path.readlink()}\0".encode())
            continue
        # The executable bit survives COPY, so it is an input too.
        executable = bool(path.stat().st_mode & 0o111)
        h.update(f"file\0{rel}\0{int(executable)}\0".encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _image_or_none(client: docker.DockerClient, ref: str) -> Any:
    try:
        return client.images.get(ref)
    except ImageNotFound:
        return None


def _split_ref(ref: str) -> tuple[str, str]:
    # The tag is after the last colon unless that colon belongs to a registry host:port.
    repo, sep, tag = ref.rpartition(":")
    if not sep or "/" in tag:
        return ref, "latest"
    return repo, tag


def _try_pull(settings: Settings, ref: str, progress: Progress) -> bool:
    repo, tag = _split_ref(ref)
    progress(f"pulling {ref} ...")
    try:
        client = connect(settings, timeout_s=PULL_TIMEOUT_S)
        client.images.pull(repo, tag=tag)
    except (DockerException, OSError) as exc:
        reason = str(exc.explanation if isinstance(exc, APIError) else exc).strip()
        reason = reason.splitlines()[0] if reason else type(exc).__name__
        progress(f"pull failed ({reason[:160]}); making it with debootstrap instead")
        return False
    return True


def _mounts_under(root: Path) -> list[str]:
    # A debootstrap that failed half-way can leave /proc or /sys mounted inside the rootfs;
    # deleting the tree without unmounting them first would recurse into the host's /proc.
    prefix = str(root.resolve()).rstrip("/") + "/"
    found: list[str] = []
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) > 1:
            mount_point = fields[1].encode().decode("unicode_escape")
            if mount_point.startswith(prefix):
                found.append(mount_point)
    return sorted(found, key=len, reverse=True)


def _remove_rootfs(root: Path) -> None:
    for mount_point in _mounts_under(root):
        subprocess.run(["umount", "-l", mount_point], check=False, capture_output=True)
    if _mounts_under(root):
        log.warning("rootfs still has mounts; leaving it in place", path=str(root))
        return
    shutil.rmtree(root, ignore_errors=True)


def scratch_dir(settings: Settings) -> Path:
    """A directory for build scratch: ``<state_dir>/build``, or the system temp dir.

    The state dir is normally only writable by root; an unprivileged developer still gets a
    working ``codebase add`` through the fallback.
    """
    wanted = settings.state_dir / "build"
    try:
        wanted.mkdir(parents=True, exist_ok=True)
    except OSError:
        return Path(tempfile.gettempdir())
    if not os.access(wanted, os.W_OK | os.X_OK):
        return Path(tempfile.gettempdir())
    return wanted


def _tar_into_docker(client: docker.DockerClient, rootfs: Path, ref: str, source: str) -> str:
    repo, tag = _split_ref(ref)
    changes = [
        # What the official image sets; Docker's default PATH is the same, but explicit is safer.
        "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        'CMD ["bash"]',
        f'LABEL {OS_IMAGE_SOURCE_LABEL}="{source}"',
    ]
    # --numeric-owner: the rootfs's own /etc/passwd, not the host's, gives names to ids.
    tar = subprocess.Popen(
        ["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert tar.stdout is not None
    try:
        client.api.import_image_from_stream(tar.stdout, repository=repo, tag=tag, changes=changes)
    except DockerException as exc:
        tar.kill()
        raise ImageBuildError(f"docker import of {ref} failed: {exc}") from exc
    finally:
        tar.stdout.close()
        _, err = tar.communicate()
    if tar.returncode != 0:
        raise ImageBuildError(f"tar of {rootfs} failed: {err.decode(errors='replace')[-500:]}")
    image = _image_or_none(client, ref)
    if image is None:
        raise ImageBuildError(f"docker import reported success but {ref} does not exist")
    return str(image.id)


def make_os_image_with_debootstrap(
    settings: Settings, *, progress: Progress = _log_progress
) -> str:
    """Make ``settings.base_os_image`` from Debian packages and return its image id.

    Runs ``debootstrap --variant=minbase`` into a scratch directory (needs root and the Debian
    mirror), drops apt's package cache and lists as the official slim image does, and imports
    the tree with ``docker import``. The scratch directory is removed afterwards.
    """
    if shutil.which("debootstrap") is None:
        raise ImageBuildError(
            f"{settings.base_os_image} is not available and cannot be pulled, and debootstrap "
            "is not installed (apt-get install debootstrap)"
        )
    if os.geteuid() != 0:
        raise ImageBuildError(
            f"{settings.base_os_image} is not available and cannot be pulled; making it with "
            "debootstrap needs root"
        )
    client = connect(settings, timeout_s=BUILD_TIMEOUT_S)
    work = Path(tempfile.mkdtemp(prefix="debootstrap-", dir=scratch_dir(settings)))
    rootfs = work / "rootfs"
    source = f"debootstrap --variant=minbase {settings.debian_suite} {settings.debian_mirror}"
    try:
        progress(f"{source} (1-2 minutes) ...")
        started = time.monotonic()
        cmd = [
            "debootstrap",
            "--variant=minbase",
            settings.debian_suite,
            str(rootfs),
            settings.debian_mirror,
        ]
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=DEBOOTSTRAP_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise ImageBuildError(f"debootstrap timed out after {exc.timeout:.0f}s") from exc
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
            raise ImageBuildError(f"debootstrap failed (exit {proc.returncode}):\n{tail}")
        progress(f"debootstrap done in {time.monotonic() - started:.0f}s; importing")
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / leftover).glob("*"):
                if entry.is_file():
                    entry.unlink()
        image_id = _tar_into_docker(client, rootfs, settings.base_os_image, source)
    finally:
        _remove_rootfs(work)
    progress(f"imported {settings.base_os_image} ({image_id[:19]})")
    return image_id


def ensure_os_image(settings: Settings, *, progress: Progress = _log_progress) -> tuple[str, bool]:
    """Make sure ``settings.base_os_image`` exists locally: present, pulled, or debootstrapped.

    Returns ``(image_id, made)`` where ``made`` is true when it had to be pulled or made.
    """
    client = connect(settings)
    ref = settings.base_os_image
    image = _image_or_none(client, ref)
    if image is not None:
        return str(image.id), False
    if _try_pull(settings, ref, progress):
        image = _image_or_none(client, ref)
        if image is not None:
            progress(f"pulled {ref}")
            return str(image.id), True
    return make_os_image_with_debootstrap(settings, progress=progress), True


def _build_lines(stream: Iterable[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    # The build API streams JSON chunks; "stream" holds text output, "error" a failure.
    for chunk in stream:
        if "error" in chunk:
            yield "error", str(chunk["error"]).strip()
        elif "stream" in chunk:
            for line in str(chunk["stream"]).splitlines():
                if line.strip():
                    yield "stream", line.rstrip()
        elif "aux" in chunk and isinstance(chunk["aux"], dict) and "ID" in chunk["aux"]:
            yield "id", str(chunk["aux"]["ID"])


@contextlib.contextmanager
def image_store_lock(client: docker.DockerClient, *, exclusive: bool) -> Iterator[None]:
    """Hold the daemon's image store for a build (shared) or a removal (exclusive).

    Builds reuse any image's layers from the builder's cache, and a removal with pruning
    deletes the removed image's untagged parents: a removal beside a build of look-alike
    contents deleted the cached layer that build had just taken ("failed to get digest
    ...: no such file"). So builds share the store and a removal waits for them. The lock
    is a file lock named by the daemon's ID, held by every process of this machine that
    builds or removes through this module; a daemon reached over TCP from several
    machines is not covered (nor is an operator's own ``docker image prune``).
    """
    try:
        daemon = str(client.info().get("ID") or "default")
    except DockerException as exc:
        raise ImageBuildError(f"docker daemon unreachable: {exc}") from exc
    name = "".join(c if c.isalnum() else "-" for c in daemon)
    path = Path(tempfile.gettempdir()) / f"orchestrator-image-store-{name}.lock"
    # Read-only is enough for flock, so a lock file root made serves other users too;
    # O_NOFOLLOW: in a world-writable /tmp, never follow somebody's symlink.
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def run_build(
    client: docker.DockerClient,
    *,
    progress: Progress,
    what: str,
    **build_kwargs: Any,
) -> str:
    """Run one ``docker build`` through the API and return the new image id.

    Only ``Step n/m`` lines reach ``progress``; on failure the tail of the output is in the
    raised :class:`ImageBuildError`, so a failed ``apt-get`` is readable without ``--verbose``.
    Holds :func:`image_store_lock` (shared) while it runs.
    """
    with image_store_lock(client, exclusive=False):
        return _run_build(client, progress=progress, what=what, **build_kwargs)


def _run_build(
    client: docker.DockerClient, *, progress: Progress, what: str, **build_kwargs: Any
) -> str:
    tail: list[str] = []
    image_id = ""
    try:
        stream = client.api.build(decode=True, rm=True, forcerm=True, pull=False, **build_kwargs)
        for kind, text in _build_lines(stream):
            if kind == "id":
                image_id = text
                continue
            if kind == "error":
                tail.append(text)
                raise ImageBuildError(f"build of {what} failed:\n" + "\n".join(tail[-20:]))
            tail.append(text)
            del tail[:-40]
            if text.startswith("Step "):
                progress(f"  {text[:110]}")
    except DockerException as exc:
        raise ImageBuildError(f"build of {what} failed: {exc}") from exc
    if not image_id:
        raise ImageBuildError(f"build of {what} returned no image id:\n" + "\n".join(tail[-20:]))
    return image_id


def build_base_image(
    settings: Settings, *, force: bool = False, progress: Progress = _log_progress
) -> BaseBuildResult:
    """Make sure ``settings.base_image`` is built from ``sandbox_images/base``; cached.

    Makes the OS image first when missing (:func:`ensure_os_image`). The build is skipped when
    an image with that tag carries the current inputs hash (Dockerfile, context files, OS image
    id, build args). ``force`` rebuilds anyway, without Docker's layer cache, which also picks up
    newer Debian packages.
    """
    started = time.monotonic()
    context = sandbox_images_dir() / "base"
    os_image_id, os_made = ensure_os_image(settings, progress=progress)
    build_args = {"BASE_IMAGE": settings.base_os_image}
    digest = inputs_hash(context, os_image_id, build_args)

    client = connect(settings, timeout_s=BUILD_TIMEOUT_S)
    existing = _image_or_none(client, settings.base_image)
    existing_hash = (existing.labels or {}).get(INPUTS_HASH_LABEL) if existing else None

    def result(image_id: str, skipped: bool) -> BaseBuildResult:
        return BaseBuildResult(
            image=settings.base_image,
            image_id=image_id,
            inputs_hash=digest,
            skipped=skipped,
            os_image=settings.base_os_image,
            os_image_id=os_image_id,
            os_image_made=os_made,
            duration_s=time.monotonic() - started,
        )

    if existing is not None and existing_hash == digest and not force:
        progress(f"{settings.base_image} is up to date ({str(existing.id)[:19]}); build skipped")
        return result(str(existing.id), skipped=True)

    reason = "forced" if force and existing_hash == digest else "inputs changed"
    if existing is None:
        reason = "not built yet"
    progress(f"building {settings.base_image} from {context} ({reason}) ...")
    image_id = run_build(
        client,
        progress=progress,
        what=settings.base_image,
        path=str(context),
        tag=settings.base_image,
        buildargs=build_args,
        labels={INPUTS_HASH_LABEL: digest},
        nocache=force,
    )
    if existing is not None and existing.id != image_id:
        drop_if_untagged(client, str(existing.id))
    progress(f"built {settings.base_image} ({image_id[:19]}) in {time.monotonic() - started:.0f}s")
    return result(image_id, skipped=False)


def drop_if_untagged(client: docker.DockerClient, image_id: str) -> None:
    """Remove a replaced image once it has no tag left; keep it while anything uses it."""
    # Docker refuses (409) while containers or child images use it, which is the answer we
    # want, so errors are ignored. Pruning its parents needs the store to itself.
    try:
        with image_store_lock(client, exclusive=True):
            image = client.images.get(image_id)
            if not image.tags:
                client.images.remove(image_id, noprune=False)
    except (APIError, ImageNotFound, ImageBuildError):
        pass
