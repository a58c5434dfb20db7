"""Unit tests of the tools layer against a fake backend (real sandboxes are tested elsewhere)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from orchestrator.config import Settings
from orchestrator.outcomes import Outcome
from orchestrator.sandbox.agent import agent_limits
from orchestrator.sandbox.agent import client as agent_client
from orchestrator.sandbox.agent.agent_processes import Capture
from orchestrator.sandbox.backend import (
    BackendUnavailable,
    ExecOp,
    ExecResult,
    FileAction,
    FileError,
    FileOpResult,
    LimitHit,
    ProbeResult,
    ReadFileResult,
    ReadOp,
    SandboxBackend,
    SandboxError,
    SandboxHandle,
    SandboxSpec,
    SandboxUnavailable,
    StreamCapture,
)
from orchestrator.state.wire import InfraFault, OpDone, RunOp, SandboxKilled
from orchestrator.tools import (
    TOOLS,
    ReadFileArgs,
    ShellArgs,
    UnknownToolError,
    get_tool,
    run_tool,
    tool_schemas,
)
from orchestrator.tools.read_file import workspace_relative
from orchestrator.tools.shaping import (
    MARKER_MAX_BYTES,
    SHELL_HINT,
    clean_text,
    marker,
    shape_capture,
    shape_text,
    truncate_middle,
)
from orchestrator.tools.shell import format_seconds, split_budget

# --------------------------------------------------------------------------- helpers

HANDLE = SandboxHandle(
    sandbox_id="sb-1",
    backend="fake",
    host="local",
    runtime="runc",
    rollout_id="trace_x",
    image="img",
    native_id="c1",
    created_at=datetime(2024, 1, 1, tzinfo=UTC),
    expires_at=datetime(2024, 1, 1, 1, tzinfo=UTC),
)
SETTINGS = Settings()
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
MARKER_RE = re.compile(r"\.\.\. \[([\d,]+) bytes(?: \(([\d,]+) lines?\))? omitted[^\]]*\] \.\.\.")


def capture_of(data: bytes, budget: int) -> StreamCapture:
    """What the real in-sandbox agent captures of ``data`` with ``budget``."""
    cap = Capture(budget)
    # Feed in uneven chunks, as pipes deliver.
    for i in range(0, len(data), 777):
        cap.feed(data[i : i + 777])
    return StreamCapture.model_validate(cap.result())


def exec_result(
    stdout: str = "",
    stderr: str = "",
    *,
    exit_code: int | None = 0,
    signal: int | None = None,
    timed_out: bool = False,
    budget: int = SETTINGS.output_budget_bytes,
) -> ExecResult:
    return ExecResult(
        exit_code=exit_code,
        signal=signal,
        stdout=capture_of(stdout.encode(), budget),
        stderr=capture_of(stderr.encode(), budget),
        timed_out=timed_out,
        duration_ms=12.5,
    )


class FakeBackend(SandboxBackend):
    """Answers exec/read_file from canned values and records the calls."""

    name = "fake"

    def __init__(
        self,
        *,
        exec_result: ExecResult | None = None,
        files: dict[str, str] | None = None,
        error: Exception | None = None,
    ) -> None:
        self.exec_result = exec_result or globals()["exec_result"]("ok\n")
        self.files = files or {}
        self.error = error
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def create(self, spec: SandboxSpec) -> SandboxHandle:
        raise NotImplementedError

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
        self.calls.append(
            ("exec", {"command": command, "timeout_s": timeout_s, "budget": output_budget_bytes})
        )
        if self.error:
            raise self.error
        return self.exec_result

    def signal_exec(self, handle: SandboxHandle, exec_id: str, *, kill: bool = True) -> bool:
        raise NotImplementedError  # the E2B surface's: no tool calls it

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
        raise NotImplementedError  # the E2B surface's: no tool calls it

    def read_file(
        self,
        handle: SandboxHandle,
        path: str,
        *,
        start_line: int = 1,
        end_line: int | None = None,
        max_bytes: int,
    ) -> ReadFileResult:
        """Mimics the exec agent's reader closely enough for formatting tests."""
        self.calls.append(
            ("read_file", {"path": path, "start": start_line, "end": end_line, "max": max_bytes})
        )
        if self.error:
            raise self.error
        key = path.removeprefix("/workspace/")
        if key not in self.files:
            raise FileError("not_found", f"{path}: no such file")
        data = self.files[key].encode()
        # Only \n ends a line, as in the exec agent (bytes.splitlines would split on \r).
        lines = [line + b"\n" for line in data.split(b"\n")]
        if lines[-1] == b"\n":
            lines.pop()
        else:
            lines[-1] = lines[-1][:-1]
        out = b""
        last = start_line - 1
        truncated = False
        for number, line in enumerate(lines, start=1):
            if number < start_line or (end_line is not None and number > end_line):
                continue
            if len(out) + len(line) > max_bytes:
                truncated = True
                break
            out += line
            last = number
        return ReadFileResult(
            path=path,
            text=out.decode("utf-8", "replace"),
            start_line=start_line,
            end_line=last,
            total_lines=len(lines),
            truncated=truncated,
            size_bytes=len(data),
        )

    def probe(self, handle: SandboxHandle) -> ProbeResult:
        raise NotImplementedError

    def destroy(self, handle: SandboxHandle) -> None:
        raise NotImplementedError

    def list_owned(self) -> list[SandboxHandle]:
        raise NotImplementedError


def run(name: str, arguments: Any, backend: FakeBackend, settings: Settings = SETTINGS) -> Any:
    return get_tool(name).run(backend, HANDLE, arguments, settings)


def size(text: str) -> int:
    return len(text.encode())


# --------------------------------------------------------------------------- cleaning


