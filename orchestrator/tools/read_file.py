"""The ``read_file`` tool: lines of a file under /workspace, numbered like ``cat -n``.

Output format: one line per file line, the line number right-aligned in six columns (wider
for files past 999,999 lines), a tab, then the line, cleaned with
:func:`~orchestrator.tools.shaping.clean_text` in ``space`` mode (escape sequences and
control characters dropped, a lone carriage return shown as a space, so numbering stays the
file's). A footer line in brackets follows whenever less than the whole file is shown:

- ``[showing lines 10-20 of 120]`` for a range;
- ``[showing lines 100-120 of 120 (end of file)]`` for a range reaching the end;
- ``[showing lines 1-350 of 2000; output limit of 16,384 bytes reached: call read_file with
  start_line=351 to read on]`` when the budget cut it.

An empty file shows ``(empty file)``. A start_line past the end is an ``agent_error`` (the
model asked for lines that do not exist); so are the backend's
:class:`~orchestrator.sandbox.backend.FileError` kinds (a
:class:`~orchestrator.sandbox.backend.FileRefused`), whose ``kind`` becomes the result's
``error_kind``. The whole output is at most ``settings.output_budget_bytes`` bytes.
"""

from __future__ import annotations

import posixpath
import shlex
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from orchestrator.config import Settings
from orchestrator.outcomes import Outcome
from orchestrator.sandbox.agent.client import READ_FILE_TIMEOUT_S
from orchestrator.sandbox.backend import (
    FileRead,
    FileRefused,
    OpResult,
    ReadFileResult,
    ReadOp,
)
from orchestrator.tools.base import Tool, ToolResult, agent_error
from orchestrator.tools.shaping import clean_text, utf8_prefix

WORKSPACE = "/workspace"
MAX_PATH_CHARS = 4096
NUMBER_WIDTH = 6
EMPTY_FILE = "(empty file)"
# Paths longer than this are not echoed in shell hints, to keep hints short.
MAX_ECHOED_PATH = 200


def workspace_relative(path: str) -> str:
    """``path`` relative to /workspace, or ValueError saying why it is not inside it.

    The sandbox checks again (with symlinks resolved); this catches the plain mistakes
    early, with a message that says what to do.
    """
    if path == WORKSPACE or path.startswith(WORKSPACE + "/"):
        relative = path[len(WORKSPACE) :].lstrip("/") or "."
    elif path.startswith("/"):
        raise ValueError(
            f"{path} is outside /workspace; give a path relative to /workspace "
            "(e.g. src/main.py) or one starting with /workspace/"
        )
    else:
        relative = path
    normal = posixpath.normpath(relative)
    if normal == ".." or normal.startswith("../"):
        raise ValueError(f"{path} escapes /workspace through '..'; give a path inside it")
    return normal


