"""Codebases: named images ``<codebase_image_repo>:<name>`` holding a tree at /workspace.

A codebase comes from a plain directory (copied as is) or from a local git repository at a
revision. From git, /workspace holds a fresh repository whose only history is that revision
and its ancestors: an agent must not be able to find later commits (the answer to its task)
through other branches, tags, reflogs, remotes or unreachable objects.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

import docker
from docker.errors import APIError, ImageNotFound
from pydantic import BaseModel, ConfigDict

from orchestrator.config import Settings
from orchestrator.docker_client import connect
from orchestrator.images.base import (
    BUILD_TIMEOUT_S,
    ImageBuildError,
    Progress,
    drop_if_untagged,
    image_store_lock,
    run_build,
    scratch_dir,
)
from orchestrator.images.catalog import NAME_RE, CatalogError, read_catalog
from orchestrator.observability.logging import get_logger
from orchestrator.sandbox.repos import git_environment

log = get_logger(__name__)

LABEL_NAME = "orchestrator.codebase"
LABEL_SOURCE = "orchestrator.codebase.source"
LABEL_REV = "orchestrator.codebase.rev"
LABEL_COMMIT = "orchestrator.codebase.commit"
LABEL_CREATED = "orchestrator.codebase.created"

AGENT_UID = 1000
AGENT_GID = 1000

# The image adds one layer to the base: the tree, owned by the agent so the per-sandbox
# volume Docker seeds from /workspace is writable by it.
_DOCKERFILE = f"""\
ARG BASE_IMAGE
FROM ${{BASE_IMAGE}}
COPY --chown={AGENT_UID}:{AGENT_GID} workspace/ /workspace/
WORKDIR /workspace
"""


class CodebaseError(RuntimeError):
    """A codebase operation failed; the message is meant for the person who asked."""


class InvalidCodebaseName(CodebaseError, ValueError):
    """The name does not match ``[a-z0-9][a-z0-9._-]*`` (at most 64 characters)."""


class UnknownCodebase(CodebaseError, LookupError):
    """No codebase image by that name exists."""


class CodebaseExists(CodebaseError):
    """A codebase by that name exists and replacing it was not asked for."""


class CodebaseSourceError(CodebaseError, ValueError):
    """The source is not a directory or git repository, or the revision is unknown."""


class CodebaseInfo(BaseModel):
    """One codebase image, as read back from its labels."""

    model_config = ConfigDict(frozen=True)

    name: str
    image: str
    """Image reference, ``<codebase_image_repo>:<name>``."""
    image_id: str
    source: str
    rev: str
    """The revision asked for ('' for a plain directory)."""
    commit: str
    """The commit it resolved to ('' for a plain directory)."""
    created: datetime | None
    size_bytes: int


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid codebase name, else raise :class:`InvalidCodebaseName`."""
    if not NAME_RE.fullmatch(name):
        raise InvalidCodebaseName(
            f"invalid codebase name {name!r}: use lowercase letters, digits, '.', '_' and '-', "
            "starting with a letter or digit, at most 64 characters"
        )
    return name


def image_ref(settings: Settings, name: str) -> str:
    """The image reference a codebase of this name is stored under."""
    return f"{settings.codebase_image_repo}:{validate_name(name)}"


def _info(
    settings: Settings, name: str, image_id: str, labels: dict[str, str], size: int
) -> CodebaseInfo:
    created_raw = labels.get(LABEL_CREATED, "")
    try:
        created = datetime.fromisoformat(created_raw) if created_raw else None
    except ValueError:
        created = None
    return CodebaseInfo(
        name=name,
        image=f"{settings.codebase_image_repo}:{name}",
        image_id=image_id,
        source=labels.get(LABEL_SOURCE, ""),
        rev=labels.get(LABEL_REV, ""),
        commit=labels.get(LABEL_COMMIT, ""),
        created=created,
        size_bytes=size,
    )


def _catalogued(path: Path) -> dict[str, CodebaseInfo]:
    try:
        catalog = read_catalog(path)
    except CatalogError as exc:
        raise CodebaseError(str(exc)) from exc
    return {
        name: CodebaseInfo(
            name=name,
            image=ref,
            image_id=ref.partition("@")[2],
            source=f"catalogue {path}",
            rev="",
            commit="",
            created=None,
            size_bytes=0,
        )
        for name, ref in catalog.root.items()
    }


