"""``command``: a process run for a client that drives the sandbox itself (the E2B API,
docs/e2b.md), not for a model: an argv with its own environment and working directory, run
to its end or its timeout, its stdout and stderr given back apart, whole up to the client
output budget (``e2b_output_mb`` each, head and tail kept beyond it).

It goes through the same path as a model's tool call (run ticket, trajectory, metrics):
only its shape differs. Its output is JSON (:class:`CommandOutput`), never shown to a
model, so it is not cut to the model's output budget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from orchestrator.config import Settings
from orchestrator.outcomes import Outcome
from orchestrator.sandbox.backend import ExecOp, ExecResult, OpResult
from orchestrator.tools.base import Tool, ToolResult, exec_result

OnOutput = Callable[[str, bytes], None]
"""Given a command's output as it is printed: "stdout" or "stderr", the bytes."""
COMMAND_TOOL = "sandbox.command"
"""Its name: outside the names environments may give their tools (no dots there)."""


class CommandArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    argv: list[str] = Field(min_length=1, max_length=4096)
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str = "/workspace"
    timeout_s: float = Field(gt=0)
    exec_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:-]{1,100}$")
    stdin: bool = Field(False, description="Its input a pipe the client writes (exec_id too).")
    pty: tuple[int, int] | None = Field(
        None, description="(rows, cols) of a pseudo-terminal it runs on (exec_id too)."
    )

    @field_validator("pty")
    @classmethod
    def _sane_size(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and not all(1 <= n <= 10_000 for n in value):
            raise ValueError("a terminal has 1 to 10,000 rows and columns")
        return value

    @field_validator("argv")
    @classmethod
    def _no_nul(cls, value: list[str]) -> list[str]:
        if any("\x00" in a for a in value):
            raise ValueError("argv elements may not contain NUL")
        return value

    @field_validator("timeout_s")
    @classmethod
    def _within_limit(cls, value: float, info: ValidationInfo) -> float:
        settings: Settings = (info.context or {})["settings"]
        if value > settings.command_timeout_max_s:
            raise ValueError(f"timeout_s must be at most {settings.command_timeout_max_s:g}")
        return value


class CommandOutput(BaseModel):
    """The ``output`` of a ``command`` call."""

    stdout: str
    stderr: str
    exit_code: int | None = Field(description="None when it was killed or timed out.")
    signal: int | None = None
    timed_out: bool = False
    truncated: bool = Field(False, description="Output past the client budget was cut.")
    limits: list[str] = Field(default_factory=list, description="Sandbox limits it hit.")
    duration_ms: float = 0.0

    @classmethod
    def of(cls, result: ExecResult) -> CommandOutput:
        def text(stream: Any) -> str:
            cut = stream.omitted_bytes
            if not cut:
                return str(stream.head) + str(stream.tail)
            return f"{stream.head}\n[... {cut} bytes cut ...]\n{stream.tail}"

        stderr = text(result.stderr)
        for detail in result.limit_details:
            stderr += f"\n[the command hit the sandbox's {detail.kind} limit: {detail.evidence}]"
        return cls(
            stdout=text(result.stdout),
            stderr=stderr,
            exit_code=result.exit_code,
            signal=result.signal,
            timed_out=result.timed_out,
            truncated=result.truncated,
            limits=list(result.limits_hit),
            duration_ms=result.duration_ms,
        )


class CommandTool(Tool[CommandArgs]):
    name: ClassVar[str] = COMMAND_TOOL
    description: ClassVar[str] = "Run an argv in the sandbox (for clients, not models)."
    args_model: ClassVar[type[BaseModel]] = CommandArgs
    usage: ClassVar[str] = (
        'sandbox.command {"argv": [..], "env"?: {..}, "cwd"?: str, "timeout_s": number}'
    )

    def fitted_budget(self, settings: Settings) -> int | None:
        # JSON for a client, bounded by the client budget it was captured with: never cut
        # to the model's.
        return None

    def operation(self, args: CommandArgs, settings: Settings) -> ExecOp:
        return ExecOp(
            command=args.argv,
            timeout_s=args.timeout_s,
            output_budget_bytes=settings.e2b_output_mb << 20,
            cwd=args.cwd,
            env=args.env,
            exec_id=args.exec_id,
            stdin=args.stdin and args.exec_id is not None,
            pty=args.pty if args.exec_id is not None else None,
        )

    def shape(self, args: CommandArgs, settings: Settings, ran: OpResult) -> ToolResult:
        result = exec_result(ran)
        output = CommandOutput.of(result)
        return ToolResult(
            output=output.model_dump_json(),
            outcome=Outcome.OK,
            exit_code=result.exit_code,
            truncated=output.truncated,
            error_kind="timeout" if result.timed_out else None,
        )

    def command_timeout_s(self, args: CommandArgs, settings: Settings) -> float:
        return args.timeout_s


CLIENT_TOOLS: dict[str, Tool[Any]] = {COMMAND_TOOL: CommandTool()}
"""Tools for clients that drive a sandbox themselves (the E2B API), never for a model."""
