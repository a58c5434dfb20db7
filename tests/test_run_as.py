"""run-as (sandbox_images/base/run-as/run_as.c), the setuid helper the exec agent starts
every command through, and the agent's use of it (agent_processes.spawn_as, trusted_run_as).

In the real base image, in a container with a sandbox's capabilities and
no-new-privileges, on runc and gVisor: a command started through it has the user's ids, no
supplementary group, no capability in any set, / as its directory and only its three
standard streams; a failed switch or exec reaches the agent as the OSError a failed Popen
raised; the agent refuses a helper its user could replace and then forks, as before.
"""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from orchestrator.config import Runtime
from orchestrator.images.base import image_store_lock, run_build
from orchestrator.sandbox.agent import AGENT_CAPABILITIES, EXEC_AGENT_PATH
from orchestrator.sandbox.agent.agent_processes import RUN_AS, trusted_run_as
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.sandbox.docker.run_as import extract_run_as

# Runs inside the container as root: what the agent does at its start (the inheritable
# set, then the bounding set emptied), then commands through run-as. Prints one JSON line.
IN_SANDBOX = r"""
import errno, json, os, sys
sys.path.insert(0, "/opt/agent")
import agent_processes as ea
run_as = ea.trusted_run_as(ea.RUN_AS)
ea.keep_inheritable()
ea.drop_bounding_set()
probe = (
    "grep -E '^(Uid|Gid|Groups|CapInh|CapPrm|CapEff|CapAmb|NoNewPrivs|SigIgn):' /proc/self/status;"
    " echo cwd=$(pwd); " + sys.argv[1]
)
child = ea.spawn_as(run_as, 1000, 1000, ["/bin/bash", "-c", probe], {"PATH": "/usr/bin:/bin"})
out = child.stdout.read().decode()
err = child.stderr.read().decode()
code = child.wait()
failures = {}
for name, uid, argv in [
    ("missing", 1000, ["/nonexistent"]),
    ("root", 0, ["/bin/true"]),
    ("directory", 1000, ["/tmp"]),
]:
    try:
        ea.spawn_as(run_as, uid, 1000, argv, {}).wait()
        failures[name] = None
    except OSError as exc:
        failures[name] = errno.errorcode.get(exc.errno, exc.errno)
print(json.dumps({"run_as": run_as, "out": out, "err": err, "code": code, "failures": failures}))
"""


# The shell's descriptors, listed by the shell itself: a glob (old gVisor cannot stat
# /proc/self/fd for ls) in the shell's own process, so the list holds 0-2 and the glob's
# directory handle (3), the lowest free number: any descriptor of the agent's that run-as let
# through would take 3 and push the handle to 4. Listing it from a command substitution,
# as `$(cd /proc/$$/fd && echo *)` did, reads the *parent* shell's table while the parent
# may still hold the write end of that substitution's pipe: 0-4 in a third of runs on a
# loaded host (test_the_descriptor_listing_is_deterministic).
LIST_FDS = 'cd /proc/self/fd && fds=(*) && echo "fds=${fds[*]}"'


@pytest.fixture(scope="module")
def docker_client() -> Iterator[docker.DockerClient]:
    client = docker.from_env()
    yield client
    client.close()


def _in_sandbox(
    client: docker.DockerClient, backend: DockerBackend, image: str, runtime: Runtime
) -> dict[str, Any]:
    output = client.containers.run(
        image,
        ["python3", "-I", "-c", IN_SANDBOX, LIST_FDS],
        runtime=backend.oci_runtime(runtime),
        cap_drop=["ALL"],
        cap_add=AGENT_CAPABILITIES,
        security_opt=["no-new-privileges"],
        network_mode="none",
        volumes={str(EXEC_AGENT_PATH.parent): {"bind": "/opt/agent", "mode": "ro"}},
        remove=True,
        stdout=True,
        stderr=True,
    )
    lines = output.decode().strip().splitlines()
    return dict(json.loads(lines[-1]))


