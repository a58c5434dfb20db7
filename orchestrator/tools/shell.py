"""The ``shell`` tool: run a bash command in the rollout's sandbox.

Output format (the model sees exactly this; every part is cleaned by
:func:`~orchestrator.tools.shaping.clean_text`):

- stdout as is;
- then, only when stderr is not empty, a line ``[stderr]`` followed by stderr;
- then, only when there is something to say, status lines:
  ``[exit code N]`` for a non-zero exit (for 128 + a signal number, with the signal named,
  since that is how bash reports a child killed by the memory limit),
  ``[killed by signal 9 (SIGKILL, possibly the sandbox's memory limit)]`` (or another signal)
  when a signal ended the command (the guess is left out once the sandbox has said which
  limit, if any, was hit); then one line per sandbox limit the command hit, naming the
  limit and its value (``[the command was killed: it exceeded the sandbox's memory limit of
  1024 MB. ...]``, likewise for the process limit, a full /workspace or /tmp, and output
  past the output limit); or, on timeout,
  ``[command timed out after 30 s; the whole process group was killed; ...]``;
- ``(no output)`` in place of both streams when both are empty.

A non-zero exit status and death by a signal are outcome ``ok``: the agent's command
failed, the tool did not. A command that hit a sandbox limit is ``agent_error`` (the agent
asked for too much), whose ``error_kind`` names the limit (:data:`LIMIT_ERROR_KINDS`:
``timeout``, ``memory_limit``, ``pids_limit``, ``disk_limit``, ``output_limit``), with
whatever output the command produced (head and tail).

The whole output is at most ``settings.output_budget_bytes`` bytes. The status lines and the
``[stderr]`` header are reserved first; the rest is shared between the streams fairly: a
stream that needs less than half keeps all of it and the other gets the remainder; when both
need more than half, each gets half. Each stream is cut in its middle with a marker
(:func:`~orchestrator.tools.shaping.shape_capture`).
"""

from __future__ import annotations

import math
import signal as signals
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from orchestrator.config import Settings
from orchestrator.outcomes import Outcome
from orchestrator.sandbox.backend import ExecOp, ExecResult, LimitHit, LimitKind, OpResult
from orchestrator.tools.base import Tool, ToolResult, exec_result
from orchestrator.tools.shaping import SHELL_HINT, Shaped, capture_demand, shape_capture

MAX_COMMAND_CHARS = 64 * 1024
# Linux caps one argv string at 128 KiB (MAX_ARG_STRLEN); the command is one argument of
# bash, so its UTF-8 size is what must stay under it.
MAX_COMMAND_BYTES = 64 * 1024
NO_OUTPUT = "(no output)"
TimeoutWording = tuple[str, str]
"""(what timed out, what the agent can do about it), for the timeout status line."""
STDERR_HEADER = "[stderr]"