def get_codebase(settings: Settings, name: str) -> CodebaseInfo:
    """The codebase called ``name``; :class:`UnknownCodebase` if there is none.

    From the catalogue file when ``codebases_file`` is set (images/catalog.py), else from
    the Docker daemon's images."""
    if settings.codebases_file is not None:
        found = _catalogued(settings.codebases_file).get(validate_name(name))
        if found is None:
            raise UnknownCodebase(
                f"unknown codebase {name!r} (not in the catalogue {settings.codebases_file})"
            )
        return found
    ref = image_ref(settings, name)
    client = connect(settings)
    try:
        image = client.images.get(ref)
    except ImageNotFound:
        image = None
    # An image under our repository without our label was not made by us: not a codebase.
    if image is None or (image.labels or {}).get(LABEL_NAME) != name:
        raise UnknownCodebase(f"unknown codebase {name!r} (no image {ref})")
    labels: dict[str, str] = image.labels or {}
    return _info(settings, name, str(image.id), labels, int(image.attrs.get("Size") or 0))


def codebase_image(settings: Settings, name: str) -> str:
    """The image reference to run for codebase ``name``; :class:`UnknownCodebase` if none."""
    return get_codebase(settings, name).image


def list_codebases(settings: Settings) -> list[CodebaseInfo]:
    """All codebases, sorted by name."""
    if settings.codebases_file is not None:
        listed = _catalogued(settings.codebases_file)
        return [listed[n] for n in sorted(listed)]
    client = connect(settings)
    prefix = f"{settings.codebase_image_repo}:"
    found: dict[str, CodebaseInfo] = {}
    # One listing call: the SDK's images.list() inspects each image afterwards, which fails
    # when another process removes one in between.
    for image in client.api.images(filters={"label": LABEL_NAME}):
        labels: dict[str, str] = image.get("Labels") or {}
        name = labels.get(LABEL_NAME, "")
        # The label survives a re-tag or a replaced (now untagged) image; only the image that
        # currently holds the tag is the codebase.
        if f"{prefix}{name}" in (image.get("RepoTags") or []):
            found[name] = _info(
                settings, name, str(image["Id"]), labels, int(image.get("Size") or 0)
            )
    return [found[n] for n in sorted(found)]


def publish_codebase(settings: Settings, name: str, registry: str) -> str:
    """Push codebase ``name``'s image to ``registry`` (a prefix such as
    ``registry.example.com/team/``, as ``k8s_image_registry`` takes it); return the
    reference to put in the catalogue: relative to the registry and pinned by digest, so a
    later push under the same tag cannot change what a running deployment starts."""
    if registry and not registry.endswith("/"):
        raise CodebaseError(f"registry {registry!r} must end with '/' (it is a prefix)")
    info = get_codebase(settings, name)
    repository = f"{registry}{settings.codebase_image_repo}"
    client = connect(settings)
    try:
        client.images.get(info.image).tag(repository, tag=name)
        for line in client.images.push(repository, tag=name, stream=True, decode=True):
            if "error" in line:
                raise CodebaseError(f"could not push {repository}:{name}: {line['error']}")
        digests: list[str] = client.images.get(f"{repository}:{name}").attrs["RepoDigests"]
    except APIError as exc:
        raise CodebaseError(f"could not push {repository}:{name}: {exc.explanation}") from exc
    pushed = next((d for d in digests if d.startswith(f"{repository}@")), None)
    if pushed is None:
        raise CodebaseError(f"the registry reported no digest for {repository}:{name}")
    ref = f"{settings.codebase_image_repo}@{pushed.partition('@')[2]}"
    log.info("codebase published", codebase=name, repository=repository, ref=ref)
    return ref


def remove_codebase(settings: Settings, name: str) -> None:
    """Remove codebase ``name``'s image; :class:`UnknownCodebase` if there is none.

    Sandboxes already running from it keep working: Docker only drops the tag while
    containers use the image.
    """
    info = get_codebase(settings, name)
    client = connect(settings)
    try:
        # Its untagged parents go with it: not while a build may be taking them from the
        # builder's cache (image_store_lock).
        with image_store_lock(client, exclusive=True):
            client.images.remove(info.image, noprune=False)
    except ImageNotFound as exc:
        raise UnknownCodebase(f"unknown codebase {name!r}") from exc
    except ImageBuildError as exc:
        raise CodebaseError(f"could not remove codebase {name!r}: {exc}") from exc
    except APIError as exc:
        # Pruning the image's untagged parents races with another removal sharing them (the
        # builder's cache makes identical steps one layer): the daemon answers 500
        # "unrecognized image ID" for a parent already gone, after our tag went. Gone is
        # what was asked for.
        if not _still_tagged(client, info.image):
            log.info("codebase removed", codebase=name, image_id=info.image_id, note=str(exc))
            return
        raise CodebaseError(f"could not remove codebase {name!r}: {exc.explanation}") from exc
    log.info("codebase removed", codebase=name, image_id=info.image_id)


