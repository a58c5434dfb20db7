"""The sandbox backend interface: what every backend (Docker, Kubernetes) provides.

Backends know nothing about rollouts' rewards or HTTP; they create isolated sandboxes, run
commands in them through the in-sandbox exec agent, and destroy them. Errors they raise say
whose fault a failure is: :class:`SandboxError` and its subclasses are infrastructure faults,
:class:`FileError` is the agent's own mistake.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from orchestrator.config import Runtime, Settings
from orchestrator.sandbox.daemon_share import DaemonShare
from orchestrator.sandbox.egress import EgressPolicy
from orchestrator.secrets import SecretSource


class SandboxLimits(BaseModel):
    """Hard resource limits of one sandbox."""

    model_config = ConfigDict(frozen=True)

    memory_mb: int = Field(1024, ge=64)
    cpus: float = Field(1.0, gt=0)
    pids: int = Field(256, ge=16)
    tmp_mb: int = Field(256, ge=1)
    disk_mb: int | None = Field(
        None,
        ge=0,
        description="Cap on what the sandbox may write under /workspace, in MB; 0 means "
        "uncapped; None takes the deployment's sandbox_disk_mb.",
    )
    output_mb: int | None = Field(
        None,
        ge=1,
        description="A command producing more output than this (stdout and stderr together, "
        "in MB) is killed; None takes the deployment's sandbox_output_mb.",
    )

    def disk_mb_in(self, settings: Settings) -> int:
        """The disk cap in force: this sandbox's own, else the deployment's."""
        return settings.sandbox_disk_mb if self.disk_mb is None else self.disk_mb

    def output_mb_in(self, settings: Settings) -> int:
        """The output past which a command is killed: this sandbox's own, else the
        deployment's."""
        return settings.sandbox_output_mb if self.output_mb is None else self.output_mb


SCRATCH_DIR_PATTERN = r"^/[a-z0-9][a-z0-9._-]{0,63}$"
"""A scratch directory is one component under the root: ``/logs``, ``/tests``."""

RESERVED_TOP_DIRS = frozenset(
    {
        *("bin", "boot", "dev", "etc", "home", "lib", "lib32", "lib64", "libx32", "media"),
        *("mnt", "opt", "proc", "root", "run", "sbin", "srv", "sys", "tmp", "usr", "var"),
        "workspace",
    }
)
"""Top-level directories a scratch directory may never cover: the system's (a directory the
sandbox user could write there would hide what root in the sandbox, the exec agent, reads
or runs) and the sandbox's own mounts."""