class ShellArgs(BaseModel):
    """Arguments of ``shell``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    command: str = Field(
        min_length=1,
        max_length=MAX_COMMAND_CHARS,
        description="The bash command to run in /workspace, e.g. `grep -rn 'def main' src`.",
    )
    timeout_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Seconds before the command and everything it started are killed.",
    )

    @field_validator("command")
    @classmethod
    def _command_is_runnable(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("command is blank")
        # bash cannot take a NUL in its arguments; without this check the sandbox's exec
        # would fail and the failure would look like ours.
        if "\x00" in value:
            raise ValueError("command must not contain NUL characters")
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > MAX_COMMAND_BYTES:
            raise ValueError(
                f"command is {size:,} bytes of UTF-8; at most {MAX_COMMAND_BYTES:,} are allowed "
                "(write long scripts to a file in steps instead)"
            )
        return value

    @field_validator("timeout_s")
    @classmethod
    def _timeout_within_limit(cls, value: float | None, info: ValidationInfo) -> float | None:
        settings = _settings_from(info)
        if value is not None and value > settings.command_timeout_max_s:
            raise ValueError(
                f"timeout_s must be at most {format_seconds(settings.command_timeout_max_s)}"
            )
        return value

    def effective_timeout_s(self, settings: Settings) -> float:
        """The timeout to enforce: the agent's, or the deployment's default."""
        return self.timeout_s if self.timeout_s is not None else settings.command_timeout_s


def _settings_from(info: ValidationInfo) -> Settings:
    context = info.context or {}
    settings = context.get("settings")
    return settings if isinstance(settings, Settings) else Settings()


def format_seconds(seconds: float) -> str:
    """``30 s``, ``2.5 s``: how limits are named to the model."""
    text = f"{seconds:g}" if not math.isclose(seconds, round(seconds)) else f"{round(seconds)}"
    return f"{text} s"


def signal_description(number: int, *, memory_hint: bool = True) -> str:
    """``9 (SIGKILL, possibly the sandbox's memory limit)``, ``15 (SIGTERM)``; without the
    hint when the sandbox already said whether the memory limit was hit."""
    try:
        name = signals.Signals(number).name
    except ValueError:
        return str(number)
    if number == signals.SIGKILL and memory_hint:
        return f"{number} ({name}, possibly the sandbox's memory limit)"
    return f"{number} ({name})"


LIMIT_ERROR_KINDS: dict[LimitKind, str] = {
    "memory": "memory_limit",
    "pids": "pids_limit",
    "disk": "disk_limit",
    "output": "output_limit",
    "timeout": "timeout",
}
"""The ``error_kind`` of a call whose command hit each limit. When it hit several, the
first in this order names the call (the cause before its consequences: a fork bomb that
also ran out of time is a pids_limit)."""
LIMIT_KINDS = frozenset(LIMIT_ERROR_KINDS.values())
"""Every ``error_kind`` that says a call hit one of the sandbox's limits."""


def limit_error_kind(result: ExecResult) -> str | None:
    """The ``error_kind`` for the limits ``result`` hit, or None when it hit none."""
    hit = set(result.limits_hit)
    return next((kind for limit, kind in LIMIT_ERROR_KINDS.items() if limit in hit), None)


def _value(hit: LimitHit | None, fallback: str) -> str:
    """``1024 MB``, ``256 processes``: a limit's value as the model reads it."""
    if hit is None or hit.limit is None:
        return fallback
    return f"{hit.limit:g} {hit.unit}".strip()


def limit_lines(result: ExecResult, subject: str) -> list[str]:
    """One bracketed line per limit (other than the timeout) that the command hit, naming
    the limit and its value. ``subject`` is what ran: "command" or a configured tool."""
    who = "the command" if subject == "command" else subject
    lines: list[str] = []
    memory = result.limit("memory")
    if "memory" in result.limits_hit:
        value = _value(memory, "the sandbox's memory limit")
        if memory is not None and not memory.killed:
            lines.append(
                f"[{who} ran out of memory: allocations fail past the sandbox's memory limit "
                f"of {value}. Use less memory, e.g. process the data in chunks.]"
            )
        else:
            whole = result.signal == signals.SIGKILL or result.exit_code == 128 + signals.SIGKILL
            victim = f"{who} was killed" if whole else f"a process of {who} was killed"
            lines.append(
                f"[{victim}: it exceeded the sandbox's memory limit of {value}. Use less "
                "memory, e.g. process the data in chunks.]"
            )
    if "pids" in result.limits_hit:
        value = _value(result.limit("pids"), "the sandbox's process limit")
        if _never_started(result):
            lines.append(
                f"[{who} could not start: processes left running by earlier commands (e.g. "
                f"with setsid or nohup) fill the sandbox's process limit of {value}.]"
            )
        else:
            lines.append(
                f"[{who} hit the sandbox's process limit of {value}: new processes could not "
                "be started. Run fewer processes at once.]"
            )
    for disk in (d for d in result.limit_details if d.kind == "disk"):
        where = disk.path or "the disk"
        lines.append(
            f"[{where} is full: {who} hit the sandbox's limit of {_value(disk, '?')} for "
            f"{where}. Delete files that are no longer needed (du -sh shows what is big).]"
        )
    if "disk" in result.limits_hit and not result.limit("disk"):
        lines.append(f"[{who} hit the sandbox's disk limit.]")
    if "output" in result.limits_hit:
        value = _value(result.limit("output"), "the sandbox's output limit")
        lines.append(
            f"[{who} was killed: its output exceeded the sandbox's output limit of {value}; "
            "only its start and end are shown. Filter it (grep, head, tail) or redirect it "
            "to a file and read_file parts of it.]"
        )
    return lines


def _never_started(result: ExecResult) -> bool:
    """A pids_limit result of a command the sandbox could not start at all."""
    return (
        result.exit_code is None
        and result.signal is None
        and not result.timed_out
        and "output" not in result.limits_hit
    )


def status_line(
    result: ExecResult, timeout_s: float, settings: Settings, timeout: TimeoutWording | None = None
) -> str | None:
    """The bracketed line(s) closing the output, or None when there is nothing to say:
    how the command ended, then each limit it hit with the limit's value."""
    subject, advice = timeout or (
        "command",
        "Narrow the command, run it in smaller steps, or raise timeout_s "
        f"(at most {format_seconds(settings.command_timeout_max_s)}).",
    )
    lines = limit_lines(result, subject)
    if result.timed_out:
        lines.append(
            f"[{subject} timed out after {format_seconds(timeout_s)}; the whole process group "
            f"was killed. {advice}]"
        )
    elif "output" not in result.limits_hit:
        ended = _exit_line(result)
        if ended:
            lines.insert(0, ended)
    return "\n".join(lines) or None


def _exit_line(result: ExecResult) -> str | None:
    # Once the sandbox has said whether the memory limit was hit, SIGKILL needs no guess.
    hint = not result.limits_hit
    if result.signal:
        return f"[killed by signal {signal_description(result.signal, memory_hint=hint)}]"
    code = result.exit_code
    if code:
        # bash reports a child killed by a signal as 128 + the signal number without being
        # killed itself: that is how the memory limit's SIGKILL usually shows up.
        if 128 < code < 128 + 65 and code - 128 in _SIGNAL_NUMBERS:
            return (
                f"[exit code {code}, which usually means a process was killed by signal "
                f"{signal_description(code - 128, memory_hint=hint)}]"
            )
        return f"[exit code {code}]"
    return None


_SIGNAL_NUMBERS = {int(s) for s in signals.Signals}


def split_budget(room: int, demand_out: int, demand_err: int) -> tuple[int, int]:
    """Share ``room`` bytes between two streams, max-min fairly (see the module docs)."""
    room = max(room, 0)
    if demand_out + demand_err <= room:
        return demand_out, demand_err
    half = room // 2
    if demand_err <= half:
        return room - demand_err, demand_err
    if demand_out <= room - half:
        return demand_out, room - demand_out
    return room - half, half


def format_exec_result(
    result: ExecResult,
    timeout_s: float,
    settings: Settings,
    *,
    timeout: TimeoutWording | None = None,
) -> ToolResult:
    """Turn what the sandbox reported into the tool's output and outcome. ``timeout``
    names what timed out and what to do about it (default: shell's command and timeout_s)."""
    budget = settings.output_budget_bytes
    status = status_line(result, timeout_s, settings, timeout)
    demand_out = capture_demand(result.stdout)
    demand_err = capture_demand(result.stderr)
    # Reserve the fixed parts first: the status line, the stderr header, and the newlines
    # that join the sections (one after each stream that does not end with one).
    fixed = 0
    if status:
        fixed += len(status.encode()) + 1
    if demand_err:
        fixed += len(STDERR_HEADER) + 1 + 1
    if demand_out:
        fixed += 1
    if not demand_out and not demand_err:
        fixed += len(NO_OUTPUT) + 1
    quota_out, quota_err = split_budget(budget - fixed, demand_out, demand_err)
    out = shape_capture(result.stdout, quota_out, hint=SHELL_HINT)
    err = shape_capture(result.stderr, quota_err, hint=SHELL_HINT)

    parts: list[str] = []
    _append_section(parts, out)
    if err.text:
        parts.append(STDERR_HEADER + "\n")
        _append_section(parts, err)
    if not out.text and not err.text:
        parts.append(NO_OUTPUT + "\n")
    if status:
        parts.append(status + "\n")
    output = "".join(parts).removesuffix("\n")
    error_kind = limit_error_kind(result)
    return ToolResult(
        output=output,
        outcome=Outcome.AGENT_ERROR if error_kind else Outcome.OK,
        exit_code=result.exit_code,
        truncated=out.truncated or err.truncated,
        duration_ms=result.duration_ms,
        error_kind=error_kind,
    )


def _append_section(parts: list[str], shaped: Shaped) -> None:
    if shaped.text:
        parts.append(shaped.text if shaped.text.endswith("\n") else shaped.text + "\n")


class ShellTool(Tool[ShellArgs]):
    """Runs one bash command in /workspace as the sandbox's unprivileged user."""

    name = "shell"
    description = (
        "Run a bash command in the repository (working directory /workspace) and return its "
        "output: stdout, then stderr under a [stderr] line, then the exit code when it is not "
        "0. No network. Long output is cut in the middle; narrow commands with grep, head, "
        "tail, or wc. Each call starts a fresh shell: cd and variables do not persist."
    )
    args_model = ShellArgs
    usage = 'shell {"command": string, "timeout_s"?: number of seconds}'

    def command_timeout_s(self, args: ShellArgs, settings: Settings) -> float:
        return args.effective_timeout_s(settings)

    def operation(self, args: ShellArgs, settings: Settings) -> ExecOp:
        return ExecOp(
            command=args.command,
            timeout_s=args.effective_timeout_s(settings),
            output_budget_bytes=settings.output_budget_bytes,
        )

    def shape(self, args: ShellArgs, settings: Settings, ran: OpResult) -> ToolResult:
        return format_exec_result(exec_result(ran), args.effective_timeout_s(settings), settings)

    def parameters_schema(self, settings: Settings, *, strict: bool = False) -> dict[str, Any]:
        """The schema, with this deployment's default and maximum timeout filled in."""
        schema = super().parameters_schema(settings, strict=strict)
        timeout = schema["properties"]["timeout_s"]
        timeout["maximum"] = settings.command_timeout_max_s
        timeout["description"] = (
            f"{timeout.get('description', '')} Default "
            f"{format_seconds(settings.command_timeout_s)}, at most "
            f"{format_seconds(settings.command_timeout_max_s)}."
        ).strip()
        return schema
