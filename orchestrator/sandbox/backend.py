"""The sandbox backend interface: what every backend (Docker, Kubernetes) provides.

Backends know nothing about rollouts' rewards or HTTP; they create isolated sandboxes, run
commands in them through the in-sandbox exec agent, and destroy them. Errors they raise say
whose fault a failure is: :class:`SandboxError` and its subclasses are infrastructure faults,
:class:`FileReadError` is the agent's own mistake.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.config import Runtime, Settings


class SandboxLimits(BaseModel):
    """Hard resource limits of one sandbox."""

    model_config = ConfigDict(frozen=True)

    memory_mb: int = Field(1024, ge=64)
    cpus: float = Field(1.0, gt=0)
    pids: int = Field(256, ge=16)
    tmp_mb: int = Field(256, ge=1)


class SandboxSpec(BaseModel):
    """Everything needed to create one sandbox."""

    model_config = ConfigDict(frozen=True)

    image: str
    runtime: Runtime = "runc"
    limits: SandboxLimits = SandboxLimits()
    rollout_id: str = Field("", max_length=200, description="Owner rollout; '' for ad hoc.")
    lifetime_s: int = Field(3600, ge=10, description="Expiry stamped on the sandbox's labels.")

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


class ExecResult(BaseModel):
    """What a command did. A non-zero exit status is still a successful exec."""

    exit_code: int | None = Field(description="None when killed by the timeout.")
    signal: int | None = Field(None, description="Signal that ended the command, if any.")
    stdout: StreamCapture
    stderr: StreamCapture
    timed_out: bool = False
    duration_ms: float

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
    """Evidence of a sandbox's health: is it running, does its agent answer."""

    alive: bool
    state: str = Field(description="Backend state, e.g. running, exited, paused, missing.")
    agent_ok: bool
    latency_ms: float | None = None
    detail: str = ""


class SandboxError(Exception):
    """An infrastructure fault: the sandbox or its backend failed, not the agent."""


class SandboxUnavailable(SandboxError):
    """The sandbox is gone, stopped or unreachable."""


class BackendUnavailable(SandboxError):
    """The backend itself (daemon, API server) cannot be reached."""


FileErrorKind = Literal[
    "not_found", "is_directory", "binary", "outside_workspace", "permission", "invalid"
]


class FileReadError(Exception):
    """``read_file`` failed because of the path the agent asked for."""

    def __init__(self, kind: FileErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind: FileErrorKind = kind
        self.message = message


class SandboxBackend(ABC):
    """Creates, drives and destroys sandboxes on one kind of infrastructure."""

    name: str

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
    ) -> ExecResult:
        """Run ``command`` as the unprivileged user: a string is a bash command line, a list
        is an argv run as is (arguments never pass through a shell parser). The timeout is
        enforced in the sandbox by killing the command's whole process group."""

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

        Raises :class:`FileReadError` for the agent's mistakes (missing, binary, outside
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