class ScratchDir(BaseModel):
    """An extra writable directory of a sandbox whose root filesystem is read-only: an empty
    memory-backed filesystem (tmpfs; an ``emptyDir`` of medium Memory on Kubernetes) owned
    by the sandbox user, ``size_mb`` at most, counted against the sandbox's memory like
    /tmp, gone with the sandbox. For clients that expect to write at fixed absolute paths
    (Harbor's /logs, /tests, /solution: docs/e2b.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(
        pattern=SCRATCH_DIR_PATTERN,
        description="One new directory under /: not the system's (/etc, /usr, /opt, ...) nor "
        "/tmp or /workspace.",
    )
    size_mb: int = Field(64, ge=1, le=4096, description="Its size cap, in MB.")

    @model_validator(mode="after")
    def _not_reserved(self) -> ScratchDir:
        if self.path[1:] in RESERVED_TOP_DIRS:
            raise ValueError(
                f"{self.path} is the system's or the sandbox's own; a scratch directory is a "
                f"new top-level directory (not one of {', '.join(sorted(RESERVED_TOP_DIRS))})"
            )
        return self


def _distinct(dirs: tuple[ScratchDir, ...]) -> tuple[ScratchDir, ...]:
    paths = [d.path for d in dirs]
    if len(paths) != len(set(paths)):
        raise ValueError(f"a scratch directory is listed twice: {paths}")
    return dirs


ScratchDirs = Annotated[tuple[ScratchDir, ...], AfterValidator(_distinct)]
"""Scratch directories, each path at most once (two mounts at one path: the second hides
the first)."""


class RepoSetup(BaseModel):
    """How a repository's dependencies are installed: once per dependency fingerprint (the
    set-up and the contents of ``deps`` at a commit), into an image its rows' sandboxes
    run (images/repo_setup.py; docs/datasets.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    commands: list[str] = Field(
        default_factory=list,
        description="Shell commands run as root in the base image, in /opt/setup (the "
        "``deps`` files at their paths), with the wheelhouse at /opt/wheelhouse.",
    )
    dockerfile: str = Field(
        "",
        description="A whole Dockerfile instead (its FROM is ${BASE_IMAGE}; the context has "
        "deps/ and wheelhouse/).",
    )
    deps: list[str] = Field(
        default_factory=list,
        description="Paths in the repository whose contents decide the set-up "
        "(requirements.txt, setup.py, ...): commits that agree on them share one image.",
    )
    wheelhouse: str = Field(
        "",
        description="A directory of wheels on every host (Python dependencies come from it, "
        "not from an index).",
    )

    @model_validator(mode="after")
    def _one_way(self) -> RepoSetup:
        if bool(self.commands) == bool(self.dockerfile):
            raise ValueError("a set-up has commands or a dockerfile, exactly one")
        return self


class CommitWorkspace(BaseModel):
    """A /workspace that is a repository at a commit (sandbox/repos.py), not the image's."""

    model_config = ConfigDict(frozen=True)

    repo: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$", description="Its registered name.")
    commit: str = Field(pattern=r"^[0-9a-f]{40}$")
    source: str = Field(
        min_length=1, description="Where hosts fetch it from (each checks it is allowed)."
    )

    setup: RepoSetup | None = Field(
        None, description="The repository's set-up; its image is the sandbox's."
    )
    setup_image: str = Field(
        "", description="The set-up image of this commit's dependency fingerprint ('' none)."
    )

    @property
    def label(self) -> str:
        """``<repo>@<commit>``: the rollout's codebase, as records, pools and listings name it."""
        return f"{self.repo}@{self.commit}"


def _something_allowed(policy: EgressPolicy | None) -> EgressPolicy | None:
    # One way to say "no network": a backend checks for None alone.
    return None if policy is None or policy.allows_nothing else policy


class SandboxSpec(BaseModel):
    """Everything needed to create one sandbox."""

    model_config = ConfigDict(frozen=True)

    image: str
    runtime: Runtime = "runc"
    limits: SandboxLimits = SandboxLimits()
    rollout_id: str = Field("", max_length=200, description="Owner rollout; '' for ad hoc.")
    lifetime_s: int = Field(3600, ge=10, description="Expiry stamped on the sandbox's labels.")
    scratch_dirs: ScratchDirs = Field(
        (), description="Extra writable directories (tmpfs owned by the sandbox user)."
    )
    workspace: CommitWorkspace | None = Field(
        None, description="/workspace from a repository at a commit; None: the image's."
    )
    snapshot: str | None = Field(
        None,
        description="Start from this snapshot of the host's (sandbox/docker/snapshots.py): its "
        "/workspace and writable trees as they were; None: as the image (or commit) has them.",
    )
    egress: Annotated[EgressPolicy | None, AfterValidator(_something_allowed)] = Field(
        None,
        description="Where it may connect (sandbox/egress.py); None (an empty policy is "
        "made None): nowhere.",
    )

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        image: str,
        rollout_id: str = "",
        runtime: Runtime | None = None,
    ) -> SandboxSpec:
        """A spec with the deployment's default limits, runtime and lifetime."""
        return cls(
            image=image,
            runtime=runtime or settings.sandbox_runtime,
            rollout_id=rollout_id,
            lifetime_s=settings.sandbox_lifetime_s,
            limits=SandboxLimits(
                memory_mb=settings.sandbox_memory_mb,
                cpus=settings.sandbox_cpus,
                pids=settings.sandbox_pids,
                tmp_mb=settings.sandbox_tmp_mb,
                disk_mb=settings.sandbox_disk_mb,
                output_mb=settings.sandbox_output_mb,
            ),
        )