class ReadFileArgs(BaseModel):
    """Arguments of ``read_file``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    path: str = Field(
        min_length=1,
        max_length=MAX_PATH_CHARS,
        description="File path relative to /workspace (a path starting with /workspace/ "
        "also works).",
    )
    start_line: int | None = Field(
        None, ge=1, description="First line to show, 1-based. Default 1."
    )
    end_line: int | None = Field(
        None, ge=1, description="Last line to show, inclusive. Default: as far as fits."
    )

    @field_validator("path")
    @classmethod
    def _path_in_workspace(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("path must not contain NUL characters")
        workspace_relative(value)
        return value

    @model_validator(mode="after")
    def _range_is_ordered(self) -> Self:
        if self.end_line is not None and self.end_line < (self.start_line or 1):
            raise ValueError(
                f"end_line ({self.end_line}) must be >= start_line ({self.start_line or 1})"
            )
        return self


def _quoted_path(path: str) -> str:
    return shlex.quote(path) if len(path) <= MAX_ECHOED_PATH else "FILE"


def _split_lines(text: str) -> list[str]:
    # Only "\n" ends a line, as in the sandbox's reader: str.splitlines would also split
    # on \r, \v, \f, U+2028 ... and the numbers would drift from the file's.
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def _footer(
    first: int,
    last: int,
    result: ReadFileResult,
    cut_by_limit: bool,
    budget: int,
) -> str | None:
    total = result.total_lines
    whole = first == 1 and total is not None and last >= total
    if whole and not cut_by_limit:
        return None
    span = f"line {first}" if first == last else f"lines {first}-{last}"
    of = f" of {total}" if total is not None else f" of a {result.size_bytes:,}-byte file"
    if cut_by_limit:
        return (
            f"[showing {span}{of}; output limit of {budget:,} bytes reached: call read_file "
            f"with start_line={last + 1} to read on]"
        )
    if total is not None and last >= total:
        return f"[showing {span}{of} (end of file)]"
    return f"[showing {span}{of}]"


def _long_line_note(number: int, shown: int, size: int | None, path: str) -> str:
    piece = 8000
    start = shown + 1
    rest = f" for {size - shown:,} more bytes" if size is not None else ""
    return (
        f" ... [line {number} continues{rest}; view it in pieces with shell, e.g. "
        f"sed -n '{number}p' {_quoted_path(path)} | cut -b {start}-{start + piece - 1}]"
    )


def format_read_result(
    result: ReadFileResult, start_line: int, budget: int, path: str
) -> ToolResult:
    """Number the lines, fit them into ``budget`` bytes and add the footer."""
    lines = _split_lines(result.text)
    if result.size_bytes == 0 or result.total_lines == 0:
        return ToolResult(output=EMPTY_FILE, outcome=Outcome.OK)
    if not lines:
        if result.truncated:
            # The sandbox found the line longer than the whole read budget: nothing of it
            # can be shown here, but shell can show it in pieces.
            note = _long_line_note(start_line, 0, None, path).removeprefix(" ... ")
            return ToolResult(output=note, outcome=Outcome.OK, truncated=True)
        total = result.total_lines
        where = f"the file has {total} lines" if total is not None else "no lines there"
        return agent_error(
            f"start_line {start_line} is past the end of {path}: {where}", "out_of_range"
        )
    last_available = start_line + len(lines) - 1
    width = max(NUMBER_WIDTH, len(str(last_available)))
    entries = [
        f"{number:>{width}}\t{clean_text(line, carriage_return='space')}\n"
        for number, line in enumerate(lines, start=start_line)
    ]
    # Drop lines from the end until lines + footer fit; the footer depends on what is shown.
    count = len(entries)
    size = sum(len(e.encode()) for e in entries)
    while True:
        last = start_line + count - 1
        cut = count < len(entries) or result.truncated
        footer = _footer(start_line, last, result, cut, budget)
        footer_size = len(footer.encode()) if footer else 0
        if size + footer_size <= budget or count == 1:
            break
        count -= 1
        size -= len(entries[count].encode())
    shown = entries[:count]
    if size + footer_size > budget:
        # The first line alone does not fit with its footer: show its start.
        shown = [_cut_line(entries[0], start_line, budget - footer_size, path)]
        cut = True
    body = "".join(shown)
    output = body + footer if footer else body.removesuffix("\n")
    return ToolResult(output=output, outcome=Outcome.OK, truncated=cut)


def _cut_line(entry: str, number: int, room: int, path: str) -> str:
    prefix, _, text = entry.partition("\t")
    data = text.removesuffix("\n").encode()
    # Sized with the largest numbers the note can show: it never grows past this.
    note_max = len(_long_line_note(number, len(data), 2 * len(data), path).encode())
    keep = utf8_prefix(data, max(room - len(prefix) - 1 - note_max - 1, 0))
    note = _long_line_note(number, keep, len(data), path)
    return f"{prefix}\t{data[:keep].decode()}{note}\n"


class ReadFileTool(Tool[ReadFileArgs]):
    """Reads lines of one file under /workspace as the sandbox's unprivileged user."""

    name = "read_file"
    description = (
        "Read a text file of the repository, with line numbers. The path is relative to "
        "/workspace. Without start_line/end_line it shows the file from the top as far as "
        "the output limit allows and says where to continue; give start_line/end_line to "
        "read a range."
    )
    args_model = ReadFileArgs
    usage = 'read_file {"path": string, "start_line"?: integer >= 1, "end_line"?: integer}'

    def command_timeout_s(self, args: ReadFileArgs, settings: Settings) -> float:
        return READ_FILE_TIMEOUT_S

    def operation(self, args: ReadFileArgs, settings: Settings) -> ReadOp:
        return ReadOp(
            path=args.path,
            start_line=args.start_line or 1,
            end_line=args.end_line,
            # Raw text beyond the budget could never be shown: do not ship it.
            max_bytes=min(settings.read_file_max_bytes, settings.output_budget_bytes),
        )

    def shape(self, args: ReadFileArgs, settings: Settings, ran: OpResult) -> ToolResult:
        budget = settings.output_budget_bytes
        if isinstance(ran, FileRefused):
            return agent_error(ran.message, ran.error, budget=budget)
        if not isinstance(ran, FileRead):
            raise TypeError(f"a read came back as {ran.kind!r}")
        return format_read_result(ran.result, args.start_line or 1, budget, args.path)
