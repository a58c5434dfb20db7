"""The model's tools (``shell``, ``read_file``) through ``run_tool``, against real sandboxes
on every available runtime, and on a real codebase image as an agent would use them."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import Runtime, Settings
from orchestrator.images.codebases import (
    UnknownCodebase,
    add_codebase,
    codebase_image,
    remove_codebase,
)
from orchestrator.outcomes import Outcome
from orchestrator.sandbox.backend import SandboxHandle, SandboxSpec
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.tools.registry import run_tool
from tests.sandbox_scripts import PIDS_FILLER

pytestmark = pytest.mark.xdist_group("tools_sandbox")


def shell(backend: DockerBackend, handle: SandboxHandle, command: str) -> str:
    """Run a setup command through the backend directly; its stdout."""
    result = backend.exec(handle, command, timeout_s=20, output_budget_bytes=64 * 1024)
    assert result.exit_code == 0, result
    return result.stdout.head + result.stdout.tail


@pytest.fixture()
def sandbox(make_sandbox: Any, runtime: Runtime) -> SandboxHandle:
    handle: SandboxHandle = make_sandbox(runtime=runtime)
    return handle


@pytest.fixture()
def workdir(backend: DockerBackend, shared_sandbox: SandboxHandle) -> Iterator[str]:
    """A fresh directory (relative to /workspace) in the shared sandbox, removed after."""
    name = f"tools-{uuid.uuid4().hex[:10]}"
    shell(backend, shared_sandbox, f"mkdir /workspace/{name}")
    yield name
    shell(backend, shared_sandbox, f"rm -rf /workspace/{name}")


# -- on every runtime ------------------------------------------------------------------------


def test_shell_non_zero_exit_is_ok_with_the_exit_code(
    backend: DockerBackend, sandbox: SandboxHandle, settings: Settings
) -> None:
    result = run_tool(
        "shell", backend, sandbox, {"command": "echo out; echo err >&2; exit 3"}, settings
    )
    assert result.outcome == Outcome.OK
    assert result.exit_code == 3
    assert result.output == "out\n[stderr]\nerr\n[exit code 3]"
    assert not result.truncated and result.error_kind is None
    assert result.duration_ms > 0

    quiet = run_tool("shell", backend, sandbox, {"command": "true"}, settings)
    assert quiet.outcome == Outcome.OK and quiet.exit_code == 0
    assert quiet.output == "(no output)"


def test_shell_timeout_is_an_agent_error_naming_the_limit(
    backend: DockerBackend, sandbox: SandboxHandle, settings: Settings
) -> None:
    started = time.monotonic()
    result = run_tool(
        "shell", backend, sandbox, {"command": "echo started; sleep 30", "timeout_s": 1}, settings
    )
    assert time.monotonic() - started < 6
    assert result.outcome == Outcome.AGENT_ERROR
    assert result.error_kind == "timeout"
    assert result.exit_code is None
    assert result.output.startswith("started\n")
    assert "[command timed out after 1 s;" in result.output
    assert f"at most {settings.command_timeout_max_s:g} s" in result.output


def test_shell_output_flood_is_truncated_within_the_budget(
    backend: DockerBackend, sandbox: SandboxHandle, settings: Settings
) -> None:
    result = run_tool("shell", backend, sandbox, {"command": "seq 1 300000"}, settings)
    assert result.outcome == Outcome.OK and result.exit_code == 0
    assert result.truncated
    assert len(result.output.encode()) <= settings.output_budget_bytes
    assert result.output.startswith("1\n2\n3\n")
    assert result.output.endswith("299999\n300000")
    assert "bytes omitted; narrow the command" in result.output

    # Both streams flooded: each is cut, and the whole still fits.
    both = run_tool(
        "shell",
        backend,
        sandbox,
        {"command": "yes out | head -c 3000000; yes err | head -c 3000000 >&2; exit 1"},
        settings,
    )
    assert both.truncated and len(both.output.encode()) <= settings.output_budget_bytes
    assert both.output.startswith("out\n")
    assert "\n[stderr]\nerr\n" in both.output
    assert both.output.endswith("err\n[exit code 1]")
    assert both.output.count("omitted") == 2


def test_shell_strips_ansi_escapes(
    backend: DockerBackend, sandbox: SandboxHandle, settings: Settings
) -> None:
    command = (
        r"printf '\033[31mred\033[0m and \033[1;32mbold green\033[0m\n';"
        r" printf '\033]0;title\007x\n'"
    )
    result = run_tool("shell", backend, sandbox, {"command": command}, settings)
    assert result.outcome == Outcome.OK
    assert result.output == "red and bold green\nx"
    assert "\x1b" not in result.output


# -- limits the agent's command hits: agent_error naming the limit, never infra -----------


def assert_healthy(backend: DockerBackend, handle: SandboxHandle) -> None:
    probe = backend.probe(handle)
    assert probe.alive and probe.agent_ok and probe.agent_caused is None, probe
    assert shell(backend, handle, "echo alive") == "alive\n"


def test_filling_the_workspace_is_a_disk_limit_error(
    make_sandbox: Any, backend: DockerBackend, runtime: Runtime, settings: Settings
) -> None:
    handle = make_sandbox(runtime=runtime, limits={"disk_mb": 48})
    command = "echo writing; dd if=/dev/zero of=/workspace/fill bs=1M count=100"
    result = run_tool("shell", backend, handle, {"command": command}, settings)
    assert result.outcome == Outcome.AGENT_ERROR and result.error_kind == "disk_limit", result
    assert result.output.startswith("writing\n[stderr]\ndd: error writing")
    assert "No space left on device" in result.output
    assert "[/workspace is full: the command hit the sandbox's limit of 48 MB for /workspace." in (
        result.output
    )
    image = backend.workspaces.image_path(handle.sandbox_id)
    assert image.stat().st_blocks * 512 <= 49 << 20, "the host file never grows past the cap"
    assert_healthy(backend, handle)


def test_filling_tmp_is_a_disk_limit_error(
    make_sandbox: Any, backend: DockerBackend, runtime: Runtime, settings: Settings
) -> None:
    handle = make_sandbox(runtime=runtime, limits={"tmp_mb": 16, "memory_mb": 256})
    writer = (
        "python3 -c 'import os\n"
        'with open("/tmp/fill", "wb") as f:\n'
        "    while True: f.write(os.urandom(1 << 16))'"
    )
    result = run_tool("shell", backend, handle, {"command": writer}, settings)
    assert result.outcome == Outcome.AGENT_ERROR and result.error_kind == "disk_limit", result
    assert "[/tmp is full: the command hit the sandbox's limit of 16 MB for /tmp." in result.output
    assert_healthy(backend, handle)


def test_a_memory_hog_is_a_memory_limit_error(
    make_sandbox: Any, backend: DockerBackend, runtime: Runtime, settings: Settings
) -> None:
    handle = make_sandbox(runtime=runtime, limits={"memory_mb": 128})
    hog = "echo start; python3 -c 'x = bytearray(512 << 20); print(len(x))'"
    result = run_tool("shell", backend, handle, {"command": hog}, settings)
    assert result.outcome == Outcome.AGENT_ERROR and result.error_kind == "memory_limit", result
    assert result.output.startswith("start\n")
    if runtime == "runc":
        assert "[the command was killed: it exceeded the sandbox's memory limit of 128 MB." in (
            result.output
        )
    else:
        assert "MemoryError" in result.output
        assert "memory limit of 96 MB per process." in result.output
    assert_healthy(backend, handle)


def test_a_fork_bomb_is_a_pids_limit_error(
    make_sandbox: Any, backend: DockerBackend, runtime: Runtime, settings: Settings
) -> None:
    handle = make_sandbox(runtime=runtime, limits={"pids": 48})
    bomb = {"command": "bomb() { bomb | bomb & }; bomb; sleep 2", "timeout_s": 6}
    result = run_tool("shell", backend, handle, bomb, settings)
    assert result.outcome == Outcome.AGENT_ERROR and result.error_kind == "pids_limit", result
    assert "the sandbox's process limit of 48 processes" in result.output
    time.sleep(0.5)
    assert_healthy(backend, handle)


def test_an_output_flood_is_an_output_limit_error(
    make_sandbox: Any, backend: DockerBackend, runtime: Runtime, settings: Settings
) -> None:
    handle = make_sandbox(runtime=runtime, limits={"output_mb": 4})
    started = time.monotonic()
    result = run_tool("shell", backend, handle, {"command": "echo first; yes"}, settings)
    assert time.monotonic() - started < settings.command_timeout_s / 2, "killed, not timed out"
    assert result.outcome == Outcome.AGENT_ERROR and result.error_kind == "output_limit", result
    assert result.truncated and len(result.output.encode()) <= settings.output_budget_bytes
    assert result.output.startswith("first\ny\ny\n") and "bytes omitted" in result.output
    assert result.output.endswith(
        "y\n[the command was killed: its output exceeded the sandbox's output limit of 4 MB; "
        "only its start and end are shown. Filter it (grep, head, tail) or redirect it to a "
        "file and read_file parts of it.]"
    )
    assert_healthy(backend, handle)


def test_a_pids_limit_filled_by_leftovers_is_the_agents_error(
    make_sandbox: Any, backend: DockerBackend, runtime: Runtime, settings: Settings
) -> None:
    handle = make_sandbox(runtime=runtime, limits={"pids": 32})
    # Processes that escaped their command (setsid) keep the process limit full.
    filler = PIDS_FILLER
    run_tool("shell", backend, handle, {"command": filler}, settings)
    time.sleep(1)
    calls: list[tuple[str, dict[str, Any]]] = [
        ("shell", {"command": "ls /", "timeout_s": 3}),
        ("read_file", {"path": "anything"}),
    ]
    for name, arguments in calls:
        result = run_tool(name, backend, handle, arguments, settings)
        if runtime == "runsc" and name == "read_file":
            # gVisor limits the user's processes (RLIMIT_NPROC), not the agent's own: it
            # still reads files.
            assert result.error_kind == "not_found", result
            continue
        assert result.outcome == Outcome.AGENT_ERROR, (name, result)
        assert result.error_kind == "pids_limit", (name, result)
        assert "32 processes" in result.output, result.output


def test_commands_that_attack_the_sandbox_are_not_infrastructure_errors(
    make_sandbox: Any, backend: DockerBackend, runtime: Runtime, settings: Settings
) -> None:
    handle = make_sandbox(runtime=runtime)
    for command in [
        "kill -9 -1",
        "rm -rf --no-preserve-root / 2>/dev/null; echo done",
        "kill -9 -1; sleep 1",
    ]:
        result = run_tool("shell", backend, handle, {"command": command}, settings)
        assert result.outcome in (Outcome.OK, Outcome.AGENT_ERROR), (command, result)
        assert_healthy(backend, handle)


def test_read_file_numbers_lines_and_names_the_range(
    backend: DockerBackend, sandbox: SandboxHandle, settings: Settings
) -> None:
    shell(backend, sandbox, "seq -f 'line %g' 1 20 > notes.txt")
    whole = run_tool("read_file", backend, sandbox, {"path": "notes.txt"}, settings)
    assert whole.outcome == Outcome.OK and not whole.truncated
    lines = whole.output.split("\n")
    assert len(lines) == 20
    assert lines[0] == "     1\tline 1" and lines[-1] == "    20\tline 20"

    part = run_tool(
        "read_file",
        backend,
        sandbox,
        {"path": "/workspace/notes.txt", "start_line": 5, "end_line": 7},
        settings,
    )
    assert part.outcome == Outcome.OK
    assert part.output == (
        "     5\tline 5\n     6\tline 6\n     7\tline 7\n[showing lines 5-7 of 20]"
    )
    tail = run_tool(
        "read_file", backend, sandbox, {"path": "notes.txt", "start_line": 19}, settings
    )
    assert tail.output.endswith("[showing lines 19-20 of 20 (end of file)]")

    past = run_tool(
        "read_file", backend, sandbox, {"path": "notes.txt", "start_line": 50}, settings
    )
    assert past.outcome == Outcome.AGENT_ERROR and past.error_kind == "out_of_range"
    assert "20 lines" in past.output


def test_read_file_of_a_binary_is_an_agent_error(
    backend: DockerBackend, sandbox: SandboxHandle, settings: Settings
) -> None:
    shell(backend, sandbox, "cp /bin/ls ls.bin")
    result = run_tool("read_file", backend, sandbox, {"path": "ls.bin"}, settings)
    assert result.outcome == Outcome.AGENT_ERROR
    assert result.error_kind == "binary"
    assert "binary" in result.output
    missing = run_tool("read_file", backend, sandbox, {"path": "nope.txt"}, settings)
    assert missing.outcome == Outcome.AGENT_ERROR and missing.error_kind == "not_found"


# -- argument handling (one runtime is enough) -----------------------------------------------


def test_arguments_as_a_json_string(
    backend: DockerBackend, shared_sandbox: SandboxHandle, settings: Settings, workdir: str
) -> None:
    arguments = json.dumps({"command": f"cd {workdir} && echo 'a \"quoted\" ünï' | tee f.txt"})
    result = run_tool("shell", backend, shared_sandbox, arguments, settings)
    assert result.outcome == Outcome.OK
    assert result.output == 'a "quoted" ünï'
    read = run_tool(
        "read_file", backend, shared_sandbox, json.dumps({"path": f"{workdir}/f.txt"}), settings
    )
    assert read.outcome == Outcome.OK and read.output == '     1\ta "quoted" ünï'
    # A float timeout given as an integer is accepted.
    whole_seconds = run_tool(
        "shell", backend, shared_sandbox, '{"command": "echo ok", "timeout_s": 5}', settings
    )
    assert whole_seconds.outcome == Outcome.OK and whole_seconds.output == "ok"


def test_bad_calls_are_agent_errors_and_never_reach_the_sandbox(
    backend: DockerBackend, shared_sandbox: SandboxHandle, settings: Settings, workdir: str
) -> None:
    marker = f"/workspace/{workdir}/touched"
    touch = f"touch {marker}"
    calls: list[tuple[str, Any, str, str]] = [
        ("shell", '{"command": "' + touch + '"', "invalid_arguments", "not valid JSON"),
        ("shell", f'["{touch}"]', "invalid_arguments", "must be a JSON object"),
        ("shell", {"command": touch, "timeout_s": "5"}, "invalid_arguments", "timeout_s"),
        ("shell", {"command": touch, "timeout_s": 10_000}, "invalid_arguments", "at most"),
        ("shell", {"command": touch, "timeout_s": -1}, "invalid_arguments", "timeout_s"),
        ("shell", {"command": touch, "cwd": "/"}, "invalid_arguments", "unknown argument"),
        ("shell", {"command": ["touch", marker]}, "invalid_arguments", "command"),
        ("shell", {"cmd": touch}, "invalid_arguments", "did you mean command"),
        ("shell", {"command": "   "}, "invalid_arguments", "blank"),
        ("shell", {"command": touch + "\x00"}, "invalid_arguments", "NUL"),
        ("shell", None, "invalid_arguments", "missing"),
        ("bash", {"command": touch}, "unknown_tool", "available tools: shell, read_file"),
        ("read_file", {"path": 7}, "invalid_arguments", "path"),
        ("read_file", {"path": "f", "start_line": 0}, "invalid_arguments", "start_line"),
        ("read_file", {"path": "f", "start_line": 5, "end_line": 2}, "invalid_arguments", "end"),
        ("read_file", {"path": "/etc/passwd"}, "invalid_arguments", "outside /workspace"),
        ("read_file", {"path": "../etc/passwd"}, "invalid_arguments", "escapes /workspace"),
    ]
    for name, arguments, kind, needle in calls:
        result = run_tool(name, backend, shared_sandbox, arguments, settings)
        assert result.outcome == Outcome.AGENT_ERROR, (name, arguments, result)
        assert result.error_kind == kind, (name, arguments, result)
        assert needle in result.output, (name, arguments, result.output)
        assert len(result.output.encode()) <= settings.output_budget_bytes
        assert result.exit_code is None
    exists = backend.exec(shared_sandbox, f"test -e {marker}", timeout_s=5, output_budget_bytes=256)
    assert exists.exit_code == 1, "a rejected call ran its command"


def test_a_long_multibyte_command_within_the_limit_is_not_an_infra_error(
    backend: DockerBackend, shared_sandbox: SandboxHandle, settings: Settings
) -> None:
    command = ": " + "日" * 44_000  # 44,002 characters, 132,002 bytes
    result = run_tool("shell", backend, shared_sandbox, {"command": command}, settings)
    assert result.outcome in (Outcome.OK, Outcome.AGENT_ERROR)


# -- a real codebase -------------------------------------------------------------------------

GIT_ENV = {
    **{k: v for k, v in os.environ.items() if not k.startswith("GIT_")},
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_AUTHOR_NAME": "dev",
    "GIT_AUTHOR_EMAIL": "dev@example.com",
    "GIT_COMMITTER_NAME": "dev",
    "GIT_COMMITTER_EMAIL": "dev@example.com",
}


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, env=GIT_ENV, check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture(scope="module")
def codebase(
    settings: Settings, base_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A small git project, built as a codebase at its second commit (the third, later
    commit must stay invisible); its image is removed afterwards."""
    repo = tmp_path_factory.mktemp("project")
    git(repo, "init", "-q", "-b", "main")
    (repo / "src").mkdir()
    (repo / "src" / "calc.py").write_text(
        "def add(a, b):\n    return a + b\n\n\ndef main():\n    print(add(2, 3))\n"
    )
    (repo / "README.md").write_text("# calc\n\nAdds numbers.\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "initial calculator")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_calc.py").write_text(
        "from src.calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
    )
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "add a test for add")
    rev = git(repo, "rev-parse", "HEAD")
    (repo / "src" / "calc.py").write_text("def add(a, b):\n    return a + b  # SOLUTION\n")
    git(repo, "commit", "-q", "-am", "the later fix")

    name = f"test-tools-{uuid.uuid4().hex[:8]}"
    add_codebase(settings, name, repo, rev, progress=lambda _line: None)
    try:
        yield name
    finally:
        with contextlib.suppress(UnknownCodebase):
            remove_codebase(settings, name)