class SandboxHandle(BaseModel):
    """A created sandbox, serialisable so any worker on its host can reach it."""

    model_config = ConfigDict(frozen=True)

    sandbox_id: str
    backend: str
    host: str
    runtime: Runtime
    rollout_id: str
    image: str
    native_id: str = Field(description="The backend's own id (container id, pod name).")
    created_at: datetime
    expires_at: datetime
    reuse_count: int = Field(
        0, description="Rollouts it served before the current one (0: made for this one)."
    )
    reset_digest: str = Field(
        "", description="The audit digest of its last reset (ResetReport.digest); '' if none."
    )


class StreamCapture(BaseModel):
    """One output stream as captured within the output budget: head and tail kept."""

    head: str = ""
    tail: str = ""
    total_bytes: int = 0
    kept_bytes: int = 0

    @property
    def truncated(self) -> bool:
        return self.total_bytes > self.kept_bytes

    @property
    def omitted_bytes(self) -> int:
        return self.total_bytes - self.kept_bytes


LimitKind = Literal["timeout", "memory", "pids", "disk", "output"]
"""A sandbox limit a command can hit. Hitting one is the agent's doing, never ours."""


class LimitHit(BaseModel):
    """Evidence that a command hit one limit, with the limit's value for the model."""

    kind: LimitKind
    limit: float | None = Field(None, description="The limit's value, in ``unit``.")
    unit: str = Field("", description="MB, processes, s.")
    path: str | None = Field(None, description="For disk: the filesystem that filled up.")
    killed: bool = Field(
        False, description="A process was killed for it (not merely refused a resource)."
    )
    evidence: str = Field("", description="What the sandbox saw, for logs and records.")


class StageResult(BaseModel):
    """What :meth:`SandboxBackend.stage` did."""

    removed: list[str] = Field(default_factory=list)
    written: int = 0
    no_space: bool = Field(False, description="A write failed for want of space.")


class ExecResult(BaseModel):
    """What a command did. A non-zero exit status is still a successful exec."""

    exit_code: int | None = Field(
        description="None when the sandbox killed the command (timeout, output limit) or "
        "could not start it."
    )
    signal: int | None = Field(None, description="Signal that ended the command, if any.")
    stdout: StreamCapture
    stderr: StreamCapture
    timed_out: bool = False
    duration_ms: float
    limits_hit: list[LimitKind] = Field(
        default_factory=list,
        description="Limits the command hit, most telling first (an old agent reports none).",
    )
    limit_details: list[LimitHit] = Field(
        default_factory=list, description="One entry per limit in limits_hit, with its value."
    )

    @model_validator(mode="after")
    def _timeout_is_a_limit(self) -> ExecResult:
        # Replies of agents older than limits_hit still say timed_out.
        if self.timed_out and "timeout" not in self.limits_hit:
            self.limits_hit.append("timeout")
        return self

    def limit(self, kind: LimitKind) -> LimitHit | None:
        """The details of the limit ``kind`` if the command hit it."""
        return next((hit for hit in self.limit_details if hit.kind == kind), None)

    @property
    def truncated(self) -> bool:
        return self.stdout.truncated or self.stderr.truncated


class ReadFileResult(BaseModel):
    """Lines ``start_line..end_line`` (1-based, inclusive) of a file, raw text."""

    path: str
    text: str
    start_line: int
    end_line: int = Field(description="Last line returned; < start_line when none.")
    total_lines: int | None = Field(None, description="None when the file was not read to EOF.")
    truncated: bool = Field(False, description="Stopped at the byte cap before end_line.")
    size_bytes: int


