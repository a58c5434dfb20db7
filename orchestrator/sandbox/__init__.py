"""Sandboxes: the backend interface and its implementations."""

from orchestrator.sandbox.backend import (
    ExecResult,
    FileReadError,
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
