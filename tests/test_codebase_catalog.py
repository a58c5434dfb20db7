"""The codebase catalogue (Kubernetes: no Docker daemon to ask) and `codebase publish`,
pushed to a real registry (Debian's docker-registry, which `make test` installs)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import httpx
import pytest
from docker.errors import ImageNotFound
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.config import Settings
from orchestrator.environments.loader import load_environments
from orchestrator.images.base import BaseBuildResult
from orchestrator.images.codebases import (
    CodebaseError,
    UnknownCodebase,
    add_codebase,
    codebase_image,
    get_codebase,
    list_codebases,
    remove_codebase,
)
from orchestrator.tls import tls

DIGEST = "sha256:" + "ab" * 32


def _catalogue(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "codebases.yaml"
    path.write_text(text)
    return path


def _no_daemon(settings: Settings, catalogue: Path) -> Settings:
    # A daemon address that answers nothing: any lookup that still asks Docker fails.
    return settings.model_copy(
        update={"codebases_file": catalogue, "docker_host": "unix:///nonexistent/docker.sock"}
    )


def test_the_catalogue_answers_without_a_docker_daemon(settings: Settings, tmp_path: Path) -> None:
    catalogue = _catalogue(
        tmp_path,
        f"requests: orchestrator/codebase@{DIGEST}\nflask: team/flask:2.3.0\n",
    )
    offline = _no_daemon(settings, catalogue)
    assert codebase_image(offline, "requests") == f"orchestrator/codebase@{DIGEST}"
    info = get_codebase(offline, "flask")
    assert info.image == "team/flask:2.3.0"
    assert str(catalogue) in info.source
    assert [c.name for c in list_codebases(offline)] == ["flask", "requests"]
    with pytest.raises(UnknownCodebase, match="not in the catalogue"):
        get_codebase(offline, "django")


def test_a_dataset_row_resolves_through_the_catalogue(settings: Settings, tmp_path: Path) -> None:
    offline = _no_daemon(
        settings, _catalogue(tmp_path, f"requests: orchestrator/codebase@{DIGEST}\n")
    )
    registry = load_environments(offline)
    row = {"environment": "codebase-planning", "codebase": "requests"}
    resolved = registry.resolve(row)
    assert resolved.image == f"orchestrator/codebase@{DIGEST}"
    with pytest.raises(UnknownCodebase, match="orchestrator codebase publish django"):
        registry.resolve({**row, "codebase": "django"})


def test_the_catalogue_is_reread_when_its_file_changes(settings: Settings, tmp_path: Path) -> None:
    catalogue = _catalogue(tmp_path, "a: repo/a:1\n")
    offline = _no_daemon(settings, catalogue)
    assert codebase_image(offline, "a") == "repo/a:1"
    catalogue.write_text("a: repo/a:2\nb: repo/b:1\n")
    # A ConfigMap update swaps the file: the new content must be seen without a restart.
    with contextlib.suppress(OSError):
        catalogue.touch()
    assert codebase_image(offline, "a") == "repo/a:2"
    assert codebase_image(offline, "b") == "repo/b:1"


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("- requests\n", "valid dictionary"),
        ("Requests: repo/x:1\n", "invalid codebase name 'Requests'"),
        ("requests: https://registry/x:1\n", "is not an image reference"),
        ("requests: repo/x@sha256:short\n", "is not an image reference"),
        ("requests: [unclosed\n", "invalid"),
    ],
)
def test_a_bad_catalogue_is_a_clear_error(
    settings: Settings, tmp_path: Path, text: str, complaint: str
) -> None:
    offline = _no_daemon(settings, _catalogue(tmp_path, text))
    with pytest.raises(CodebaseError, match="codebase catalogue") as caught:
        get_codebase(offline, "requests")
    assert complaint in str(caught.value)


def test_a_missing_catalogue_is_a_clear_error(settings: Settings, tmp_path: Path) -> None:
    offline = _no_daemon(settings, tmp_path / "absent.yaml")
    with pytest.raises(CodebaseError, match="No such file"):
        get_codebase(offline, "requests")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[str]:
    """A real OCI registry on loopback (dockerd trusts 127.0.0.0/8 over plain HTTP)."""
    binary = shutil.which("docker-registry")
    assert binary, "docker-registry is missing: run scripts/host-setup.sh (make test does)"
    port = _free_port()
    config = tmp_path / "registry.yml"
    config.write_text(
        "version: 0.1\n"
        f"storage: {{filesystem: {{rootdirectory: {tmp_path / 'data'}}}}}\n"
        f"http: {{addr: 127.0.0.1:{port}}}\n"
        "log: {level: error}\n"
    )
    proc = subprocess.Popen(
        [binary, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if (
                    httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1, verify=tls()).status_code
                    == 200
                ):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the registry did not start"
            time.sleep(0.1)
        yield f"127.0.0.1:{port}/"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        # The pushed layers are the size of the image; pytest would keep them around.
        shutil.rmtree(tmp_path / "data", ignore_errors=True)


def test_publish_pushes_and_prints_a_pinned_catalogue_entry(
    settings: Settings,
    base: BaseBuildResult,
    client: docker.DockerClient,
    registry: str,
    tmp_path: Path,
) -> None:
    name = f"test-{uuid.uuid4().hex[:8]}"
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "README").write_text("published\n")
    add_codebase(settings, name, tree, None)
    pushed_tag = f"{registry}{settings.codebase_image_repo}:{name}"
    try:
        result = CliRunner().invoke(app, ["codebase", "publish", name, "--registry", registry])
        assert result.exit_code == 0, result.output
        entry = result.output.strip()
        listed_name, _, ref = entry.partition(": ")
        assert listed_name == name
        repo, _, digest = ref.partition("@")
        assert repo == settings.codebase_image_repo and digest.startswith("sha256:")
        # The registry holds exactly that manifest: what the cluster will pull.
        manifest = httpx.get(
            f"http://{registry}v2/{repo}/manifests/{digest}",
            headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
            verify=tls(),
        )
        assert manifest.status_code == 200, manifest.text
        # The printed line is a valid catalogue, and resolves to the pinned reference.
        offline = _no_daemon(settings, _catalogue(tmp_path, entry + "\n"))
        assert codebase_image(offline, name) == ref

        refused = CliRunner().invoke(
            app, ["codebase", "publish", name, "--registry", "127.0.0.1:1"]
        )
        assert refused.exit_code == 1
        assert "must end with '/'" in refused.output
    finally:
        with contextlib.suppress(ImageNotFound):
            client.images.remove(pushed_tag)
        remove_codebase(settings, name)