class ProbeResult(BaseModel):
    """Evidence of a sandbox's health: is it running, does its agent answer, and if it is
    broken, did the agent break it (``agent_caused``) or did we."""

    alive: bool
    state: str = Field(description="Backend state, e.g. running, exited, paused, missing.")
    agent_ok: bool
    latency_ms: float | None = None
    slow: bool = Field(
        False,
        description="Alive and answering, but a trivial command did not finish in time: the "
        "host (or the agent's own processes) is busy. Healthy: slow is not dead.",
    )
    detail: str = ""
    exit_code: int | None = Field(None, description="Exit status of a sandbox that stopped.")
    oom_killed: bool = Field(False, description="The backend saw the sandbox OOM-killed.")
    agent_caused: str | None = Field(
        None,
        description="Set when the sandbox is unusable because of what the agent ran: "
        "memory_limit (the whole sandbox was killed at its memory limit) or pids_limit (the "
        "agent's processes fill the process limit, so no command can start). None when it "
        "is healthy or the fault is ours (paused, killed, vanished, agent not answering).",
    )


class HostHealth(BaseModel):
    """Evidence of a worker host's health, for its heartbeat."""

    backend_ok: bool
    backend_ping_ms: float | None = None
    disk_free_bytes: int = Field(
        description="Free bytes (for unprivileged use) on the filesystem of state_dir, which "
        "holds the sandboxes' workspace images."
    )
    sandboxes: int = Field(description="Sandboxes of this deployment on this host.")
    error: str | None = None
    outage_loses_sandboxes: bool = Field(
        True,
        description="Whether the backend being unreachable means this host's sandboxes are "
        "lost: true for a Docker daemon (its restart takes the containers with it), false "
        "for a Kubernetes API server (pods run on while it is away; a lost node shows in "
        "each pod's status). When false, a failed probe only cordons the host.",
    )
    daemon_cpu: DaemonShare | None = Field(
        None,
        description="The CPU weight of the daemons that create sandboxes, where the worker "
        "sets it (sandbox/daemon_share.py); None where it does not.",
    )


class ResetWay(StrEnum):
    """How a sandbox was reset (:meth:`SandboxBackend.reset`)."""

    IN_PLACE = "in_place"
    """The container kept running: its processes ended, its writable places emptied."""
    RESTART = "restart"
    """The container was killed and started again."""


class ResetReport(BaseModel):
    """A sandbox reset for another rollout (:meth:`SandboxBackend.reset`), and its audit:
    what it holds now compared with a fresh sandbox of the same spec."""

    clean: bool = Field(description="Nothing differs from a fresh sandbox: it may serve again.")
    differences: list[str] = Field(
        default_factory=list, description="What differs (or why it could not be compared)."
    )
    digest: str = Field("", description="sha256 of the manifest after the reset.")
    ms: float = 0.0
    way: ResetWay | None = Field(None, description="How; None when it was not tried.")


class SnapshotTaken(BaseModel):
    """A filesystem snapshot of a sandbox (:meth:`SandboxBackend.snapshot`)."""

    snapshot_id: str
    host: str
    files: int = Field(description="Files of /workspace's upper layer copied.")
    bytes: int = Field(description="Bytes kept: /workspace's changes and the writable trees.")
    ms: float = Field(description="How long taking it took.")
    paused_ms: float = Field(description="How long the sandbox was frozen for it.")
    skipped: list[str] = Field(
        default_factory=list, description="Files its user could not read (not kept)."
    )


class SandboxUsage(BaseModel):
    """What a sandbox uses now (:meth:`SandboxBackend.usage`): E2B's ``get_metrics``."""

    at: datetime
    cpu_count: float = Field(description="The CPUs it may use (its limit).")
    cpu_used_pct: float = Field(description="Of those, the share it used just now, in %.")
    mem_used: int = Field(description="Bytes of memory in use (page cache included).")
    mem_total: int = Field(description="Its memory limit, in bytes.")
    mem_cache: int = Field(0, description="Of mem_used, the page cache.")
    disk_used: int = Field(0, description="Bytes its /workspace holds of what it wrote.")
    disk_total: int = Field(0, description="Its /workspace cap in bytes (0: uncapped).")


