"""Sandboxes: the backend interface and its implementations."""

from orchestrator.sandbox.backend import (
    ExecResult,
    FileReadError,
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
    "FileReadError",
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
