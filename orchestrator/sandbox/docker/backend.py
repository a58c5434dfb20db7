"""Docker sandbox backend: one hardened container per sandbox, driven through its exec agent.

Each container runs ``docker-init`` then the exec agent (``agent/exec_agent.py``, bind-mounted
read-only) as root with only SETUID/SETGID/SETPCAP/KILL; the agent runs every command as the
unprivileged user. The host reaches the agent over a Unix socket in a per-sandbox host
directory that is mounted into that sandbox only, so a call costs ~1 ms instead of the
~40 ms of ``docker exec``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import docker
from docker.errors import APIError, DockerException, ImageNotFound, NotFound
from docker.types import DriverConfig, Mount
from requests.exceptions import RequestException

from orchestrator.config import Settings
from orchestrator.docker_client import connect
from orchestrator.observability.logging import get_logger
from orchestrator.sandbox import cgroups, daemon_share, labels
from orchestrator.sandbox.agent import AGENT_CAPABILITIES, AGENT_MODULES, compiled_agent
from orchestrator.sandbox.agent import agent_protocol as protocol
from orchestrator.sandbox.agent import client as agent
from orchestrator.sandbox.agent.agent_processes import RUN_AS
from orchestrator.sandbox.backend import (
    HostHealth,
    ProbeResult,
    ResetReport,
    ResetWay,
    SandboxError,
    SandboxHandle,
    SandboxSpec,
    SandboxUnavailable,
    SandboxUsage,
    SnapshotTaken,
)
from orchestrator.sandbox.docker import containers, kernel_log, states
from orchestrator.sandbox.docker.egress import EgressNetwork, EgressNetworks
from orchestrator.sandbox.docker.run_as import extract_run_as
from orchestrator.sandbox.docker.snapshots import ARCHIVE, LAYER, HostSnapshots, elapsed_ms
from orchestrator.sandbox.docker.workspace import Workspaces
from orchestrator.sandbox.repos import HostRepos, RepoError

log = get_logger(__name__)

# In a sandbox's socket directory: its writable trees packed for a snapshot, or to unpack
# from one; and the mark of a sandbox frozen for a snapshot (its state says paused, and
# it is not: a call waits for it to thaw).
PACKED_NAME = "packed.tar"
FREEZING = "freezing"
PACK_TIMEOUT_S = 120.0
USAGE_SAMPLE_S = 0.2
"""How long a sandbox's CPU use is measured over, for its usage now."""
PING_TIMEOUT_S = 5.0
# How long the agent's scrub (an in-place reset) may take to see the agent's user's last
# process gone; one that outlives it (stuck in the kernel) fails the reset.
SCRUB_TIMEOUT_S = 10.0
INSPECT_EVERY_S = 0.5
# How long a probe whose agent did not answer waits for a dying sandbox to be seen exited.
SANDBOX_ID_HEX = 12
# What a call to the daemon raises when it fails: the SDK's own errors, and those of the
# HTTP library under it when the daemon cannot be reached at all.
DOCKER_FAILURES = (DockerException, RequestException)
# sun_path holds 108 bytes including the terminating NUL.
MAX_UNIX_SOCKET_PATH = 107