class InputClosed(Exception):
    """A command's input cannot be written: it was started without one, or it closed."""


class SnapshotRefused(Exception):
    """A snapshot that cannot be taken for a reason of the caller's: not a fault of ours."""


class SandboxError(Exception):
    """An infrastructure fault: the sandbox or its backend failed, not the agent."""


class SandboxUnavailable(SandboxError):
    """The sandbox is gone, stopped or unreachable."""


class BackendUnavailable(SandboxError):
    """The backend itself (daemon, API server) cannot be reached."""


FileErrorKind = Literal[
    "not_found",
    "is_directory",
    "not_directory",
    "exists",
    "binary",
    "outside_workspace",
    "permission",
    "too_large",
    "no_space",
    "invalid",
    "pids_limit",
]
"""``pids_limit``: the reader could not start because the agent's own processes fill the
sandbox's process limit."""


class FileError(Exception):
    """A file operation (``read_file``, :meth:`SandboxBackend.file_op`) failed because of
    the path asked for: the caller's mistake, never ours."""

    def __init__(self, kind: FileErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind: FileErrorKind = kind
        self.message = message


FileAction = Literal["stat", "list", "mkdir", "remove", "move", "read", "write"]


class FileEntry(BaseModel):
    """One file or directory as the sandbox's user sees it."""

    name: str
    type: Literal["file", "dir"]
    path: str
    size: int
    mode: int
    permissions: str
    owner: str
    group: str
    modified: datetime
    symlink: bool = False
    symlink_target: str | None = None


class FileOpResult(BaseModel):
    """What :meth:`SandboxBackend.file_op` returns (the fields its action fills)."""

    # Bytes cross queues as JSON: base64, not text (a file is any bytes).
    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    entry: FileEntry | None = None
    entries: list[FileEntry] = Field(default_factory=list)
    created: bool | None = Field(None, description="mkdir: false when it existed already.")
    data: bytes | None = Field(None, description="read: the file's bytes.")


class ExecOp(BaseModel):
    """Run a command (:meth:`SandboxBackend.exec`): what a tool call asks of a sandbox, as
    the API's tool decided it (tools/), so the worker runs it without knowing the tool."""

    kind: Literal["exec"] = "exec"
    command: str | list[str] = Field(description="A bash command line, or an argv run as is.")
    timeout_s: float = Field(gt=0)
    output_budget_bytes: int = Field(gt=0, description="Kept of each stream, head and tail.")
    cwd: str = "/workspace"
    env: dict[str, str] | None = None
    exec_id: str | None = None
    stdin: bool = False
    pty: tuple[int, int] | None = None
    secrets: dict[str, SecretSource] = Field(
        default_factory=dict,
        description="Variables of the command read by the worker where it runs, never "
        "carried here ({VAR: where}); their values are taken out of the output.",
    )


class ReadOp(BaseModel):
    """Read lines of a file under /workspace (:meth:`SandboxBackend.read_file`)."""

    kind: Literal["read"] = "read"
    path: str
    start_line: int = Field(1, ge=1)
    end_line: int | None = None
    max_bytes: int = Field(gt=0)
    secrets: dict[str, SecretSource] = Field(
        default_factory=dict, description="Values taken out of what is read ({NAME: where})."
    )


SandboxOp = Annotated[ExecOp | ReadOp, Field(discriminator="kind")]
"""One operation in a sandbox: what a tool call's worker runs."""


class ExecRan(BaseModel):
    """An :class:`ExecOp` ran (its command may have failed, or hit a limit: its doing)."""

    kind: Literal["exec"] = "exec"
    result: ExecResult


class FileRead(BaseModel):
    """A :class:`ReadOp` read what it asked for."""

    kind: Literal["read"] = "read"
    result: ReadFileResult


class FileRefused(BaseModel):
    """A :class:`ReadOp`'s path was the caller's mistake (:class:`FileError`)."""

    kind: Literal["file_error"] = "file_error"
    error: FileErrorKind
    message: str


OpResult = ExecRan | FileRead | FileRefused
"""What a :data:`SandboxOp` did in a sandbox that ran it."""


class SandboxBackend(ABC):
    """Creates, drives and destroys sandboxes on one kind of infrastructure."""

    name: str

    def run_op(
        self,
        handle: SandboxHandle,
        op: ExecOp | ReadOp,
        on_output: Callable[[str, bytes], None] | None = None,
    ) -> OpResult:
        """Run one operation; a path's problem comes back as :class:`FileRefused`,
        :class:`SandboxError` (ours) propagates. ``on_output``: an exec's output as printed."""
        if isinstance(op, ReadOp):
            try:
                read = self.read_file(
                    handle,
                    op.path,
                    start_line=op.start_line,
                    end_line=op.end_line,
                    max_bytes=op.max_bytes,
                )
            except FileError as exc:
                return FileRefused(error=exc.kind, message=exc.message)
            return FileRead(result=read)
        return ExecRan(
            result=self.exec(
                handle,
                op.command,
                timeout_s=op.timeout_s,
                output_budget_bytes=op.output_budget_bytes,
                cwd=op.cwd,
                env=op.env,
                exec_id=op.exec_id,
                on_output=on_output,
                stdin=op.stdin,
                pty=op.pty,
            )
        )

    @abstractmethod
    def create(self, spec: SandboxSpec) -> SandboxHandle:
        """Create and start a sandbox; returns once its exec agent answers."""

    @abstractmethod
    def exec(
        self,
        handle: SandboxHandle,
        command: str | list[str],
        *,
        timeout_s: float,
        output_budget_bytes: int,
        cwd: str = "/workspace",
        env: dict[str, str] | None = None,
        exec_id: str | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
        stdin: bool = False,
        pty: tuple[int, int] | None = None,
    ) -> ExecResult:
        """Run ``command`` as the unprivileged user: a string is a bash command line, a list
        is an argv run as is (arguments never pass through a shell parser). The timeout is
        enforced in the sandbox by killing the command's whole process group. ``env``: more
        environment variables; ``exec_id``: a name :meth:`signal_exec` can reach it by;
        ``on_output``: given ("stdout" or "stderr", bytes) as the command prints them, up
        to ``output_budget_bytes`` a stream (the result keeps what it keeps either way);
        ``stdin``: its standard input a pipe :meth:`send_input` writes (with ``exec_id``),
        else /dev/null; ``pty``: (rows, cols) of a pseudo-terminal it runs on, its input
        and output (given to ``on_output`` as "pty", kept as stdout)."""

    def send_input(
        self,
        handle: SandboxHandle,
        exec_id: str,
        data: bytes,
        *,
        close: bool = False,
        resize: tuple[int, int] | None = None,
    ) -> bool:
        """Write ``data`` to the standard input of the running command ``exec_id`` (started
        with ``stdin`` or on a ``pty``), and close it after with ``close``; or set its
        terminal's size to ``resize`` (rows, cols). False when no such command runs.
        :class:`InputClosed` when it has no input to write to (the caller's doing)."""
        raise SandboxError(f"the {self.name} backend cannot write to a command's input")

    @abstractmethod
    def signal_exec(self, handle: SandboxHandle, exec_id: str, *, kill: bool = True) -> bool:
        """Kill (or, ``kill`` False, SIGTERM) the running command named ``exec_id``; False
        when none runs by that name."""

    @abstractmethod
    def file_op(
        self,
        handle: SandboxHandle,
        action: FileAction,
        path: str,
        *,
        target: str | None = None,
        depth: int = 1,
        data: bytes | None = None,
        max_bytes: int = 0,
    ) -> FileOpResult:
        """A filesystem operation as the unprivileged user, anywhere it may go (relative
        paths are under /workspace): stat, list (to ``depth``), mkdir (with parents),
        remove (recursively; nothing there is fine), move to ``target``, read (at most
        ``max_bytes``), write ``data`` (parents made). :class:`FileError` for the path's
        problems, :class:`SandboxError` for ours."""

    @abstractmethod
    def read_file(
        self,
        handle: SandboxHandle,
        path: str,
        *,
        start_line: int = 1,
        end_line: int | None = None,
        max_bytes: int,
    ) -> ReadFileResult:
        """Read lines of a file under /workspace as the unprivileged user.

        Raises :class:`FileError` for the agent's mistakes (missing, binary, outside
        the workspace) and :class:`SandboxError` for ours.
        """

    @abstractmethod
    def probe(self, handle: SandboxHandle) -> ProbeResult:
        """Check the sandbox is running and its agent runs a trivial command."""

    @abstractmethod
    def destroy(self, handle: SandboxHandle) -> None:
        """Destroy the sandbox and everything it owns. Idempotent."""

    @abstractmethod
    def list_owned(self) -> list[SandboxHandle]:
        """Every sandbox of this deployment on this backend, found by labels."""

    def limits_hit(self, handle: SandboxHandle) -> list[str]:
        """The limits the sandbox hit since it started, as its backend recorded them (an
        OOM kill, its process limit, a full /workspace): a sandbox that hit one is never
        recycled. Empty when none, or when the backend keeps no such record."""
        return []

    @contextlib.contextmanager
    def pristine_workspace(self, handle: SandboxHandle) -> Iterator[Path | None]:
        """The sandbox's /workspace as it was made on this host (its image's, or its
        commit's), as no sandbox can have changed it, for the length of the block (read
        only: a grader restores from it what decides a verdict); None when this backend
        keeps none."""
        yield None

    def stage(
        self,
        handle: SandboxHandle,
        *,
        purge: list[str],
        keep: list[str],
        remove: list[str],
        write: dict[str, bytes],
        timeout_s: float = 30.0,
    ) -> StageResult:
        """Every process of the agent's user ended, then under /workspace, as that user:
        files named in ``purge`` (names, or ``*.suffix``) not in ``keep`` removed, each of
        ``remove`` removed, each of ``write`` written over what was there (exec_agent.stage).
        :class:`SandboxError` when it cannot be done."""
        raise SandboxError(f"the {self.name} backend cannot stage files")

    def snapshot(self, handle: SandboxHandle, snapshot_id: str) -> SnapshotTaken:
        """Keep the sandbox's filesystem state on this host as ``snapshot_id``, which
        :attr:`SandboxSpec.snapshot` starts new sandboxes from; the sandbox runs on.
        :class:`SnapshotRefused` when the caller asked for what cannot be done."""
        raise SandboxError(f"the {self.name} backend cannot take snapshots")

    def usage(self, handle: SandboxHandle) -> SandboxUsage:
        """What the sandbox uses now: CPU (over a moment), memory, /workspace."""
        raise SandboxError(f"the {self.name} backend does not measure sandboxes")

    def drop_snapshot(self, snapshot_id: str) -> bool:
        """Remove a snapshot; False when it stays because a sandbox (or a snapshot) is made
        over it: :meth:`sweep_snapshots` removes it once it is free."""
        return True

    def sweep_snapshots(self, keep: set[str]) -> int:
        """Remove this host's snapshots not in ``keep`` that nothing is made over."""
        return 0

    def reset(self, handle: SandboxHandle, spec: SandboxSpec) -> ResetReport:
        """Make ``handle`` (made from ``spec``) as a fresh sandbox is, for another rollout:
        every process gone, every writable filesystem remade, the agent started again;
        then audit it against a fresh sandbox of ``spec``. A report that is not
        :attr:`ResetReport.clean` means the sandbox must be destroyed. Raises
        :class:`SandboxError` when the reset itself failed (destroy it too)."""
        return ResetReport(clean=False, differences=[f"the {self.name} backend cannot reset"])
