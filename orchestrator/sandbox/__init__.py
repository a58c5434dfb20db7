"""Sandboxes: the backend interface and its implementations."""

from orchestrator.sandbox.backend import (
    ExecResult,
    FileError,
    HostHealth,
    LimitHit,
    LimitKind,
    ProbeResult,
    ReadFileResult,
    SandboxBackend,
    SandboxError,
    SandboxHandle,
    SandboxLimits,
    SandboxSpec,
    SandboxUnavailable,
    StreamCapture,
)

__all__ = [
    "ExecResult",
    "FileError",
    "HostHealth",
    "LimitHit",
    "LimitKind",
    "ProbeResult",
    "ReadFileResult",
    "SandboxBackend",
    "SandboxError",
    "SandboxHandle",
    "SandboxLimits",
    "SandboxSpec",
    "SandboxUnavailable",
    "StreamCapture",
]