def test_agent_workflow_on_a_codebase(
    backend: DockerBackend, settings: Settings, codebase: str
) -> None:
    handle = backend.create(
        SandboxSpec(image=codebase_image(settings, codebase), rollout_id="codebase")
    )
    try:

        def call(tool: str, arguments: dict[str, Any]) -> str:
            result = run_tool(tool, backend, handle, arguments, settings)
            assert result.outcome == Outcome.OK, (tool, arguments, result)
            return result.output

        assert call("shell", {"command": "ls -A"}).split() == [
            ".git",
            "README.md",
            "src",
            "tests",
        ]
        assert call("shell", {"command": "rg -n 'def add'"}) == "src/calc.py:1:def add(a, b):"
        grep = call("shell", {"command": "grep -rn 'add(' --include='*.py' ."})
        assert "./src/calc.py:1:def add(a, b):" in grep
        assert "./tests/test_calc.py:5:    assert add(2, 3) == 5" in grep
        found = call("shell", {"command": "find . -name '*.py' -not -path './.git/*' | sort"})
        assert found == "./src/calc.py\n./tests/test_calc.py"
        log = call("shell", {"command": "git log --oneline"}).splitlines()
        assert [line.split(" ", 1)[1] for line in log] == [
            "add a test for add",
            "initial calculator",
        ]
        assert call("shell", {"command": "git status --short"}) == "(no output)"
        hidden = run_tool(
            "shell",
            backend,
            handle,
            {"command": "git log --all --oneline | wc -l; rg -c SOLUTION"},
            settings,
        )
        assert hidden.output.startswith("2\n") and hidden.exit_code == 1

        source = call("read_file", {"path": "src/calc.py"})
        assert source.split("\n")[0] == "     1\tdef add(a, b):"
        assert "     6\t    print(add(2, 3))" in source
        assert call("read_file", {"path": "src/calc.py", "start_line": 5, "end_line": 5}) == (
            "     5\tdef main():\n[showing line 5 of 6]"
        )

        # The agent edits and runs the code; the tree is its to change.
        call("shell", {"command": "sed -i 's/a + b/a + b + 0/' src/calc.py"})
        assert call("shell", {"command": "python3 -c 'from src.calc import main; main()'"}) == "5"
        assert "+    return a + b + 0" in call("shell", {"command": "git diff"})
    finally:
        backend.destroy(handle)