def test_a_command_through_run_as_is_the_user_with_nothing_else(
    docker_client: docker.DockerClient, backend: DockerBackend, base_image: str, runtime: Runtime
) -> None:
    seen = _in_sandbox(docker_client, backend, base_image, runtime)
    assert seen["run_as"] == RUN_AS, "the base image's run-as must be trusted"
    assert seen["code"] == 0, seen
    status = dict(
        line.split(":", 1) for line in seen["out"].splitlines() if ":" in line and "=" not in line
    )
    status = {key: value.split() for key, value in status.items()}
    assert status["Uid"] == ["1000"] * 4 and status["Gid"] == ["1000"] * 4, status
    assert status["Groups"] == [], status
    for cap in ("CapInh", "CapPrm", "CapEff", "CapAmb"):  # gVisor shows no CapAmb
        assert int(status.get(cap, ["0"])[0], 16) == 0, (cap, status[cap])
    if "NoNewPrivs" in status:
        assert status["NoNewPrivs"] == ["1"]
    # SIGPIPE (13) and SIGXFSZ (25), which Python ignores, are back to their defaults
    # (gVisor's status shows no SigIgn: runc's run says it).
    ignored = int(status.get("SigIgn", ["0"])[0], 16)
    assert not ignored & (1 << 12) and not ignored & (1 << 24), status["SigIgn"]
    assert "cwd=/\n" in seen["out"]
    fds = seen["out"].split("fds=", 1)[1].split()
    # The shell's own 0-2 and the listing's directory handle (LIST_FDS): nothing of the agent's.
    assert fds == ["0", "1", "2", "3"], fds


def _fd_listings(client: docker.DockerClient, image: str, listing: str, runs: int) -> set[str]:
    """What ``listing`` printed in ``runs`` fresh shells in one container, with every
    other core kept busy (the race it guards against needs the parent shell descheduled)."""
    script = (
        "hogs=(); for _ in $(seq $(nproc)); do (while :; do :; done) & hogs+=($!); done; "
        f"for _ in $(seq {runs}); do bash -c {shlex.quote(listing)}; done | sort -u; "
        'kill "${hogs[@]}"'
    )
    output = client.containers.run(
        image, ["bash", "-c", script], network_mode="none", remove=True, stdout=True
    )
    return set(output.decode().split("\n")) - {""}


def test_the_descriptor_listing_is_deterministic(
    docker_client: docker.DockerClient, base_image: str
) -> None:
    """The listing the test above trusts gives one answer, run after run, under load. The
    one it replaced (a substitution reading its parent's table) fails this: 0-4 in 1,064
    of 3,000 runs while a build loaded the host."""
    assert _fd_listings(docker_client, base_image, LIST_FDS, 500) == {"fds=0 1 2 3"}


def test_a_failed_switch_or_exec_is_the_oserror_popen_raised(
    docker_client: docker.DockerClient, backend: DockerBackend, base_image: str, runtime: Runtime
) -> None:
    seen = _in_sandbox(docker_client, backend, base_image, runtime)
    assert seen["failures"] == {"missing": "ENOENT", "root": "EINVAL", "directory": "EACCES"}


def _helper(tmp_path: Path, *, dir_mode: int = 0o755, file_mode: int = 0o755) -> str:
    directory = tmp_path / "bin"
    directory.mkdir()
    helper = directory / "run-as"
    helper.write_bytes(b"\x7fELF")
    helper.chmod(file_mode)
    directory.chmod(dir_mode)
    return str(helper)


@pytest.fixture()
def root_tmp() -> Iterator[Path]:
    """A directory whose whole chain is root's and written by nobody else: under /run (a
    sticky, world-writable /tmp is what trusted_run_as refuses)."""
    if os.geteuid() != 0:
        pytest.skip("the ownership checks need root (CI runs as root)")
    run = Path("/run")
    if run.stat().st_uid != 0 or run.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        pytest.skip("/run is not root's alone here")
    directory = Path(tempfile.mkdtemp(prefix="orch-run-as-", dir=run))
    directory.chmod(0o755)
    yield directory
    shutil.rmtree(directory)


