"""``command``: a process run for a client that drives the sandbox itself (the E2B API,
docs/e2b.md), not for a model: an argv with its own environment and working directory, run
to its end or its timeout, its stdout and stderr given back apart, whole up to the client
output budget (``e2b_output_mb`` each, head and tail kept beyond it).

It goes through the same path as a model's tool call (run ticket, trajectory, metrics):
only its shape differs. Its output is JSON (:class:`CommandOutput`), never shown to a
model, so it is not cut to the model's output budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from orchestrator.config import Settings
from orchestrator.outcomes import Outcome
from orchestrator.sandbox.backend import ExecResult, SandboxBackend, SandboxHandle
from orchestrator.tools.base import InvalidArguments, Tool, ToolResult, agent_error, elapsed_ms

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

    def run(
        self,
        backend: SandboxBackend,
        handle: SandboxHandle,
        arguments: dict[str, Any] | str | None,
        settings: Settings,
    ) -> ToolResult:
        """As :meth:`Tool.run`, without cutting the output to the model's budget: it is
        JSON for a client, bounded by the client budget it was captured with."""
        started = time.perf_counter()
        try:
            args = self.parse(arguments, settings)
        except InvalidArguments as exc:
            return agent_error(exc.message, "invalid_arguments", started=started)
        return self.run_parsed(backend, handle, args, settings, started=started)

    def run_parsed(
        self,
        backend: SandboxBackend,
        handle: SandboxHandle,
        args: CommandArgs,
        settings: Settings,
        *,
        started: float | None = None,
        on_output: OnOutput | None = None,
    ) -> ToolResult:
        """As :meth:`Tool.run_parsed`, without cutting the output to the model's budget (as
        :meth:`run`); ``on_output``: given the output as it is printed (a client's stream:
        state/streams.py)."""
        started = time.perf_counter() if started is None else started
        result = self.execute(backend, handle, args, settings, on_output)
        return result.model_copy(update={"duration_ms": elapsed_ms(started)})

    def execute(
        self,
        backend: SandboxBackend,
        handle: SandboxHandle,
        args: CommandArgs,
        settings: Settings,
        on_output: OnOutput | None = None,
    ) -> ToolResult:
        result = backend.exec(
            handle,
            args.argv,
            timeout_s=args.timeout_s,
            output_budget_bytes=settings.e2b_output_mb << 20,
            cwd=args.cwd,
            env=args.env,
            exec_id=args.exec_id,
            on_output=on_output,
            stdin=args.stdin and args.exec_id is not None,
            pty=args.pty if args.exec_id is not None else None,
        )
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
