"""The base sandbox image, built for real by the local dockerd."""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

import docker
import pytest
from docker.errors import ImageNotFound

from orchestrator.config import Settings
from orchestrator.images.base import (
    INPUTS_HASH_LABEL,
    OS_IMAGE_SOURCE_LABEL,
    BaseBuildResult,
    build_base_image,
    image_store_lock,
    inputs_hash,
    make_os_image_with_debootstrap,
    sandbox_images_dir,
)


def run(
    client: docker.DockerClient, image: str, script: str, user: str = "1000:1000"
) -> tuple[int, str]:
    """Run ``script`` under bash in a fresh networkless container; always remove it."""
    container = client.containers.create(
        image, ["bash", "-c", script], user=user, network_mode="none", working_dir="/workspace"
    )
    try:
        container.start()
        status = container.wait(timeout=60)
        output = container.logs(stdout=True, stderr=True).decode()
        return int(status["StatusCode"]), output
    finally:
        container.remove(force=True)


def test_sandbox_images_dir_is_found() -> None:
    assert (sandbox_images_dir() / "base" / "Dockerfile").is_file()


def test_base_image_has_tools_user_and_workspace(
    base: BaseBuildResult, client: docker.DockerClient
) -> None:
    tools = "bash rg git python3 file tree find gawk sed grep"
    script = (
        f"for t in {tools}; do command -v $t >/dev/null || echo missing:$t; done; "
        "echo uid=$(id -u agent) gid=$(id -g agent) me=$(id -u); "
        "echo ws=$(stat -c %u:%g /workspace) pwd=$(pwd)"
    )
    code, out = run(client, base.image, script)
    assert code == 0, out
    assert "missing:" not in out
    assert "uid=1000 gid=1000 me=1000" in out
    assert "ws=1000:1000 pwd=/workspace" in out


def test_base_image_is_labelled_with_inputs_hash(
    base: BaseBuildResult, client: docker.DockerClient
) -> None:
    image = client.images.get(base.image)
    assert image.id == base.image_id
    assert image.labels[INPUTS_HASH_LABEL] == base.inputs_hash
    assert client.images.get(base.os_image).id == base.os_image_id


def test_second_build_is_skipped(base: BaseBuildResult, settings: Settings) -> None:
    lines: list[str] = []
    again = build_base_image(settings, progress=lines.append)
    assert again.skipped
    assert again.image_id == base.image_id
    assert again.inputs_hash == base.inputs_hash
    assert not again.os_image_made
    assert any("skipped" in line for line in lines)


def test_inputs_hash_tracks_every_input(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM x\n")
    (tmp_path / "sub").mkdir()
    script = tmp_path / "sub" / "run.sh"
    script.write_text("echo hi\n")
    args = {"BASE_IMAGE": "debian:bookworm-slim"}
    first = inputs_hash(tmp_path, "sha256:aa", args)
    assert inputs_hash(tmp_path, "sha256:aa", dict(args)) == first
    assert inputs_hash(tmp_path, "sha256:bb", args) != first
    assert inputs_hash(tmp_path, "sha256:aa", {"BASE_IMAGE": "other"}) != first

    script.chmod(0o755)
    executable = inputs_hash(tmp_path, "sha256:aa", args)
    assert executable != first
    script.write_text("echo bye\n")
    assert inputs_hash(tmp_path, "sha256:aa", args) not in (first, executable)
    (tmp_path / "extra").write_text("")
    with_extra = inputs_hash(tmp_path, "sha256:aa", args)
    (tmp_path / "extra").unlink()
    (tmp_path / "extra2").write_text("")
    assert inputs_hash(tmp_path, "sha256:aa", args) != with_extra


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("ORCH_TEST_DEBOOTSTRAP") != "1",
    reason="runs debootstrap against the Debian mirror (~30-90 s); set ORCH_TEST_DEBOOTSTRAP=1",
)
def test_debootstrap_makes_an_importable_os_image(
    tmp_path: Path, settings: Settings, client: docker.DockerClient
) -> None:
    ref = f"orchestrator-test/debian:test-{uuid.uuid4().hex[:8]}"
    local = settings.model_copy(update={"base_os_image": ref, "state_dir": tmp_path})
    try:
        image_id = make_os_image_with_debootstrap(local, progress=lambda _line: None)
        image = client.images.get(ref)
        assert image.id == image_id
        assert image.labels[OS_IMAGE_SOURCE_LABEL].startswith("debootstrap --variant=minbase")
        code, out = run(client, ref, "cat /etc/debian_version && ls /var/cache/apt/archives")
        assert code == 0, out
        assert out.split()[0].startswith("12.")
        # The scratch rootfs is gone.
        assert list((tmp_path / "build").iterdir()) == []
    finally:
        with contextlib.suppress(ImageNotFound), image_store_lock(client, exclusive=True):
            client.images.remove(ref, force=True)


def test_cli_image_build_reports_up_to_date(base: BaseBuildResult) -> None:
    from typer.testing import CliRunner

    from orchestrator.cli import app

    result = CliRunner().invoke(app, ["image", "build"])
    assert result.exit_code == 0, result.output
    assert "up to date" in result.output and "skipped" in result.output
    assert base.image_id[:19] in result.output
