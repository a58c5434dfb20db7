"""A repository's set-up image (docs/datasets.md): its dependencies installed once per
dependency fingerprint (sandbox/repos.HostRepos.fingerprint), on the base image, so the
tests of every commit that agrees on them run without installing anything per rollout.
The commit's tree is not in the image: it is the sandbox's /workspace (sandbox/repos.py).

Built on the host that needs it first (a `check_commit` or `dataset prepare`, else a
create), once however many ask at once (a ``flock`` per image); Python dependencies come
from the set-up's wheelhouse on the host, not from an index.
"""

from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
from pathlib import Path

import docker
from docker.errors import ImageNotFound

from orchestrator.config import Settings
from orchestrator.docker_client import connect
from orchestrator.images.base import BUILD_TIMEOUT_S, ImageBuildError, run_build, scratch_dir
from orchestrator.observability.logging import get_logger
from orchestrator.sandbox.backend import CommitWorkspace, RepoSetup
from orchestrator.sandbox.repos import HostRepos, RepoError

log = get_logger(__name__)

IMAGE_REPO = "orchestrator/repo-setup"
LABEL_REPO = "orchestrator.repo"
LABEL_FINGERPRINT = "orchestrator.repo.fingerprint"


class SetupFailed(RuntimeError):
    """The repository's set-up does not build: its own fault (a 422 naming the row), the
    tail of the build's output in the message."""


def setup_image_ref(repo: str, fingerprint: str) -> str:
    """The image of ``repo``'s set-up for one dependency fingerprint."""
    return f"{IMAGE_REPO}:{repo}-{fingerprint[:20]}"


def _dockerfile(setup: RepoSetup) -> str:
    if setup.dockerfile:
        return setup.dockerfile
    script = " && ".join(f"( {command} )" for command in setup.commands)
    return (
        "ARG BASE_IMAGE\n"
        "FROM ${BASE_IMAGE}\n"
        "COPY deps/ /opt/setup/\n"
        "COPY wheelhouse/ /opt/wheelhouse/\n"
        "WORKDIR /opt/setup\n"
        "ENV PIP_NO_INDEX=1 PIP_FIND_LINKS=/opt/wheelhouse\n"
        f"RUN {script}\n"
        "WORKDIR /workspace\n"
    )


def _present(client: docker.DockerClient, ref: str) -> bool:
    try:
        client.images.get(ref)
    except ImageNotFound:
        return False
    return True


def ensure_setup_image(
    settings: Settings, repos: HostRepos, workspace: CommitWorkspace
) -> tuple[str, bool]:
    """The set-up image of ``workspace``'s commit on this host, built when it is missing
    (its commit must be in the store: ``HostRepos.has_commit``); (its reference, whether
    this call built it). :class:`SetupFailed` when the set-up does not build;
    :class:`~orchestrator.sandbox.repos.RepoError` when the store fails."""
    setup = workspace.setup
    if setup is None:
        raise ValueError(f"repository {workspace.repo!r} has no set-up")
    fingerprint = repos.fingerprint(workspace.repo, workspace.commit, setup)
    ref = setup_image_ref(workspace.repo, fingerprint)
    if workspace.setup_image and workspace.setup_image != ref:
        raise RepoError(
            f"the set-up of {workspace.label} is {ref} on this host, not "
            f"{workspace.setup_image}: its wheelhouse differs from the first host's"
        )
    client = connect(settings, timeout_s=BUILD_TIMEOUT_S)
    if _present(client, ref):
        return ref, False
    with repos.lock(workspace.repo, f"setup-{fingerprint[:20]}"):
        if _present(client, ref):
            return ref, False
        _build(settings, client, repos, workspace, setup, ref, fingerprint)
    return ref, True


def _build(
    settings: Settings,
    client: docker.DockerClient,
    repos: HostRepos,
    workspace: CommitWorkspace,
    setup: RepoSetup,
    ref: str,
    fingerprint: str,
) -> None:
    with tempfile.TemporaryDirectory(prefix="repo-setup-", dir=scratch_dir(settings)) as tmp:
        context = Path(tmp)
        (context / "deps").mkdir()
        (context / "wheelhouse").mkdir()
        written = repos.export_files(workspace.repo, workspace.commit, setup.deps, context / "deps")
        if setup.wheelhouse:
            for wheel in Path(setup.wheelhouse).iterdir():
                if wheel.is_file():
                    shutil.copy2(wheel, context / "wheelhouse" / wheel.name)
        (context / "Dockerfile").write_text(_dockerfile(setup))
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            tar.add(str(context), arcname=".")
        archive.seek(0)
        try:
            run_build(
                client,
                progress=lambda _line: None,
                what=ref,
                fileobj=archive,
                custom_context=True,
                tag=ref,
                buildargs={"BASE_IMAGE": settings.base_image},
                labels={LABEL_REPO: workspace.repo, LABEL_FINGERPRINT: fingerprint},
            )
        except ImageBuildError as exc:
            raise SetupFailed(f"the set-up of repository {workspace.repo!r} failed: {exc}") from exc
    log.info(
        "repo.setup_built",
        repo=workspace.repo,
        commit=workspace.commit,
        image=ref,
        deps=written,
    )