def _still_tagged(client: docker.DockerClient, ref: str) -> bool:
    try:
        client.images.get(ref)
    except ImageNotFound:
        return False
    return True


# --- git -----------------------------------------------------------------------------------


def _git(
    args: list[str], *, cwd: Path, env: dict[str, str], check: bool = True
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["git", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if check and proc.returncode != 0:
        raise CodebaseSourceError(
            f"git {' '.join(args[:3])} failed (exit {proc.returncode}): {proc.stderr.strip()}"
        )
    return proc


def _is_git_source(source: Path, env: dict[str, str]) -> bool:
    if (source / ".git").exists():
        return True
    # A bare repository: git finds one at the path itself. A plain directory nested inside some
    # other repository's work tree is not a git source.
    proc = _git(["rev-parse", "--absolute-git-dir"], cwd=source, env=env, check=False)
    return proc.returncode == 0 and Path(proc.stdout.strip()).resolve() == source.resolve()


def _resolve_commit(source: Path, rev: str, env: dict[str, str]) -> str:
    if rev.startswith("-") or not rev.strip():
        raise CodebaseSourceError(f"invalid revision {rev!r}")
    proc = _git(
        ["rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=source, env=env, check=False
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise CodebaseSourceError(f"unknown revision {rev!r} in git repository {source}")
    return proc.stdout.strip()


def _has_uncommitted_changes(source: Path, env: dict[str, str]) -> bool:
    if (source / ".git").exists():
        # No fsmonitor: a repository's own config must not make us run its programs.
        args = ["-c", "core.fsmonitor=false", "status", "--porcelain", "--untracked-files=no"]
        proc = _git(args, cwd=source, env=env, check=False)
        return proc.returncode == 0 and bool(proc.stdout.strip())
    return False


def _object_ids(lines: str) -> set[str]:
    return {line.split()[0] for line in lines.splitlines() if line.strip()}


def _export_git_revision(source: Path, commit: str, dest: Path, env: dict[str, str]) -> None:
    """Make ``dest`` a fresh repository holding only ``commit`` and its ancestors, checked out.

    The new repository fetches exactly that commit from ``source``: the pack git sends holds
    only objects reachable from it, with no tags, no remotes and no other refs. Reflogs,
    FETCH_HEAD/ORIG_HEAD and hooks are removed, and the object store is verified to hold
    nothing else, so the agent sees no trace of later history.
    """
    _git(
        ["init", "--quiet", "--template=", "--initial-branch=main", str(dest)],
        cwd=dest.parent,
        env=env,
    )
    no_reflog = ["-c", "core.logAllRefUpdates=false"]
    _git(
        [
            *no_reflog,
            "fetch",
            "--quiet",
            "--no-tags",
            "--no-write-fetch-head",
            "--no-recurse-submodules",
            "--update-head-ok",
            str(source),
            f"+{commit}:refs/heads/main",
        ],
        cwd=dest,
        env=env,
    )
    _git([*no_reflog, "reset", "--quiet", "--hard", "main"], cwd=dest, env=env)

    git_dir = dest / ".git"
    _git(
        ["reflog", "expire", "--expire=now", "--expire-unreachable=now", "--all"], cwd=dest, env=env
    )
    for leftover in ("logs", "hooks", "FETCH_HEAD", "ORIG_HEAD", "description"):
        path = git_dir / leftover
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()

    refs = _git(["for-each-ref", "--format=%(refname)"], cwd=dest, env=env).stdout.split()
    if refs != ["refs/heads/main"]:
        raise ImageBuildError(f"unexpected refs in exported repository: {refs}")
    reachable = _object_ids(_git(["rev-list", "--objects", commit], cwd=dest, env=env).stdout)
    stored = _object_ids(
        _git(
            ["cat-file", "--batch-all-objects", "--batch-check=%(objectname)"], cwd=dest, env=env
        ).stdout
    )
    if not stored <= reachable:
        extra = sorted(stored - reachable)
        raise ImageBuildError(
            f"exported repository holds {len(extra)} objects not reachable from {commit[:12]} "
            f"(e.g. {extra[0]}); refusing to build an image that could leak later history"
        )


# --- build ---------------------------------------------------------------------------------


def _agent_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid, info.gid = AGENT_UID, AGENT_GID
    info.uname = info.gname = "agent"
    return info


def _write_context(out: IO[bytes], tree: Path) -> None:
    # The context is assembled as a tar directly so a plain directory is not copied first;
    # symlinks stay symlinks and sockets (which tar cannot hold) are left out by tarfile.
    with tarfile.open(fileobj=out, mode="w") as tar:
        data = _DOCKERFILE.encode()
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(data)
        info.mode = 0o644
        tar.addfile(info, io.BytesIO(data))
        try:
            tar.add(str(tree), arcname="workspace", recursive=True, filter=_agent_owned)
        except OSError as exc:
            raise CodebaseSourceError(f"cannot read {exc.filename}: {exc.strerror}") from exc
    out.seek(0)


def add_codebase(
    settings: Settings,
    name: str,
    source: str | Path,
    rev: str | None = None,
    *,
    replace: bool = False,
    progress: Progress | None = None,
) -> CodebaseInfo:
    """Build the image of codebase ``name`` from ``source`` and return what was built.

    ``source`` is a directory (copied as is) or a local git repository, work tree or bare.
    For git, ``rev`` (default ``HEAD``) is resolved to a commit and /workspace holds a fresh
    repository on branch ``main`` with only that commit and its ancestors. ``rev`` with a plain
    directory is an error. An existing codebase of that name is an error unless ``replace``.
    Nothing is built when the source or revision is bad.
    """
    say: Progress = progress or (lambda line: log.info(line))
    validate_name(name)
    ref = image_ref(settings, name)
    src = Path(source).expanduser()
    if not src.is_dir():
        raise CodebaseSourceError(f"source {str(source)!r} is not a directory or git repository")
    src = src.resolve()

    client = connect(settings, timeout_s=BUILD_TIMEOUT_S)
    try:
        client.images.get(settings.base_image)
    except ImageNotFound as exc:
        raise CodebaseError(
            f"base image {settings.base_image} is missing: run `orchestrator image build` first"
        ) from exc
    try:
        existing = client.images.get(ref)
    except ImageNotFound:
        existing = None
    if existing is not None and not replace:
        raise CodebaseExists(f"codebase {name!r} already exists ({ref}); use --replace")

    with tempfile.TemporaryDirectory(prefix="codebase-", dir=scratch_dir(settings)) as tmp_str:
        tmp = Path(tmp_str)
        global_config = tmp / "gitconfig"
        global_config.write_text("[safe]\n\tdirectory = *\n")
        env = git_environment(global_config)

        commit = ""
        if _is_git_source(src, env):
            rev_label = rev or ""
            commit = _resolve_commit(src, rev or "HEAD", env)
            say(f"exporting {src} at {rev or 'HEAD'} ({commit[:12]}) ...")
            if rev is None and _has_uncommitted_changes(src, env):
                say("note: uncommitted changes in the source are not included (git uses HEAD)")
            tree = tmp / "workspace"
            _export_git_revision(src, commit, tree, env)
        else:
            if rev:
                raise CodebaseSourceError(
                    f"--rev {rev!r} given but {src} is a plain directory, not a git repository"
                )
            rev_label = ""
            tree = src

        labels = {
            LABEL_NAME: name,
            LABEL_SOURCE: str(src),
            LABEL_REV: rev_label,
            LABEL_COMMIT: commit,
            LABEL_CREATED: datetime.now(UTC).isoformat(timespec="seconds"),
        }
        say(f"building {ref} ...")
        with tempfile.TemporaryFile(dir=tmp) as context:
            _write_context(context, tree)
            image_id = run_build(
                client,
                progress=lambda _line: None,
                what=ref,
                fileobj=context,
                custom_context=True,
                tag=ref,
                buildargs={"BASE_IMAGE": settings.base_image},
                labels=labels,
            )
    if existing is not None and existing.id != image_id:
        drop_if_untagged(client, str(existing.id))
    info = get_codebase(settings, name)
    say(f"built {ref} ({image_id[:19]}, {info.size_bytes / 1e6:.1f} MB)")
    log.debug("codebase added", codebase=name, image_id=image_id, commit=commit)
    return info