@pytest.mark.parametrize(
    ("raw", "clean"),
    [
        ("\x1b[1;31mred\x1b[0m", "red"),
        ("a\x1b[?25lb\x1b[2Kc", "abc"),
        ("\x1b]0;window title\x07text", "text"),
        ("\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\", "link"),
        ("\x1bPq#0;2;0;0;0\x1b\\after", "after"),
        ("\x1b(Bplain\x1b7\x1b8", "plain"),
        ("one\r\ntwo\r\n", "one\ntwo\n"),
        ("10%\r50%\r100%\ndone", "100%\ndone"),
        ("progress\r\rfinal\r", "final"),
        ("tab\tkept\nnewline kept", "tab\tkept\nnewline kept"),
        ("bell\x07 nul\x00 del\x7f c1\x85\x9b", "bell nul del c1"),
        ("_\bu_\bn", "un"),
        ("ab\b\b\bc", "c"),
        ("x\n\by", "x\ny"),
        # Unterminated: only the escape's introducer goes, never the rest of the output.
        ("unterminated \x1b]0;title and more", "unterminated 0;title and more"),
        ("lone surrogate \ud800", "lone surrogate \ufffd"),
        ("héllo 世界 🎉", "héllo 世界 🎉"),
    ],
)
def test_clean_text(raw: str, clean: str) -> None:
    assert clean_text(raw) == clean


def test_clean_text_space_mode_keeps_file_lines() -> None:
    assert clean_text("a\rb\r\nc", carriage_return="space") == "a b\nc"


@given(st.text())
def test_clean_removes_every_control_char_and_is_idempotent(text: str) -> None:
    once = clean_text(text)
    assert not CONTROL.search(once)
    assert "\r" not in once and "\x1b" not in once
    assert clean_text(once) == once
    space = clean_text(text, carriage_return="space")
    assert not CONTROL.search(space)
    assert clean_text(space, carriage_return="space") == space


@given(st.text(alphabet=st.characters(exclude_categories=["Cc", "Cs"])))
def test_clean_keeps_text_without_controls(text: str) -> None:
    assert clean_text(text) == text


# --------------------------------------------------------------------------- truncation


def test_truncate_keeps_fitting_text_unchanged() -> None:
    text = "short\n"
    shaped = truncate_middle(text, 100)
    assert shaped.text == text and not shaped.truncated


def test_truncate_marker_counts_bytes_and_lines() -> None:
    text = "".join(f"line {i:04d}\n" for i in range(1000))  # 10 bytes a line
    shaped = truncate_middle(text, 1000)
    assert shaped.truncated
    assert size(shaped.text) <= 1000
    head, mark, tail = shaped.text.partition(
        marker(shaped.omitted_bytes, shaped.omitted_lines, SHELL_HINT)
    )
    assert mark
    assert head.startswith("line 0000\n") and head.endswith("\n")
    assert tail.startswith("\n") and tail.endswith("line 0999\n")
    kept_lines = head.count("\n") + tail.count("\n") - 1
    assert shaped.omitted_lines == 1000 - kept_lines
    assert shaped.omitted_bytes == size(text) - size(head) - (size(tail) - 1)
    assert f"{shaped.omitted_bytes:,} bytes" in mark


def test_truncate_marker_tells_how_to_see_more() -> None:
    shaped = truncate_middle("x" * 5000, 1000)
    assert "head" in shaped.text and "read_file" in shaped.text and "start_line" in shaped.text


def test_truncate_tiny_budgets_never_overflow() -> None:
    text = "y" * 1000
    for budget in range(60):
        shaped = truncate_middle(text, budget)
        assert size(shaped.text) <= budget
        assert shaped.truncated
    # A budget too small for the hint still gets a short marker.
    assert "omitted]" in truncate_middle(text, 100).text


@st.composite
def texts_and_budgets(draw: st.DrawFn) -> tuple[str, int]:
    pieces = st.sampled_from(["a", "é", "世", "🎉", "\n", " ", "line\n", "\t"])
    text = "".join(draw(st.lists(pieces, max_size=600)))
    return text, draw(st.integers(min_value=0, max_value=800))


@given(texts_and_budgets())
# Found by hypothesis: a head cut just before a newline counted that newline as omitted.
@example(("🎉line\nline\nline\n" + "a" * 22 + "🎉" * 6 + "line\nline\n", 74))
@hyp_settings(max_examples=300)
def test_truncate_properties(case: tuple[str, int]) -> None:
    text, budget = case
    shaped = truncate_middle(text, budget)
    out = shaped.text.encode()
    # Never over budget, marker included; valid UTF-8 by construction of str, and every
    # kept character is one of the original's (no split characters turned into U+FFFD).
    assert len(out) <= budget
    assert "\ufffd" not in shaped.text
    # Idempotent: the shaped text fits, so shaping again changes nothing.
    assert truncate_middle(shaped.text, budget).text == shaped.text
    if not shaped.truncated:
        assert shaped.text == text
        return
    match = MARKER_RE.search(shaped.text)
    if match is None:  # degenerate budget: plain prefix
        assert text.startswith(shaped.text)
        assert shaped.omitted_bytes == size(text) - size(shaped.text)
        return
    head = shaped.text[: match.start()]
    tail = shaped.text[match.end() :]
    if head and not text.startswith(head):
        head = head.removesuffix("\n")  # the newline put before the marker
    tail = tail.removeprefix("\n")
    assert text.startswith(head) and text.endswith(tail)
    omitted = size(text) - size(head) - size(tail)
    assert int(match.group(1).replace(",", "")) == omitted == shaped.omitted_bytes
    middle = text.encode()[size(head) : size(text) - size(tail)]
    assert shaped.omitted_lines == middle.count(b"\n")
    assert match.group(2) is not None and int(match.group(2).replace(",", "")) == middle.count(
        b"\n"
    )


@given(st.text(), st.integers(min_value=0, max_value=2000))
def test_shape_text_bound_and_no_controls(text: str, budget: int) -> None:
    shaped = shape_text(text, budget)
    assert size(shaped.text) <= budget
    assert not CONTROL.search(shaped.text)
    assert shape_text(shaped.text, budget).text == shaped.text


def test_marker_size_bound_documented() -> None:
    worst = marker(10**25, 10**25, None)
    assert size(worst) + 2 <= MARKER_MAX_BYTES
    assert size(marker(10**25, 10**25, SHELL_HINT)) + 2 <= MARKER_MAX_BYTES + size(SHELL_HINT)


# --------------------------------------------------------------------------- captures


def test_shape_capture_untruncated_equals_shape_text() -> None:
    text = "\x1b[32mgreen\x1b[0m\nplain\n"
    cap = capture_of(text.encode(), 1024)
    assert shape_capture(cap, 1024).text == shape_text(text, 1024).text


@given(
    st.lists(st.sampled_from(["ab", "é", "世界", "🎉", "\n", "line of text\n"]), max_size=900),
    st.integers(min_value=256, max_value=1500),
)
@hyp_settings(max_examples=200)
def test_shape_capture_consistent_with_whole_text(pieces: list[str], budget: int) -> None:
    text = "".join(pieces)
    cap = capture_of(text.encode(), budget)
    from_capture = shape_capture(cap, budget)
    whole = shape_text(text, budget)
    assert size(from_capture.text) <= budget
    assert from_capture.truncated == whole.truncated
    assert "\ufffd" not in from_capture.text
    # Same cuts, same kept text; only the marker differs (no line count for the capture,
    # whose dropped lines were never seen).
    assert MARKER_RE.sub("MARK", from_capture.text) == MARKER_RE.sub("MARK", whole.text)
    assert from_capture.omitted_bytes == whole.omitted_bytes
    if from_capture.truncated and cap.truncated:
        assert from_capture.omitted_lines is None
        found = MARKER_RE.search(from_capture.text)
        assert found is not None and found.group(2) is None


def test_shape_capture_drops_cut_escape_sequence() -> None:
    cap = StreamCapture(head="start \x1b[3", tail="1mend", total_bytes=10_000, kept_bytes=15)
    shaped = shape_capture(cap, 1000)
    assert "\x1b" not in shaped.text and "[3" not in shaped.text
    assert shaped.text.startswith("start") and "9,985 bytes omitted" in shaped.text


# --------------------------------------------------------------------------- shell


def test_shell_ok_plain() -> None:
    backend = FakeBackend(exec_result=exec_result("hello\n"))
    result = run("shell", '{"command": "echo hello"}', backend)
    assert result.outcome == Outcome.OK
    assert result.output == "hello"
    assert result.exit_code == 0 and not result.truncated and result.error_kind is None
    assert backend.calls == [
        ("exec", {"command": "echo hello", "timeout_s": 30.0, "budget": 16384})
    ]


def test_shell_accepts_dict_arguments_and_timeout() -> None:
    backend = FakeBackend()
    result = run("shell", {"command": "sleep 1", "timeout_s": 5}, backend)
    assert result.outcome == Outcome.OK
    assert backend.calls[0][1]["timeout_s"] == 5.0


def test_shell_stderr_and_exit_code_format() -> None:
    backend = FakeBackend(exec_result=exec_result("out\n", "boom\n", exit_code=2))
    result = run("shell", {"command": "x"}, backend)
    assert result.outcome == Outcome.OK  # a failing command is still a successful call
    assert result.exit_code == 2
    assert result.output == "out\n[stderr]\nboom\n[exit code 2]"


def test_shell_stderr_only_and_no_output() -> None:
    only_err = run("shell", {"command": "x"}, FakeBackend(exec_result=exec_result("", "warn")))
    assert only_err.output == "[stderr]\nwarn"
    nothing = run("shell", {"command": "true"}, FakeBackend(exec_result=exec_result()))
    assert nothing.output == "(no output)"
    failed = run("shell", {"command": "false"}, FakeBackend(exec_result=exec_result(exit_code=1)))
    assert failed.output == "(no output)\n[exit code 1]"


def test_shell_strips_escapes_from_both_streams() -> None:
    backend = FakeBackend(exec_result=exec_result("\x1b[31mred\x1b[0m\n", "\x1b[1mbold\x1b[0m"))
    assert run("shell", {"command": "x"}, backend).output == "red\n[stderr]\nbold"


def test_shell_timeout_is_agent_error_naming_the_limit() -> None:
    backend = FakeBackend(exec_result=exec_result("partial\n", exit_code=None, timed_out=True))
    result = run("shell", {"command": "sleep 99"}, backend)
    assert result.outcome == Outcome.AGENT_ERROR
    assert result.error_kind == "timeout"
    assert result.exit_code is None
    assert result.output.startswith("partial\n[command timed out after 30 s; ")
    assert "the whole process group was killed" in result.output
    assert "at most 600 s" in result.output


def test_shell_timeout_names_custom_limit() -> None:
    backend = FakeBackend(exec_result=exec_result(exit_code=None, timed_out=True))
    result = run("shell", {"command": "sleep 99", "timeout_s": 2.5}, backend)
    assert "timed out after 2.5 s" in result.output


def test_shell_sigkill_is_ok_and_mentions_memory() -> None:
    backend = FakeBackend(exec_result=exec_result(exit_code=137, signal=9))
    result = run("shell", {"command": "x"}, backend)
    assert result.outcome == Outcome.OK
    assert result.exit_code == 137
    assert "killed by signal 9 (SIGKILL, possibly the sandbox's memory limit)" in result.output


def test_shell_exit_137_without_signal_names_sigkill() -> None:
    backend = FakeBackend(exec_result=exec_result(exit_code=137))
    result = run("shell", {"command": "a; b"}, backend)
    assert result.outcome == Outcome.OK
    assert "[exit code 137, which usually means" in result.output
    assert "SIGKILL" in result.output


def test_shell_other_signal() -> None:
    backend = FakeBackend(exec_result=exec_result(exit_code=143, signal=15))
    assert (
        run("shell", {"command": "x"}, backend).output
        == "(no output)\n[killed by signal 15 (SIGTERM)]"
    )


@pytest.mark.parametrize(
    ("stdout_len", "stderr_len"), [(100_000, 0), (0, 100_000), (100_000, 100_000), (100_000, 50)]
)
def test_shell_output_fits_budget(stdout_len: int, stderr_len: int) -> None:
    stdout = "".join(f"out {i}\n" for i in range(stdout_len // 6))
    stderr = "".join(f"err {i}\n" for i in range(stderr_len // 6))
    backend = FakeBackend(exec_result=exec_result(stdout, stderr, exit_code=1))
    result = run("shell", {"command": "x"}, backend)
    assert size(result.output) <= SETTINGS.output_budget_bytes
    assert result.truncated
    assert result.output.endswith("[exit code 1]")
    assert "bytes omitted" in result.output
    if stderr_len:
        assert "[stderr]\n" in result.output
    if stderr_len == 50:  # a short stderr is shown whole beside a huge stdout
        assert stderr in result.output + "\n"


@given(
    st.text(max_size=3000),
    st.text(max_size=3000),
    st.one_of(st.none(), st.integers(min_value=-1, max_value=255)),
    st.booleans(),
    st.integers(min_value=256, max_value=2048),
)
@hyp_settings(max_examples=150)
def test_shell_output_property(
    stdout: str, stderr: str, code: int | None, timed_out: bool, budget: int
) -> None:
    settings = Settings(output_budget_bytes=budget)
    backend = FakeBackend(
        exec_result=exec_result(stdout, stderr, exit_code=code, timed_out=timed_out, budget=budget)
    )
    result = run("shell", {"command": "x"}, backend, settings)
    assert size(result.output) <= budget
    assert not CONTROL.search(result.output)
    assert result.outcome == (Outcome.AGENT_ERROR if timed_out else Outcome.OK)


@pytest.mark.parametrize(
    ("room", "out", "err", "expected"),
    [
        (100, 10, 20, (10, 20)),
        (100, 500, 20, (80, 20)),
        (100, 20, 500, (20, 80)),
        (100, 500, 500, (50, 50)),
        (-5, 5, 5, (0, 0)),
    ],
)
def test_split_budget(room: int, out: int, err: int, expected: tuple[int, int]) -> None:
    assert split_budget(room, out, err) == expected


def test_format_seconds() -> None:
    assert format_seconds(30.0) == "30 s"
    assert format_seconds(2.5) == "2.5 s"


# --------------------------------------------------------------------------- limits hit


def limited(*hits: LimitHit, stdout: str = "", stderr: str = "", **fields: Any) -> ExecResult:
    """An exec result that hit ``hits``, as the agent reports them."""
    result = exec_result(stdout, stderr, **fields)
    return result.model_copy(
        update={"limits_hit": [h.kind for h in hits], "limit_details": list(hits)}
    )


MEMORY_KILL = LimitHit(kind="memory", limit=1024, unit="MB", killed=True, evidence="oom 0 -> 1")


def test_memory_kill_is_an_agent_error_naming_the_limit() -> None:
    result = run(
        "shell",
        {"command": "x"},
        FakeBackend(exec_result=limited(MEMORY_KILL, stdout="start\n", exit_code=137, signal=9)),
    )
    assert result.outcome == Outcome.AGENT_ERROR and result.error_kind == "memory_limit"
    assert result.exit_code == 137
    assert result.output.startswith("start\n[killed by signal 9 (SIGKILL)]\n")
    assert (
        "[the command was killed: it exceeded the sandbox's memory limit of 1024 MB."
        in result.output
    )
    assert "possibly" not in result.output


def test_memory_kill_of_a_child_names_the_process() -> None:
    result = run("shell", {"command": "x"}, FakeBackend(exec_result=limited(MEMORY_KILL)))
    assert result.outcome == Outcome.AGENT_ERROR and result.exit_code == 0
    assert result.output.startswith("(no output)\n[a process of the command was killed: it ")


def test_failed_allocation_is_a_memory_limit() -> None:
    hit = LimitHit(kind="memory", limit=768, unit="MB per process")
    backend = FakeBackend(exec_result=limited(hit, stderr="MemoryError\n", exit_code=1))
    result = run("shell", {"command": "x"}, backend)
    assert result.error_kind == "memory_limit"
    assert result.output == (
        "[stderr]\nMemoryError\n[exit code 1]\n[the command ran out of memory: allocations "
        "fail past the sandbox's memory limit of 768 MB per process. Use less memory, e.g. "
        "process the data in chunks.]"
    )


def test_pids_limit() -> None:
    hit = LimitHit(kind="pids", limit=256, unit="processes")
    result = run("shell", {"command": "x"}, FakeBackend(exec_result=limited(hit, exit_code=254)))
    assert result.outcome == Outcome.AGENT_ERROR and result.error_kind == "pids_limit"
    assert result.output.endswith(
        "[exit code 254]\n[the command hit the sandbox's process limit of 256 processes: new "
        "processes could not be started. Run fewer processes at once.]"
    )


def test_command_that_could_not_start_for_pids_is_an_agent_error() -> None:
    reply = {
        "spawn_error": "BlockingIOError: [Errno 11] Resource temporarily unavailable",
        "limits_hit": ["pids"],
        "limit_details": [{"kind": "pids", "limit": 64, "unit": "processes", "evidence": "x"}],
    }
    backend = FakeBackend(exec_result=agent_client.exec_result(reply))
    result = run("shell", {"command": "ls"}, backend)
    assert result.outcome == Outcome.AGENT_ERROR and result.error_kind == "pids_limit"
    assert result.exit_code is None
    assert result.output.startswith("[stderr]\ncould not start the command: BlockingIOError")
    assert "[the command could not start: processes left running by earlier commands" in (
        result.output
    )
    assert "process limit of 64 processes.]" in result.output


def test_spawn_failure_not_blamed_on_the_agent_is_ours() -> None:
    with pytest.raises(agent_client.CommandSpawnFailed):
        agent_client.exec_result({"spawn_error": "OSError: [Errno 12] Cannot allocate memory"})


def test_disk_limits_name_each_full_filesystem() -> None:
    hits = [
        LimitHit(kind="disk", limit=2048, unit="MB", path="/workspace"),
        LimitHit(kind="disk", limit=256, unit="MB", path="/tmp"),
    ]
    backend = FakeBackend(exec_result=limited(*hits, stderr="No space left\n", exit_code=1))
    result = run("shell", {"command": "x"}, backend)
    assert result.outcome == Outcome.AGENT_ERROR and result.error_kind == "disk_limit"
    assert (
        "[/workspace is full: the command hit the sandbox's limit of 2048 MB for /workspace."
        in (result.output)
    )
    assert "[/tmp is full: the command hit the sandbox's limit of 256 MB for /tmp." in result.output


def test_output_limit_keeps_head_and_tail() -> None:
    hit = LimitHit(kind="output", limit=64, unit="MB", killed=True)
    flood = "y\n" * 20_000
    backend = FakeBackend(exec_result=limited(hit, stdout=flood, exit_code=None, signal=9))
    result = run("shell", {"command": "yes"}, backend)
    assert result.outcome == Outcome.AGENT_ERROR and result.error_kind == "output_limit"
    assert result.truncated and size(result.output) <= SETTINGS.output_budget_bytes
    assert result.output.startswith("y\ny\n") and "bytes omitted" in result.output
    assert result.output.endswith(
        "y\n[the command was killed: its output exceeded the sandbox's output limit of 64 MB; "
        "only its start and end are shown. Filter it (grep, head, tail) or redirect it to a "
        "file and read_file parts of it.]"
    )
    assert "signal" not in result.output


def test_the_cause_names_the_error_kind_when_several_limits_are_hit() -> None:
    pids = LimitHit(kind="pids", limit=64, unit="processes")
    timeout = LimitHit(kind="timeout", limit=5, unit="s", killed=True)
    backend = FakeBackend(
        exec_result=limited(pids, timeout, exit_code=None, signal=9, timed_out=True)
    )
    result = run("shell", {"command": "bomb", "timeout_s": 5}, backend)
    assert result.error_kind == "pids_limit"
    lines = result.output.splitlines()
    assert lines[-2].startswith("[the command hit the sandbox's process limit of 64 processes")
    assert lines[-1].startswith("[command timed out after 5 s;")


def test_a_reply_without_limits_is_read_as_before() -> None:
    old = {
        "exit_code": None,
        "signal": 9,
        "timed_out": True,
        "stdout": {"head": "", "tail": "", "total_bytes": 0, "kept_bytes": 0},
        "stderr": {"head": "", "tail": "", "total_bytes": 0, "kept_bytes": 0},
        "duration_ms": 5.0,
    }
    result = agent_client.exec_result(old)
    assert result.limits_hit == ["timeout"] and result.limit_details == []
    ok = agent_client.exec_result({**old, "exit_code": 0, "signal": None, "timed_out": False})
    assert ok.limits_hit == []


@given(
    st.lists(st.sampled_from(["memory", "pids", "disk", "output", "timeout"]), unique=True),
    st.integers(min_value=256, max_value=2048),
    st.text(max_size=2000),
)
@hyp_settings(max_examples=100)
def test_limits_output_property(kinds: list[str], budget: int, stdout: str) -> None:
    hits = [LimitHit(kind=k, limit=123, unit="MB", path="/tmp") for k in kinds]
    settings = Settings(output_budget_bytes=budget)
    result = run(
        "shell",
        {"command": "x"},
        FakeBackend(exec_result=limited(*hits, stdout=stdout, budget=budget, exit_code=1)),
        settings,
    )
    assert size(result.output) <= budget
    assert result.outcome == (Outcome.AGENT_ERROR if kinds else Outcome.OK)


# --------------------------------------------------------------------------- the agent's evidence


def test_a_filesystem_is_full_near_its_end_or_out_of_inodes() -> None:
    mb = 1 << 20
    assert agent_limits.is_full((100 * 1024, 64 * mb, 100))
    assert not agent_limits.is_full((10 * mb, 64 * mb, 100))
    assert agent_limits.is_full((10 * mb, 64 * mb, 0))
    assert not agent_limits.is_full((10 * mb, 64 * mb, -1)), "-1: inodes not counted (gVisor)"
    assert agent_limits.is_full((4 * mb, 2048 * mb, 100))
    assert not agent_limits.is_full((9 * mb, 2048 * mb, 100))


def test_agent_limits_read_only_capped_filesystems_and_counters() -> None:
    limits = agent_limits.Limits(
        {"memory_mb": 512, "pids": 64, "output_mb": 8, "disk": {"/workspace": 0, "/tmp": 32}},
        uid=1000,
        limit_as_mb=384,
        limit_nproc=64,
    )
    limits.counters = {}  # this host's own cgroup counters are not the sandbox's
    assert limits.disks == {"/tmp": 32}, "an uncapped /workspace is the host's disk"
    assert limits.output_bytes == 8 << 20
    snapshot = limits.snapshot()
    # Out-of-memory text counts only under RLIMIT_AS and for a command that failed.
    texts = ["Traceback ...\nMemoryError\n"]
    [memory] = limits.hits(snapshot, failed=True, texts=texts, nproc_full=None)
    assert memory["kind"] == "memory" and memory["limit"] == 384
    assert memory["unit"] == "MB per process" and not memory["killed"]
    assert limits.hits(snapshot, failed=False, texts=texts, nproc_full=None) == []
    [pids] = limits.hits(snapshot, failed=False, texts=[], nproc_full="it held 64")
    assert pids["kind"] == "pids" and pids["limit"] == 64 and pids["evidence"] == "it held 64"


# A uid nothing else on the machine runs as, so its processes are exactly the test's.
IDLE_UID = 61_917


@pytest.mark.skipif(os.geteuid() != 0, reason="starts processes as another user")
def test_a_failed_fork_with_half_the_process_limit_held_is_the_limit() -> None:
    """A fork bomb churns faster than /proc can be walked (under gVisor, on a loaded host):
    one walk may count well under the limit. A failed fork in the output with half the
    limit held is evidence enough; the same text from a user holding a few is not."""
    sleepers = [subprocess.Popen(["sleep", "60"], user=IDLE_UID, group=IDLE_UID) for _ in range(6)]
    try:
        assert agent_limits.user_tasks(IDLE_UID) == 6

        def evidence(limit: int, fork_failed: bool) -> str | None:
            limits = agent_limits.Limits({"pids": limit}, IDLE_UID, None, limit)
            return limits.processes_at_limit(fork_failed=fork_failed)

        assert evidence(7, fork_failed=False) == "the agent's user held its RLIMIT_NPROC of 7"
        assert evidence(12, fork_failed=False) is None
        assert evidence(12, fork_failed=True) == (
            "fork failed with EAGAIN while the agent's user ran 6 tasks under RLIMIT_NPROC 12"
        )
        assert evidence(13, fork_failed=True) is None, "fewer than half the limit: not its doing"
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()


# --------------------------------------------------------------------------- shell errors


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ('{"command": "ls"', "not valid JSON"),
        ("[1, 2]", "must be a JSON object, got array"),
        ('"ls"', "must be a JSON object, got string"),
        ("{}", "command: required argument is missing"),
        ("", "command: required argument is missing"),
        ({"cmd": "ls"}, "cmd: unknown argument (allowed: command, timeout_s)"),
        ({"command": "ls", "cwd": "/"}, "cwd: unknown argument"),
        ({"command": "ls", "timeot": 3}, "did you mean timeout_s?"),
        ({"command": 5}, "command: input should be a valid string, got integer 5"),
        ({"command": ["ls"]}, "got array"),
        ({"command": ""}, "command: string should have at least 1 character"),
        ({"command": "   "}, "command is blank"),
        ({"command": "a\x00b"}, "NUL"),
        ('{"command": "echo \\ud800"}', "unable to parse raw data as a unicode string"),
        ({"command": "x" * (64 * 1024 + 1)}, "at most 65536 characters"),
        ({"command": "ls", "timeout_s": 0}, "timeout_s: input should be greater than 0"),
        ({"command": "ls", "timeout_s": -1}, "greater than 0"),
        ({"command": "ls", "timeout_s": 601}, "timeout_s must be at most 600 s"),
        ({"command": "ls", "timeout_s": "30"}, "timeout_s: input should be a valid number"),
        ({"command": "ls", "timeout_s": True}, "got boolean true"),
        ('{"command": "ls", "timeout_s": NaN}', "finite number"),
    ],
)
def test_shell_argument_errors(arguments: Any, expected: str) -> None:
    backend = FakeBackend()
    result = run("shell", arguments, backend)
    assert result.outcome == Outcome.AGENT_ERROR
    assert result.error_kind == "invalid_arguments"
    assert expected in result.output, result.output
    assert backend.calls == []  # the backend is never called for bad arguments
    assert size(result.output) <= SETTINGS.output_budget_bytes


def test_argument_error_lists_every_problem_and_usage() -> None:
    result = run("shell", {"timeout_s": "x", "extra": 1}, FakeBackend())
    lines = result.output.splitlines()
    assert lines[0] == "invalid arguments for shell:"
    assert any(line.startswith("- command:") for line in lines)
    assert any(line.startswith("- timeout_s:") for line in lines)
    assert any(line.startswith("- extra:") for line in lines)
    assert lines[-1].startswith('usage: shell {"command": string')


def test_timeout_max_follows_settings() -> None:
    settings = Settings(command_timeout_max_s=60, command_timeout_s=10)
    backend = FakeBackend()
    assert (
        "at most 60 s" in run("shell", {"command": "x", "timeout_s": 61}, backend, settings).output
    )
    run("shell", {"command": "x"}, backend, settings)
    assert backend.calls[-1][1]["timeout_s"] == 10


def test_sandbox_errors_propagate() -> None:
    for error in (SandboxError("x"), SandboxUnavailable("gone"), BackendUnavailable("down")):
        with pytest.raises(type(error)):
            run("shell", {"command": "ls"}, FakeBackend(error=error))
        with pytest.raises(type(error)):
            run("read_file", {"path": "a.py"}, FakeBackend(error=error))


def test_unknown_tool() -> None:
    with pytest.raises(UnknownToolError) as info:
        get_tool("rm")
    assert isinstance(info.value, KeyError)
    result = run_tool("rm", FakeBackend(), HANDLE, "{}", SETTINGS)
    assert result.outcome == Outcome.AGENT_ERROR and result.error_kind == "unknown_tool"
    assert "available tools: shell, read_file" in result.output


# --------------------------------------------------------------------------- read_file


def numbered(first: int, lines: list[str]) -> str:
    return "".join(f"{n:>6}\t{line}\n" for n, line in enumerate(lines, start=first))


def test_read_file_whole() -> None:
    backend = FakeBackend(files={"src/a.py": "import os\n\nprint(1)\n"})
    result = run("read_file", {"path": "src/a.py"}, backend)
    assert result.outcome == Outcome.OK
    assert result.output == numbered(1, ["import os", "", "print(1)"]).removesuffix("\n")
    assert not result.truncated
    assert backend.calls[0][1]["max"] == min(SETTINGS.read_file_max_bytes, 16384)


def test_read_file_without_final_newline_and_workspace_prefix() -> None:
    backend = FakeBackend(files={"a.txt": "one\ntwo"})
    result = run("read_file", '{"path": "/workspace/a.txt"}', backend)
    assert result.output == "     1\tone\n     2\ttwo"


def test_read_file_range() -> None:
    backend = FakeBackend(files={"a.txt": "".join(f"l{i}\n" for i in range(1, 121))})
    result = run("read_file", {"path": "a.txt", "start_line": 10, "end_line": 12}, backend)
    assert result.output == numbered(10, ["l10", "l11", "l12"]) + "[showing lines 10-12 of 120]"
    assert not result.truncated
    end = run("read_file", {"path": "a.txt", "start_line": 119, "end_line": 500}, backend)
    assert end.output.endswith("[showing lines 119-120 of 120 (end of file)]")
    one = run("read_file", {"path": "a.txt", "start_line": 5, "end_line": 5}, backend)
    assert one.output == "     5\tl5\n[showing line 5 of 120]"


def test_read_file_cut_by_budget_says_where_to_continue() -> None:
    settings = Settings(output_budget_bytes=1024)
    content = "".join(f"this is line number {i}\n" for i in range(1, 2001))
    backend = FakeBackend(files={"big.txt": content})
    result = run("read_file", {"path": "big.txt"}, backend, settings)
    assert result.outcome == Outcome.OK and result.truncated
    assert size(result.output) <= 1024
    footer = result.output.splitlines()[-1]
    match = re.fullmatch(
        r"\[showing lines 1-(\d+) of 2000; output limit of 1,024 bytes reached: "
        r"call read_file with start_line=(\d+) to read on\]",
        footer,
    )
    assert match, footer
    last, following = int(match.group(1)), int(match.group(2))
    assert following == last + 1
    assert result.output.splitlines()[-2] == f"{last:>6}\tthis is line number {last}"
    # Following the advice continues exactly where it stopped.
    more = run("read_file", {"path": "big.txt", "start_line": following}, backend, settings)
    assert more.output.startswith(f"{following:>6}\tthis is line number {following}\n")


def test_read_file_long_line_is_cut_with_shell_hint() -> None:
    settings = Settings(output_budget_bytes=512)
    backend = FakeBackend(files={"min.js": "x" * 500 + "\nshort\n"})
    result = run("read_file", {"path": "min.js"}, backend, settings)
    assert size(result.output) <= 512
    assert result.truncated
    assert "line 1 continues" in result.output and "sed -n '1p' min.js | cut -b" in result.output
    assert result.output.endswith("start_line=2 to read on]")


def test_read_file_line_longer_than_read_limit() -> None:
    settings = Settings(output_budget_bytes=512)
    backend = FakeBackend(files={"min.js": "x" * 5000 + "\n"})
    result = run("read_file", {"path": "min.js"}, backend, settings)
    assert result.outcome == Outcome.OK and result.truncated
    assert "sed -n '1p' min.js | cut -b 1-8000" in result.output


def test_read_file_empty() -> None:
    result = run("read_file", {"path": "e.txt"}, FakeBackend(files={"e.txt": ""}))
    assert result.outcome == Outcome.OK and result.output == "(empty file)"


def test_read_file_past_end_is_agent_error() -> None:
    backend = FakeBackend(files={"a.txt": "1\n2\n"})
    result = run("read_file", {"path": "a.txt", "start_line": 50}, backend)
    assert result.outcome == Outcome.AGENT_ERROR and result.error_kind == "out_of_range"
    assert result.output == "start_line 50 is past the end of a.txt: the file has 2 lines"


def test_read_file_cleans_control_chars_keeping_numbering() -> None:
    backend = FakeBackend(files={"a.txt": "\x1b[31mred\x1b[0m\ra\x07\nnext\n"})
    result = run("read_file", {"path": "a.txt"}, backend)
    assert result.output == "     1\tred a\n     2\tnext"


@pytest.mark.parametrize(
    "kind", ["not_found", "is_directory", "binary", "outside_workspace", "permission", "invalid"]
)
def test_read_file_errors_are_agent_errors(kind: Any) -> None:
    backend = FakeBackend(error=FileError(kind, f"x.bin: {kind} message"))
    result = run("read_file", {"path": "x.bin"}, backend)
    assert result.outcome == Outcome.AGENT_ERROR
    assert result.error_kind == kind
    assert result.output == f"x.bin: {kind} message"


def test_read_file_missing_file_from_fake_reader() -> None:
    result = run("read_file", {"path": "nope.py"}, FakeBackend())
    assert result.error_kind == "not_found" and "no such file" in result.output


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({"path": "/etc/passwd"}, "/etc/passwd is outside /workspace"),
        ({"path": "/workspacex/a"}, "outside /workspace"),
        ({"path": "../etc/passwd"}, "escapes /workspace through '..'"),
        ({"path": "src/../../x"}, "escapes /workspace"),
        ({"path": "/workspace/../etc/passwd"}, "escapes /workspace"),
        ({"path": ".."}, "escapes /workspace"),
        ({"path": ""}, "path: string should have at least 1 character"),
        ({"path": "a\x00b"}, "NUL"),
        ({"path": "a\udc80"}, "unable to parse raw data as a unicode string"),
        ({}, "path: required argument is missing"),
        ({"path": 3}, "path: input should be a valid string"),
        ({"path": "a", "start_line": 0}, "start_line: input should be greater than or equal to 1"),
        ({"path": "a", "start_line": "2"}, "start_line: input should be a valid integer"),
        ({"path": "a", "start_line": 1.5}, "valid integer"),
        ({"path": "a", "start_line": 5, "end_line": 4}, "end_line (4) must be >= start_line (5)"),
        (
            {"path": "a", "lines": "1-5"},
            "lines: unknown argument (allowed: path, start_line, end_line)",
        ),
        ('{"path": }', "not valid JSON"),
        ('{"path": }', 'usage: read_file {"path": string'),
    ],
)
def test_read_file_argument_errors(arguments: Any, expected: str) -> None:
    backend = FakeBackend(files={"a": "x\n"})
    result = run("read_file", arguments, backend)
    assert result.outcome == Outcome.AGENT_ERROR
    assert result.error_kind == "invalid_arguments"
    assert expected in result.output, result.output
    assert backend.calls == []


@pytest.mark.parametrize(
    ("path", "relative"),
    [
        ("a.py", "a.py"),
        ("/workspace/a.py", "a.py"),
        ("/workspace", "."),
        ("a/../b", "b"),
        ("./src//x", "src/x"),
    ],
)
def test_workspace_relative(path: str, relative: str) -> None:
    assert workspace_relative(path) == relative


def test_nullable_optional_arguments_accepted() -> None:
    # Strict-mode function calling sends null for optional arguments.
    assert ShellArgs.model_validate({"command": "ls", "timeout_s": None}).timeout_s is None
    args = ReadFileArgs.model_validate({"path": "a", "start_line": None, "end_line": None})
    assert args.start_line is None


@given(
    st.lists(st.text(alphabet=st.characters(blacklist_characters="\n"), max_size=80), max_size=200),
    st.integers(min_value=256, max_value=4096),
    st.integers(min_value=1, max_value=220),
)
@hyp_settings(max_examples=100)
def test_read_file_output_property(lines: list[str], budget: int, start: int) -> None:
    settings = Settings(output_budget_bytes=budget)
    content = "".join(line + "\n" for line in lines).encode("utf-8", "replace").decode()
    backend = FakeBackend(files={"f": content})
    result = run("read_file", {"path": "f", "start_line": start}, backend, settings)
    assert size(result.output) <= budget
    assert not CONTROL.search(result.output)


# --------------------------------------------------------------------------- schemas


def test_tool_schemas_shape() -> None:
    schemas = tool_schemas(SETTINGS)
    assert [s["name"] for s in schemas] == ["shell", "read_file"] == list(TOOLS)
    for schema in schemas:
        assert schema["type"] == "function"
        assert set(schema) == {"type", "name", "description", "parameters", "strict"}
        assert schema["strict"] is False
        params = schema["parameters"]
        assert params["type"] == "object"
        assert params["additionalProperties"] is False
        assert "title" not in json.dumps(params)
        assert "anyOf" not in json.dumps(params)
        assert set(params["properties"]) == set(TOOLS[schema["name"]].args_model.model_fields)
    shell = schemas[0]["parameters"]
    assert shell["required"] == ["command"]
    assert shell["properties"]["timeout_s"]["type"] == "number"
    assert shell["properties"]["timeout_s"]["maximum"] == 600
    assert "Default 30 s" in shell["properties"]["timeout_s"]["description"]
    assert shell["properties"]["command"]["maxLength"] == 65536
    read = schemas[1]["parameters"]
    assert read["required"] == ["path"]
    assert read["properties"]["start_line"] == {
        "description": "First line to show, 1-based. Default 1.",
        "minimum": 1,
        "type": "integer",
    }


def test_tool_schemas_strict() -> None:
    schemas = tool_schemas(SETTINGS, strict=True)
    for schema in schemas:
        params = schema["parameters"]
        assert schema["strict"] is True
        assert params["required"] == list(params["properties"])
        assert "minLength" not in json.dumps(params) and "default" not in json.dumps(params)
    assert schemas[0]["parameters"]["properties"]["timeout_s"]["type"] == ["number", "null"]
    assert schemas[0]["parameters"]["properties"]["command"]["type"] == "string"
    assert schemas[1]["parameters"]["properties"]["end_line"]["type"] == ["integer", "null"]


def test_tool_schemas_are_json_serialisable() -> None:
    json.dumps(tool_schemas(SETTINGS))
    json.dumps(tool_schemas(SETTINGS, strict=True))


# -- tools decided on the API side (issue 33): the worker runs an operation, not a tool ----


@pytest.mark.parametrize(
    ("name", "raw", "files"),
    [
        ("shell", '{"command": "ls -la", "timeout_s": 5}', {}),
        ("shell", {"command": "echo hi"}, {}),
        ("read_file", {"path": "src/main.py", "start_line": 2, "end_line": 9}, None),
        ("read_file", {"path": "missing.py"}, {}),
    ],
)
def test_a_call_split_across_the_wire_is_the_call_run_whole(
    name: str, raw: Any, files: dict[str, str] | None
) -> None:
    """The API parses, decides the operation and shapes its result; the worker runs the
    operation from its JSON, knowing no tool: the same as running the tool in one place."""
    tool = get_tool(name)
    files = {"src/main.py": "".join(f"line {n}\n" for n in range(20))} if files is None else files
    parsed = tool.parse(raw, SETTINGS)
    request = RunOp(
        rollout_id="r",
        call_id="c",
        ticket="t",
        attempt="a",
        handle=HANDLE,
        op=tool.operation(parsed, SETTINGS),
        enqueued_at=0.0,
    )
    sent = RunOp.model_validate_json(request.model_dump_json())
    by_worker, by_tool = FakeBackend(files=files), FakeBackend(files=files)
    done = OpDone(outcome=by_worker.run_op(sent.handle, sent.op))
    back = OpDone.model_validate_json(done.model_dump_json())
    assert not isinstance(back.outcome, (InfraFault, SandboxKilled))
    split = tool.result(parsed, SETTINGS, back.outcome)
    whole = tool.run(by_tool, HANDLE, raw, SETTINGS)
    assert by_worker.calls == by_tool.calls
    assert split.model_dump(exclude={"duration_ms"}) == whole.model_dump(exclude={"duration_ms"})
    if name == "read_file" and not files:
        assert split.outcome == Outcome.AGENT_ERROR and split.error_kind == "not_found"


def test_an_operation_carries_the_limits_the_api_decided() -> None:
    """The command's timeout and the output budget travel in the operation: the worker
    needs no settings of its own (Agent RFT's capped timeout included)."""
    capped = SETTINGS.model_copy(update={"command_timeout_s": 7.0, "output_budget_bytes": 999})
    op = get_tool("shell").operation(get_tool("shell").parse({"command": "x"}, capped), capped)
    assert isinstance(op, ExecOp)
    assert (op.timeout_s, op.output_budget_bytes) == (7.0, 999)
    read = get_tool("read_file")
    op = read.operation(read.parse({"path": "a"}, capped), capped)
    assert isinstance(op, ReadOp) and op.max_bytes == 999