def test_a_helper_only_root_can_replace_is_trusted(root_tmp: Path) -> None:
    assert trusted_run_as(_helper(root_tmp)) == str(root_tmp / "bin" / "run-as")


@pytest.mark.parametrize(
    "unsafe",
    ["group_writable", "world_writable_dir", "not_roots", "symlink", "not_executable", "relative"],
)
def test_a_helper_its_user_could_replace_is_refused(root_tmp: Path, unsafe: str) -> None:
    if unsafe == "group_writable":
        path = _helper(root_tmp, file_mode=0o775)
    elif unsafe == "world_writable_dir":
        path = _helper(root_tmp, dir_mode=0o777)
    elif unsafe == "not_roots":
        path = _helper(root_tmp)
        os.chown(path, 1000, 1000)
    elif unsafe == "symlink":
        target = _helper(root_tmp)
        path = str(root_tmp / "link")
        os.symlink(target, path)
    elif unsafe == "not_executable":
        path = _helper(root_tmp, file_mode=0o644)
    else:
        path = os.path.relpath(_helper(root_tmp))
    assert trusted_run_as(path) is None


def test_no_helper_is_no_helper(tmp_path: Path) -> None:
    assert trusted_run_as(str(tmp_path / "absent")) is None
    assert trusted_run_as("") is None


@pytest.fixture(scope="module")
def image_without_run_as(docker_client: docker.DockerClient, base_image: str) -> Iterator[str]:
    """An image built from the base image before run-as existed, as it were: a codebase
    image is not rebuilt when the base image changes."""
    tag = f"orchestrator/test-no-run-as:{uuid.uuid4().hex[:8]}"
    dockerfile = f"FROM {base_image}\nRUN rm -r /opt/orchestrator/bin\n".encode()
    # Through the product's build and the image store's lock, as every build and removal
    # on this daemon (images/base.image_store_lock).
    run_build(
        docker_client,
        progress=lambda _line: None,
        what=tag,
        fileobj=io.BytesIO(dockerfile),
        tag=tag,
    )
    yield tag
    with image_store_lock(docker_client, exclusive=True):
        docker_client.images.remove(tag, force=True)


def test_a_sandbox_of_an_image_without_run_as_gets_the_base_images(
    make_sandbox: Any,
    docker_client: docker.DockerClient,
    backend: DockerBackend,
    image_without_run_as: str,
    runtime: Runtime,
) -> None:
    handle = make_sandbox(image=image_without_run_as, runtime=runtime)
    logs = docker_client.containers.get(handle.native_id).logs().decode()
    assert f"through {RUN_AS}" in logs, logs
    result = backend.exec(handle, "id -u; id -G", timeout_s=10, output_budget_bytes=4096)
    assert result.stdout.head == "1000\n1000\n", result


def test_run_as_once_published_is_never_replaced(
    docker_client: docker.DockerClient, base_image: str, tmp_path: Path
) -> None:
    """The first creations of a fresh state_dir extract run-as at once, while sandboxes
    already mount the first copy: a later copy must not replace it (runc refused a mount
    whose source changed under it: "mount ... run-as ...: no such file or directory", a
    sandbox of tests/e2e/test_overloaded_host.py's loaded burst). Eight threads; the file
    the first one published keeps its inode."""
    import threading

    cache = tmp_path / "agent"
    first = extract_run_as(docker_client, base_image, cache, "t")
    assert first is not None
    first.unlink()  # a fresh state_dir again
    start = threading.Barrier(8)
    seen: list[int] = []

    def extract() -> None:
        start.wait()
        found = extract_run_as(docker_client, base_image, cache, "t")
        assert found is not None
        seen.append(found.stat().st_ino)

    threads = [threading.Thread(target=extract) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 8
    assert len(set(seen)) == 1, "a later extraction replaced the file sandboxes mount"
    assert [p.name for p in cache.iterdir()] == [first.name], "no partial file left"
