"""run-as on the host: the setuid helper the exec agent starts commands through
(sandbox_images/base/run-as/run_as.c), taken out of the base image once and bind-mounted
read-only into every Docker sandbox at the path the agent looks for it.

Why a mount and not only the image: a codebase image (or an environment's own image) is
built once, from whatever base image was current then, and is not rebuilt when the base
changes: an upgrade would leave its sandboxes without run-as, their commands forked from
the agent (seen: the benchmark's codebase image, built before run-as existed, measured the
agent's `true` at 4.3 ms instead of 2.8). Mounted, every sandbox on the host has the base
image's run-as, whatever its image. The binary is static and uses no libc, so it runs in
any image of the host's architecture. A Kubernetes pod has only its image's (a base image
of this release has one); without one the agent forks, as before.
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
import uuid
from pathlib import Path

from docker import DockerClient
from docker.errors import DockerException
from requests.exceptions import RequestException

from orchestrator.observability.logging import get_logger
from orchestrator.sandbox import labels
from orchestrator.sandbox.agent import publish
from orchestrator.sandbox.agent.agent_processes import RUN_AS

log = get_logger(__name__)


def extract_run_as(
    client: DockerClient, image: str, cache_root: Path, deployment: str
) -> Path | None:
    """``image``'s run-as as a file of this host (root's, 0755), made once per image id
    under ``cache_root``; None when the image has none (an older base image) or cannot be
    read, and the agent then forks as it always did."""
    if os.geteuid() != 0:
        # The agent trusts only a run-as root owns, and a file this process makes would
        # be its own: the image's is used (or none).
        return None
    try:
        image_id = str(client.images.get(image).id).removeprefix("sha256:")
    except (DockerException, RequestException) as exc:
        log.warning("sandbox.run_as_unavailable", image=image, error=str(exc))
        return None
    target = cache_root / f"run-as-{image_id[:16]}"
    if target.exists():
        return target
    stamp = {
        labels.MANAGED: "true",
        labels.DEPLOYMENT: deployment,
        labels.SANDBOX: "extract-" + uuid.uuid4().hex[:8],
    }
    try:
        container = client.api.create_container(
            image, command=["true"], labels=stamp, network_disabled=True
        )
        try:
            stream, _ = client.api.get_archive(container["Id"], RUN_AS)
            archive = io.BytesIO(b"".join(stream))
        finally:
            client.api.remove_container(container["Id"], force=True)
    except (DockerException, RequestException) as exc:
        log.warning("sandbox.run_as_unavailable", image=image, error=str(exc))
        return None
    with tarfile.open(fileobj=archive) as tar:
        member = tar.getmember(Path(RUN_AS).name)
        source = tar.extractfile(member) if member.isfile() else None
        if source is None:
            log.warning("sandbox.run_as_unavailable", image=image, error="not a regular file")
            return None
        data = source.read()
    cache_root.mkdir(parents=True, exist_ok=True)
    # Written whole under another name, then linked in: a sandbox never mounts half a
    # file, nor one replaced while it mounts it (sandbox/agent.publish).
    fd, name = tempfile.mkstemp(dir=cache_root, prefix=".run-as-")
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    partial = Path(name)
    # Executable by all, written by root alone: what the agent's trust check asks.
    partial.chmod(0o755)
    publish(partial, target)
    return target