class DockerBackend(agent.AgentBackend):
    """Sandboxes as containers on one Docker daemon (this host)."""

    name = "docker"

    def __init__(self, settings: Settings, client: docker.DockerClient | None = None) -> None:
        self.settings = settings
        self.client = client or connect(settings)
        self.host = settings.host_id
        self.sockets_dir = settings.sockets_dir
        longest = len(str(self._socket_path("sbx-" + "0" * SANDBOX_ID_HEX)).encode())
        if longest > MAX_UNIX_SOCKET_PATH:
            raise SandboxError(
                f"state_dir {settings.state_dir} is too long: sandbox sockets would be "
                f"{longest} bytes, over the {MAX_UNIX_SOCKET_PATH}-byte limit of Unix socket "
                "paths; choose a shorter ORCH_STATE_DIR"
            )
        self.sockets_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.workspaces = Workspaces(self.client, settings.state_dir, settings.deployment)
        self.repos = HostRepos.of(settings)
        self.snapshots = HostSnapshots(settings.state_dir, settings.deployment)
        self.egress = EgressNetworks(self.client, settings)
        self._oci_runtimes: dict[str, str] = {}
        # A fresh sandbox's manifest per spec (:func:`spec_key`), taken at the first create
        # of that spec in this process: what a reset sandbox is audited against.
        self._fresh: dict[str, dict[str, Any]] = {}
        # The agent's modules on this host, each bind-mounted into every sandbox (a
        # benchmark points them at another version).
        self.agent_modules = AGENT_MODULES
        self._daemon_cpu: daemon_share.DaemonShare | None = None
        # The base image's run-as on this host (sandbox/docker/run_as.py), looked up at the first
        # create; None after that lookup: sandboxes have only their image's.
        self._run_as: list[Path | None] = []

    def _run_as_mounts(self) -> list[Mount]:
        """run-as from the base image, read-only at the path the agent trusts it at, so a
        sandbox of an image built before it existed has it too (sandbox/docker/run_as.py)."""
        if not self._run_as:
            self._run_as.append(
                extract_run_as(
                    self.client,
                    self.settings.base_image,
                    self.settings.state_dir / "agent",
                    self.settings.deployment,
                )
            )
        found = self._run_as[0]
        return [] if found is None else [Mount(RUN_AS, str(found), type="bind", read_only=True)]

    def _host_mounts_workspace(self, runtime: str) -> bool:
        """Whether the host mounts the sandbox's /workspace itself (workspace.py): as
        configured, but never under gVisor, whose gofer never sees a mount made after the
        sandbox started."""
        return runtime != "runsc" and self.settings.docker_workspace_mount == "host"

    def oci_runtime(self, runtime: str) -> str:
        """The Docker runtime a sandbox of ``runtime`` runs on: runtime 'runc' means a
        container, run by crun when dockerd has it registered (settings.docker_runc_runtime),
        else by runc. Asked of the daemon once per runtime."""
        if runtime != "runc" or self.settings.docker_runc_runtime == "runc":
            return runtime
        if runtime not in self._oci_runtimes:
            wanted = self.settings.docker_runc_runtime
            try:
                registered = self.client.info().get("Runtimes") or {}
            except DOCKER_FAILURES as exc:
                raise states.docker_fault("list runtimes", exc) from exc
            self._oci_runtimes[runtime] = wanted if wanted in registered else "runc"
        return self._oci_runtimes[runtime]

    # -- lifecycle -------------------------------------------------------------------------

    def create(self, spec: SandboxSpec) -> SandboxHandle:
        if spec.runtime == "kata":
            raise SandboxError(
                "runtime 'kata' (a VM per sandbox) needs the Kubernetes backend "
                "(ORCH_SANDBOX_BACKEND=kubernetes); the Docker backend runs runc and runsc"
            )
        sandbox_id = "sbx-" + uuid.uuid4().hex[:SANDBOX_ID_HEX]
        created_at = datetime.now(UTC)
        expires_at = created_at + timedelta(seconds=spec.lifetime_s)
        stamp = labels.sandbox_labels(
            deployment=self.settings.deployment,
            sandbox_id=sandbox_id,
            rollout_id=spec.rollout_id,
            host=self.host,
            runtime=spec.runtime,
            created_at=created_at,
            expires_at=expires_at,
        )
        name = self._resource_name(sandbox_id)
        handle = SandboxHandle(
            sandbox_id=sandbox_id,
            backend=self.name,
            host=self.host,
            runtime=spec.runtime,
            rollout_id=spec.rollout_id,
            image=spec.image,
            native_id=name,
            created_at=created_at,
            expires_at=expires_at,
        )
        bound = log.bind(sandbox_id=sandbox_id, rollout_id=spec.rollout_id, host=self.host)
        socket_dir = self._socket_dir(sandbox_id)
        socket_dir.mkdir(mode=0o700)
        try:
            self._start_container(spec, name, stamp, socket_dir)
            self._wait_for_agent(handle)
            if spec.snapshot is not None:
                self._unpack_snapshot(handle, spec.snapshot)
        except BaseException:
            self.destroy(handle)
            raise
        if states.spec_key(spec) not in self._fresh:
            try:
                fresh = self.manifest(handle)
            except SandboxError as exc:
                # Only a reset needs it: without it, a reset says it cannot compare.
                bound.warning("sandbox.manifest_failed", error=str(exc))
            else:
                if self.workspaces.host_mounted(sandbox_id) and not states.overlay_at_workspace(
                    fresh
                ):
                    self.destroy(handle)
                    raise SandboxError(
                        "the host's mount of /workspace did not reach the sandbox: dockerd "
                        "runs in a mount namespace of its own; set "
                        "ORCH_DOCKER_WORKSPACE_MOUNT=docker"
                    )
                self._fresh[states.spec_key(spec)] = fresh
        bound.info(
            "sandbox.created",
            image=spec.image,
            runtime=spec.runtime,
            ms=round((datetime.now(UTC) - created_at).total_seconds() * 1000, 1),
        )
        return handle

    def _start_container(
        self, spec: SandboxSpec, name: str, stamp: dict[str, str], socket_dir: Path
    ) -> None:
        disk_mb = spec.limits.disk_mb_in(self.settings)
        sandbox_id = stamp[labels.SANDBOX]
        host_mounted = self._host_mounts_workspace(spec.runtime)
        lowers = self._lowers(spec)
        if host_mounted:
            point = self.workspaces.mount_point(lowers, sandbox_id, disk_mb)
            workspace = Mount("/workspace", str(point), type="bind", propagation="rslave")
        else:
            # An overlay of the image's /workspace (see workspace.py): writable though the
            # root filesystem is not, made in constant time, gone with the sandbox.
            options = self.workspaces.volume_options(lowers, sandbox_id, disk_mb)
            workspace = Mount(
                "/workspace",
                name,
                type="volume",
                no_copy=True,
                labels=stamp,
                driver_config=DriverConfig("local", options),
            )
        with contextlib.ExitStack() as held:
            network = None
            if spec.egress is not None:
                if spec.runtime == "runsc":
                    # Registered with --network=none (DESIGN.md); gVisor's own network
                    # stack refuses Docker's namespace on these hosts.
                    raise SandboxError("an egress policy needs runtime runc, not runsc")
                network = held.enter_context(self.egress.attached(spec.egress))
            self._create_and_start(spec, name, stamp, socket_dir, workspace, disk_mb, network)
        if host_mounted:
            # Only now: the container's bind of the mount point exists, and the overlay
            # propagates into it (mounted before, the bind would take the overlay itself,
            # which a reset could not replace). The agent's working directory is the bind,
            # so nothing of the sandbox ever holds the overlay but the agent's user.
            self.workspaces.mount(sandbox_id)

    def _create_and_start(
        self,
        spec: SandboxSpec,
        name: str,
        stamp: dict[str, str],
        socket_dir: Path,
        workspace: Mount,
        disk_mb: int,
        network: EgressNetwork | None,
    ) -> None:
        api = self.client.api
        limits = spec.limits
        memory = f"{limits.memory_mb}m"
        host_config = api.create_host_config(
            # No network, or the egress policy's (sandbox/docker/egress.py): its resolver
            # is the network's own DNS server, which answers only the allowed names.
            network_mode=network.name if network else "none",
            dns=[network.gateway] if network else None,
            cap_drop=["ALL"],
            cap_add=AGENT_CAPABILITIES,
            security_opt=["no-new-privileges"],
            read_only=True,
            tmpfs=containers.tmpfs(spec),
            mem_limit=memory,
            memswap_limit=memory,
            nano_cpus=int(limits.cpus * 1e9),
            pids_limit=containers.host_pids_limit(spec),
            init=True,
            runtime=self.oci_runtime(spec.runtime),
            mounts=[
                Mount(containers.SOCKET_DIR_IN_SANDBOX, str(socket_dir), type="bind"),
                *(
                    Mount(
                        f"{containers.AGENT_DIR_IN_SANDBOX}/{name}.py",
                        str(path),
                        type="bind",
                        read_only=True,
                    )
                    for name, path in self.agent_modules.items()
                ),
                Mount(
                    containers.AGENT_CACHE_IN_SANDBOX,
                    str(compiled_agent(self.agent_modules, self.settings.state_dir / "agent")),
                    type="bind",
                    read_only=True,
                ),
                *self._run_as_mounts(),
                workspace,
            ],
        )
        output_mb = spec.limits.output_mb_in(self.settings)
        command = containers.agent_command(spec, disk_mb=disk_mb, output_mb=output_mb)
        try:
            container = api.create_container(
                spec.image,
                command=command,
                name=name,
                labels=stamp,
                user="0:0",
                working_dir="/workspace",
                host_config=host_config,
                network_disabled=network is None,
            )
            api.start(container["Id"])
        except ImageNotFound as exc:
            raise SandboxError(f"sandbox image {spec.image!r} not found on {self.host}") from exc
        except DOCKER_FAILURES as exc:
            raise states.docker_fault("create sandbox", exc) from exc

    def _wait_for_agent(self, handle: SandboxHandle) -> None:
        deadline = time.monotonic() + self.settings.sandbox_start_timeout_s
        sock = str(self._socket_path(handle.sandbox_id))
        delay = 0.002
        # The socket is polled often, the daemon rarely: in a burst, an inspect per
        # sandbox every few ms floods dockerd with work that only finds a dead start.
        next_inspect = time.monotonic() + INSPECT_EVERY_S
        while True:
            if Path(sock).exists():
                try:
                    agent.call_unix(sock, protocol.ping(), PING_TIMEOUT_S)
                    return
                except SandboxUnavailable:
                    pass
            if time.monotonic() > deadline:
                raise SandboxError(
                    f"exec agent did not start within {self.settings.sandbox_start_timeout_s}"
                    f" s; {self._container_evidence(handle)}"
                )
            if time.monotonic() >= next_inspect:
                next_inspect = time.monotonic() + INSPECT_EVERY_S
                state = self._container_state(handle)
                if state not in ("running", "created"):
                    raise SandboxError(
                        f"sandbox stopped while starting; {self._container_evidence(handle)}"
                    )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def limits_hit(self, handle: SandboxHandle) -> list[str]:
        """From the container's cgroups (OOM kills, the pids limit reached) and its
        /workspace filesystem (less than 1 MiB free), since the container last started: an
        in-place reset does not restart it, but a sandbox with any of these is never
        reset for another rollout, so they are its current rollout's."""
        try:
            container_id = self.client.api.inspect_container(
                self._resource_name(handle.sandbox_id)
            )["Id"]
        except NotFound as exc:
            raise SandboxError(f"sandbox {handle.sandbox_id} is gone") from exc
        except DOCKER_FAILURES as exc:
            raise states.docker_fault("inspect the sandbox", exc) from exc
        hit = []
        if _cgroup_count(
            container_id, "memory", ("memory.oom_control", "memory.events"), "oom_kill"
        ):
            hit.append("memory_limit")
        if _cgroup_count(container_id, "pids", ("pids.events", "pids.events"), "max"):
            hit.append("pids_limit")
        top = self.workspaces.uppers / handle.sandbox_id
        if top.is_mount():
            fs = os.statvfs(top)
            if fs.f_bavail * fs.f_frsize < 1 << 20:
                hit.append("disk_limit")
        return hit

    def usage(self, handle: SandboxHandle) -> SandboxUsage:
        """From the container's cgroups (CPU over :data:`USAGE_SAMPLE_S`, memory) and its
        /workspace filesystem (its own, when capped)."""
        try:
            info = self.client.api.inspect_container(self._resource_name(handle.sandbox_id))
        except NotFound as exc:
            raise SandboxUnavailable(f"sandbox {handle.sandbox_id} is gone") from exc
        except DOCKER_FAILURES as exc:
            raise states.docker_fault("inspect the sandbox", exc) from exc
        container_id, config = info["Id"], info.get("HostConfig") or {}
        cpus = (config.get("NanoCpus") or 0) / 1e9 or float(os.cpu_count() or 1)
        before, started = cgroups.container_cpu_s(container_id), time.monotonic()
        time.sleep(USAGE_SAMPLE_S)
        after, elapsed = cgroups.container_cpu_s(container_id), time.monotonic() - started
        used = 0.0 if before is None or after is None else (after - before) / elapsed
        memory, cache = cgroups.container_memory(container_id)
        disk_used = disk_total = 0
        top = self.workspaces.uppers / handle.sandbox_id
        if top.is_mount():
            fs = os.statvfs(top)
            disk_total = fs.f_blocks * fs.f_frsize
            disk_used = disk_total - fs.f_bfree * fs.f_frsize
        return SandboxUsage(
            at=datetime.now(UTC),
            cpu_count=cpus,
            cpu_used_pct=round(min(100.0, 100 * used / cpus), 2),
            mem_used=memory,
            mem_total=int(config.get("Memory") or 0),
            mem_cache=cache,
            disk_used=disk_used,
            disk_total=disk_total,
        )

    def manifest(self, handle: SandboxHandle) -> dict[str, Any]:
        """The agent's account of everywhere state can persist in the sandbox (processes,
        mounts, writable trees, System V IPC): agent_files.sandbox_manifest."""
        return self._call(handle, protocol.manifest_request(), PING_TIMEOUT_S)

    def reset(self, handle: SandboxHandle, spec: SandboxSpec) -> ResetReport:
        """Make the sandbox as a fresh one of ``spec`` is, then compare its manifest and
        upper layer with a fresh sandbox's.

        Where the host mounts /workspace (runc, crun), in place: the agent kills every
        process of the agent's user and empties every writable place
        (exec_agent.scrub), the host unmounts the overlay, empties its upper layer and
        mounts it again; the container keeps running. Under gVisor, by a restart: the
        container is killed (every process, its init included), its upper layer made
        anew, and it starts again (new tmpfs mounts, /dev/shm and IPC namespace)."""
        started = time.perf_counter()
        fresh = self._fresh.get(states.spec_key(spec))
        if spec.snapshot is not None:
            # Its writable trees were its snapshot's: a scrub would not give them back.
            return ResetReport(clean=False, differences=["made from a snapshot: never reset"])
        if fresh is None:
            return ResetReport(
                clean=False,
                differences=["no fresh sandbox of this spec was made by this process"],
            )
        bound = log.bind(sandbox_id=handle.sandbox_id, rollout_id=handle.rollout_id)
        if self.workspaces.host_mounted(handle.sandbox_id):
            self._scrub(handle, fresh)
            self.workspaces.renew(handle.sandbox_id)
            way = ResetWay.IN_PLACE
        else:
            self._restart(handle, spec)
            way = ResetWay.RESTART
        after = self.manifest(handle)
        written = self.workspaces.upper_entries(handle.sandbox_id)
        differences = states.manifest_differences(fresh, after)
        if written:
            differences.append(f"/workspace upper layer not empty: {written[:10]}")
        canonical = json.dumps({"manifest": after, "upper": written}, sort_keys=True)
        report = ResetReport(
            clean=not differences,
            differences=differences,
            digest=hashlib.sha256(canonical.encode()).hexdigest(),
            ms=round((time.perf_counter() - started) * 1000, 1),
            way=way,
        )
        bound.info(
            "sandbox.reset", clean=report.clean, way=way, ms=report.ms, digest=report.digest[:16]
        )
        if not report.clean:
            bound.warning("sandbox.reset_audit_failed", differences=differences[:20])
        return report

    def _lowers(self, spec: SandboxSpec) -> list[Path]:
        """The lower layers of a new sandbox's /workspace: its snapshot's, the image's, or
        its commit's (materialised on this host first when it is not: sandbox/repos.py)."""
        if spec.snapshot is not None:
            return self.snapshots.lowers(spec.snapshot)
        if spec.workspace is None:
            return [self.workspaces.lower(spec.image)]
        wanted = spec.workspace
        try:
            done = self.repos.materialise(
                wanted.repo, wanted.source, wanted.commit, in_use=self.workspaces.in_use
            )
        except (RepoError, OSError) as exc:
            raise SandboxError(f"cannot bring {wanted.label} up on this host: {exc}") from exc
        return done.lowers

    @contextlib.contextmanager
    def pristine_workspace(self, handle: SandboxHandle) -> Iterator[Path | None]:
        """The sandbox's /workspace as it was made, which no sandbox can change (its
        overlay's lower layers: workspace.py)."""
        with self.workspaces.pristine(handle.sandbox_id) as tree:
            yield tree

    def _scrub(self, handle: SandboxHandle, fresh: dict[str, Any]) -> None:
        """The agent's half of an in-place reset: it ends the agent's user's processes and
        System V IPC, and empties the writable trees, giving their roots back the modes a
        fresh sandbox's have (exec_agent.scrub)."""
        modes = {
            point: entries[0][2]
            for point, entries in fresh.get("trees", {}).items()
            if entries and entries[0][0] == "."
        }
        request = protocol.scrub_request(modes, SCRUB_TIMEOUT_S)
        done = self._call(handle, request, SCRUB_TIMEOUT_S + PING_TIMEOUT_S)
        if done.get("processes"):
            raise SandboxError(
                f"processes of the agent's user outlived the scrub: {done['processes'][:5]}"
            )
        if "error" in done:
            raise SandboxError(f"the scrub failed: {done['error']}")

    def _restart(self, handle: SandboxHandle, spec: SandboxSpec) -> None:
        """The restart half of a reset (see :meth:`reset`)."""
        name = self._resource_name(handle.sandbox_id)
        api = self.client.api
        self._unpause(name)
        try:
            api.kill(name)
            api.wait(name, timeout=int(self.settings.sandbox_start_timeout_s))
        except NotFound as exc:
            raise SandboxError(f"sandbox {handle.sandbox_id} is gone") from exc
        except APIError as exc:
            if "is not running" not in str(exc):
                raise states.docker_fault("stop the sandbox for its reset", exc) from exc
        except DOCKER_FAILURES as exc:
            raise states.docker_fault("stop the sandbox for its reset", exc) from exc
        self.workspaces.remake(handle.sandbox_id, spec.limits.disk_mb_in(self.settings))
        self._socket_path(handle.sandbox_id).unlink(missing_ok=True)
        try:
            api.start(name)
        except DOCKER_FAILURES as exc:
            raise states.docker_fault("start the reset sandbox", exc) from exc
        self._wait_for_agent(handle)

    # -- snapshots (sandbox/docker/snapshots.py) --------------------------------------------------

    def snapshot(self, handle: SandboxHandle, snapshot_id: str) -> SnapshotTaken:
        """The sandbox's writable trees packed by its agent, then its /workspace upper
        layer copied while the container is frozen (Docker's pause: the cgroup freezer, or
        gVisor's), so no command's half-written file is kept; the sandbox runs on. A
        sandbox made from a snapshot: that snapshot's layer is copied first (before the
        freeze: nothing writes it), and the upper layer onto it (one layer: snapshots.py)."""
        started = time.perf_counter()
        sandbox_id = handle.sandbox_id
        lowers = self.workspaces.lowers_of(sandbox_id)
        below = [layer for layer in lowers if self.snapshots.owns(layer)]
        lowers = [layer for layer in lowers if not self.snapshots.owns(layer)]
        self.snapshots.check_room(lowers, snapshot_id, self.snapshots.root)
        socket_dir = self._socket_dir(sandbox_id)
        with self.snapshots.making(snapshot_id) as partial:
            (partial / LAYER).mkdir()
            for layer in reversed(below):  # oldest first (there is one, but for older ones)
                self.snapshots.copy_layer(layer, partial / LAYER)
            packed = self._call(
                handle,
                protocol.pack_request(f"{containers.SOCKET_DIR_IN_SANDBOX}/{PACKED_NAME}"),
                PACK_TIMEOUT_S,
            )
            shutil.move(socket_dir / PACKED_NAME, partial / ARCHIVE)
            name = self._resource_name(sandbox_id)
            frozen = time.perf_counter()
            mark = socket_dir / FREEZING
            mark.touch()
            try:
                self.client.api.pause(name)
                try:
                    self.snapshots.copy_layer(self.workspaces.upper(sandbox_id), partial / LAYER)
                finally:
                    self.client.api.unpause(name)
            except NotFound as exc:
                raise SandboxUnavailable(f"sandbox {sandbox_id} is gone") from exc
            except DOCKER_FAILURES as exc:
                raise states.docker_fault("freeze the sandbox for its snapshot", exc) from exc
            finally:
                mark.unlink(missing_ok=True)
            paused_ms = elapsed_ms(frozen)
            files, size = self.snapshots.measure(partial / LAYER)
            taken = SnapshotTaken(
                snapshot_id=snapshot_id,
                host=self.host,
                files=files,
                bytes=size + int(packed.get("bytes", 0)),
                ms=elapsed_ms(started),
                paused_ms=paused_ms,
                skipped=[str(p) for p in packed.get("skipped", [])],
            )
            self.snapshots.commit(partial, snapshot_id, lowers, taken)
        log.info(
            "sandbox.snapshot",
            sandbox_id=sandbox_id,
            rollout_id=handle.rollout_id,
            snapshot_id=snapshot_id,
            files=files,
            bytes=taken.bytes,
            ms=taken.ms,
            paused_ms=taken.paused_ms,
        )
        return taken

    def _unpack_snapshot(self, handle: SandboxHandle, snapshot_id: str) -> None:
        """Give a sandbox made from a snapshot its parent's writable trees (its /workspace
        is the snapshot's already: its lower layers)."""
        archive = self.snapshots.archive(snapshot_id)
        inside = self._socket_dir(handle.sandbox_id) / PACKED_NAME
        try:
            os.link(archive, inside)
        except OSError:
            shutil.copyfile(archive, inside)  # (the socket directories on another filesystem)
        try:
            done = self._call(
                handle,
                protocol.unpack_request(f"{containers.SOCKET_DIR_IN_SANDBOX}/{PACKED_NAME}"),
                PACK_TIMEOUT_S,
            )
        finally:
            inside.unlink(missing_ok=True)
        if "error" in done:
            raise SandboxError(f"cannot restore snapshot {snapshot_id}: {done['error']}")

    def drop_snapshot(self, snapshot_id: str) -> bool:
        return self.snapshots.remove(snapshot_id, self.workspaces.in_use())

    def sweep_snapshots(self, keep: set[str]) -> int:
        settled = time.time() - self.settings.sandbox_start_timeout_s * 2
        return self.snapshots.sweep(keep, self.workspaces.in_use(), settled)

    def destroy(self, handle: SandboxHandle) -> None:
        self._destroy_by_id(handle.sandbox_id)
        log.info("sandbox.destroyed", sandbox_id=handle.sandbox_id, rollout_id=handle.rollout_id)

    def _destroy_by_id(self, sandbox_id: str) -> None:
        name = self._resource_name(sandbox_id)
        self._unpause(name)
        try:
            self.client.api.remove_container(name, force=True, v=True)
        except NotFound:
            pass
        except APIError as exc:
            # A removal already in progress is as good as done.
            if "already in progress" not in str(exc):
                raise states.docker_fault("remove sandbox", exc) from exc
        except DOCKER_FAILURES as exc:
            raise states.docker_fault("remove sandbox", exc) from exc
        if not self.workspaces.host_mounted(sandbox_id):
            try:
                self.client.api.remove_volume(name, force=True)
            except NotFound:
                pass
            except DOCKER_FAILURES as exc:
                raise states.docker_fault("remove sandbox volume", exc) from exc
        shutil.rmtree(self._socket_dir(sandbox_id), ignore_errors=True)
        self.workspaces.remove(sandbox_id)

    def _unpause(self, name: str) -> None:
        """Thaw a paused container before removing it: gVisor ignores the kill of a frozen
        sandbox, and its removal then waits out Docker's 10 s stop timeout."""
        try:
            if self.client.api.inspect_container(name).get("State", {}).get("Paused"):
                self.client.api.unpause(name)
        except DOCKER_FAILURES:
            pass  # gone already, or the removal below reports what is wrong

    # -- commands --------------------------------------------------------------------------

    def _call(
        self,
        handle: SandboxHandle,
        request: dict[str, Any],
        timeout_s: float,
        on_chunk: agent.OnChunk | None = None,
    ) -> dict[str, Any]:
        if handle.host != self.host:
            raise SandboxUnavailable(
                f"sandbox {handle.sandbox_id} lives on {handle.host}, not on {self.host}"
            )
        try:
            return agent.call_unix(
                str(self._socket_path(handle.sandbox_id)),
                request,
                timeout_s,
                watch=lambda: self._why_not_answering(handle),
                on_chunk=on_chunk,
            )
        except SandboxUnavailable as exc:
            # Only on failure, so calls never pay for it: say what state the sandbox is in
            # (a paused one accepts connections and never answers).
            raise type(exc)(f"{exc}; {self._state_evidence(handle)}") from exc

    def _why_not_answering(self, handle: SandboxHandle) -> str | None:
        """For a slow reply: the sandbox's state when it cannot answer at all."""
        try:
            state = self._container_state(handle)
        except SandboxError:
            return None  # the daemon is slow too: keep waiting for the agent
        return None if state == "running" else f"sandbox state: {state}"

    def _state_evidence(self, handle: SandboxHandle) -> str:
        try:
            return f"sandbox state: {self._container_state(handle)}"
        except SandboxError as exc:
            return f"sandbox state unknown: {exc}"

    # -- health ----------------------------------------------------------------------------

    def probe(self, handle: SandboxHandle) -> ProbeResult:
        """A trivial command through the agent; the container's state from the daemon only
        when the agent does not answer.

        Says ``agent_caused`` when the agent broke the sandbox itself: the whole sandbox
        OOM-killed (under gVisor the sandbox's memory limit kills the whole sandbox), or
        no command can start because the agent's processes fill the pids limit. A paused,
        killed or vanished sandbox, or an agent that does not answer, is ours.

        The agent first, because an agent that answers runs (a paused sandbox accepts a
        connection and never answers; the watch asks the daemon after WATCH_FIRST_S), and
        a healthy sandbox's probe then needs no daemon at all. A daemon held to a small CPU
        share (docs/operations.md, "The Docker daemons' CPU weight") on a host saturated by
        other work answers slowly; a probe that asked it first, and asked it again between
        the agent's retries, spent its budget waiting on the daemon."""
        probed = self._probe_agent(handle, "running")
        if probed is not None:
            return probed
        info = self._inspect(handle)
        if self._state_of(handle, info) != "running":
            return self._stopped_probe(handle, info, states.state_name(info))
        # A sandbox being killed (its memory limit under gVisor) drops the agent's
        # connection a moment before Docker sees it exit: wait for that moment, so the
        # evidence is the exit and its cause rather than "running but not answering".
        info = self._settled(handle)
        if states.state_name(info) not in ("running", "paused"):
            return self._stopped_probe(handle, info, states.state_name(info))
        return ProbeResult(
            alive=states.state_name(info) == "running",
            state=states.state_name(info),
            agent_ok=False,
            detail=f"the exec agent is gone or silent: {self._state_evidence(handle)}",
        )

    def _still_running(self, handle: SandboxHandle) -> bool:
        try:
            return self._container_state(handle) == "running"
        except SandboxError:
            return True  # the daemon fails or is slow too: keep asking the agent, in budget

    def _stopped_probe(
        self, handle: SandboxHandle, info: dict[str, Any] | None, state: str
    ) -> ProbeResult:
        raw = (info or {}).get("State", {})
        stopped = state in ("exited", "dead")
        exit_code = raw.get("ExitCode") if stopped else None
        oom_killed = bool(raw.get("OOMKilled"))
        killed = stopped and exit_code == 128 + signal.SIGKILL
        # Docker sets OOMKilled on any OOM kill in the container, even one of a single
        # command that the sandbox survived; SIGKILL as the exit status says the OOM
        # killer took the whole sandbox. Under gVisor the kernel may pick the gofer instead
        # of the sentry (an `exe` of uid 65534 and oom_score_adj 0 in the kernel's log, not
        # the sentry's 1): the sandbox then exits 2, not 137, dead of the same OOM (seen
        # once in a fresh-clone run's test_whole_sandbox_oom_is_the_agents_doing[runsc]).
        gvisor_died = handle.runtime == "runsc" and stopped and exit_code not in (0, None)
        kernel_says = ""
        if (killed or gvisor_died) and not oom_killed:
            # Docker's flag can miss an OOM kill that the kernel logged (kernel_log.py), for
            # a gVisor sandbox that exited 2 as for one that exited 137.
            oom_killed = bool(kernel_log.memcg_oom_killed(str((info or {}).get("Id", ""))))
            kernel_says = " (the kernel's log)" if oom_killed else ""
        whole_oom = oom_killed and (killed or gvisor_died)
        detail = f"state={state}"
        if stopped:
            detail += (
                f" exit={exit_code} oom_killed={oom_killed}{kernel_says} error={raw.get('Error')!r}"
            )
        return ProbeResult(
            alive=False,
            state=state,
            agent_ok=False,
            detail=detail,
            exit_code=exit_code if isinstance(exit_code, int) else None,
            oom_killed=oom_killed,
            agent_caused="memory_limit" if whole_oom else None,
        )

    def _settled(self, handle: SandboxHandle) -> dict[str, Any] | None:
        """The container's inspect data once it stops, or as it is after PROBE_SETTLE_S."""
        deadline = time.monotonic() + agent.PROBE_SETTLE_S
        while True:
            info = self._inspect(handle)
            if states.state_name(info) != "running" or time.monotonic() >= deadline:
                return info
            time.sleep(0.1)

    def _inspect(self, handle: SandboxHandle) -> dict[str, Any] | None:
        """The container's inspect data, or None when it is gone."""
        try:
            info: dict[str, Any] = self.client.api.inspect_container(handle.native_id)
        except NotFound:
            return None
        except DOCKER_FAILURES as exc:
            raise states.docker_fault("inspect sandbox", exc) from exc
        return info

    def _container_state(self, handle: SandboxHandle) -> str:
        return self._state_of(handle, self._inspect(handle))

    def _state_of(self, handle: SandboxHandle, info: dict[str, Any] | None) -> str:
        """The container's state, a freeze for a snapshot (:meth:`snapshot`) not counted:
        it thaws in a moment."""
        state = states.state_name(info)
        if state == "paused" and (self._socket_dir(handle.sandbox_id) / FREEZING).exists():
            return "running"
        return state

    def host_health(self) -> HostHealth:
        """This host's health for the worker's heartbeat: the daemon's ping time, free
        space where sandboxes' workspaces live, and how many sandboxes it holds. Never
        raises: a failure is reported in ``error``."""
        try:
            disk_free = _free_bytes(self.settings.state_dir)
        except OSError as exc:
            return HostHealth(
                backend_ok=False, disk_free_bytes=0, sandboxes=0, error=f"statvfs: {exc}"
            )
        started = time.monotonic()
        try:
            self.client.ping()
            ping_ms = round((time.monotonic() - started) * 1000, 2)
            sandboxes = len(self.list_owned())
        except (*DOCKER_FAILURES, SandboxError) as exc:
            return HostHealth(
                backend_ok=False, disk_free_bytes=disk_free, sandboxes=0, error=str(exc)[:500]
            )
        return HostHealth(
            backend_ok=True,
            backend_ping_ms=ping_ms,
            disk_free_bytes=disk_free,
            sandboxes=sandboxes,
            daemon_cpu=self._bound_daemons(),
        )

    def _bound_daemons(self) -> daemon_share.DaemonShare | None:
        """Keep the local daemons at ``docker_daemon_cpu_weight`` (sandbox/daemon_share.py),
        checked at every heartbeat. A daemon behind TCP (no Unix socket) is another
        host's: left alone."""
        weight = self.settings.docker_daemon_cpu_weight
        adapter = self.client.api.get_adapter(self.client.api.base_url)
        socket_path = getattr(adapter, "socket_path", None)
        if weight == 0 or socket_path is None:
            return None
        share = self._daemon_cpu
        if share is not None and share.enforced and share.daemons_alive():
            return share
        # Not placed yet, a daemon restarted, or placing failed (tried again every beat:
        # a peer lookup and a few /proc reads; logged when the outcome changes).
        placed = daemon_share.bound_daemons(weight, Path(socket_path))
        if placed != share:
            level = log.info if placed.enforced else log.warning
            level("host.daemon_cpu", **placed.model_dump())
        self._daemon_cpu = placed
        return placed

    def _container_evidence(self, handle: SandboxHandle) -> str:
        try:
            info = self.client.api.inspect_container(handle.native_id)
            logs = self.client.api.logs(handle.native_id, tail=20).decode(errors="replace")
        except DOCKER_FAILURES as exc:
            return f"no evidence: {exc}"
        state = info.get("State", {})
        return (
            f"state={state.get('Status')} exit={state.get('ExitCode')} "
            f"oom_killed={state.get('OOMKilled')} error={state.get('Error')!r} "
            f"logs={logs.strip()[-1000:]!r}"
        )

    # -- ownership -------------------------------------------------------------------------

    def list_owned(self) -> list[SandboxHandle]:
        try:
            containers = self.client.api.containers(
                all=True, filters={"label": labels.deployment_filter(self.settings.deployment)}
            )
        except DOCKER_FAILURES as exc:
            raise states.docker_fault("list sandboxes", exc) from exc
        return [self._handle_from_labels(c) for c in containers]

    def _handle_from_labels(self, container: dict[str, Any]) -> SandboxHandle:
        stamp: dict[str, str] = container.get("Labels") or {}
        return SandboxHandle(
            sandbox_id=stamp.get(labels.SANDBOX, ""),
            backend=self.name,
            host=stamp.get(labels.HOST, self.host),
            runtime="runsc" if stamp.get(labels.RUNTIME) == "runsc" else "runc",
            rollout_id=stamp.get(labels.ROLLOUT, ""),
            image=str(container.get("Image", "")),
            native_id=str(container.get("Names", [""])[0]).lstrip("/"),
            created_at=labels.parse_time(stamp.get(labels.CREATED)),
            expires_at=labels.parse_time(stamp.get(labels.EXPIRES)),
        )

    def sweep_leftovers(self, *, everything: bool = False) -> int:
        """Remove volumes and socket directories whose sandbox container is gone (left by a
        crash between creating and removing them), and egress networks no sandbox is on
        (idle for settings.egress_network_idle_s; with ``everything``, at once). Returns
        how many were removed."""
        live = {h.sandbox_id for h in self.list_owned()}
        removed = 0
        # A volume, socket directory or workspace layer is made just before its container:
        # a young one may belong to a sandbox being created right now.
        settled = time.time() - self.settings.sandbox_start_timeout_s * 2
        try:
            volumes = (
                self.client.api.volumes(
                    filters={"label": labels.deployment_filter(self.settings.deployment)}
                ).get("Volumes")
                or []
            )
        except DOCKER_FAILURES as exc:
            raise states.docker_fault("list volumes", exc) from exc
        for volume in volumes:
            volume_labels = volume.get("Labels") or {}
            sandbox_id = volume_labels.get(labels.SANDBOX, "")
            created = labels.parse_time(volume_labels.get(labels.CREATED)).timestamp()
            if sandbox_id not in live and created < settled:
                try:
                    self.client.api.remove_volume(volume["Name"], force=True)
                    removed += 1
                except NotFound:
                    pass
                except APIError as exc:
                    log.warning(
                        "sandbox.sweep_volume_failed", volume=volume["Name"], error=str(exc)
                    )
        for entry in self.sockets_dir.iterdir():
            if (
                entry.name.startswith("sbx-")
                and entry.name not in live
                and entry.is_dir()
                and entry.stat().st_mtime < settled
            ):
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
        removed += self.workspaces.sweep_uppers(live, settled)
        removed += self.egress.prune(
            idle_s=0 if everything else self.settings.egress_network_idle_s
        )
        return removed + self.workspaces.sweep_layers()

    # -- naming ----------------------------------------------------------------------------

    def _resource_name(self, sandbox_id: str) -> str:
        return f"orch-{self.settings.deployment}-{sandbox_id}"

    def _socket_dir(self, sandbox_id: str) -> Path:
        return self.sockets_dir / sandbox_id

    def _socket_path(self, sandbox_id: str) -> Path:
        return self._socket_dir(sandbox_id) / containers.SOCKET_NAME


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _cgroup_count(container_id: str, controller: str, files: tuple[str, str], key: str) -> int:
    """A counter (``key N`` lines) of the container's cgroup (v1 file, v2 file); 0 when
    it has no such file (a runtime that keeps no such cgroup)."""
    path = cgroups.container_file(controller, container_id, *files)
    try:
        lines = path.read_text().splitlines() if path else []
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0
