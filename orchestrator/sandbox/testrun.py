"""Running a task's tests in a sandbox against the agent's work, where the agent cannot
change the verdict (the worker's half of the ``sandbox_tests`` grader, docs/graders.md).

In order, on the sandbox's host:

1. The files that decide how tests run are taken from the image's own /workspace (the
   pristine tree, which no sandbox can write): every ``conftest.py``, ``pytest.ini``,
   ``tox.ini``, ``setup.cfg`` and ``pyproject.toml`` there, and the files the row's test
   patch touches, with the patch applied to them here (by the host's ``patch``, never a tool
   inside the sandbox).
2. In the sandbox (exec_agent.stage): every process of the agent's user is ended, so
   nothing of the agent's runs or writes while it is judged; then every file of those names
   the agent added, every ``sitecustomize.py``, ``usercustomize.py`` and ``*.pth``, is
   removed, and the pristine and patched files are written over whatever the agent left.
3. The tests run as the agent's user through the system's own interpreter and pytest
   (``/usr/bin/python3 -s -E``: no user site, no PYTHON* variables; pytest imported before
   /workspace is on the path, so a ``pytest`` of the agent's cannot stand in; plugins load
   only as the pristine configuration names them), each test's outcome reported on the
   command's standard output under a nonce drawn for this run.

What is left to the agent is its own code, which the tests import and run: code that
patches the test runner from inside the interpreter is out of reach here, as it is for
SWE-bench's harness. A sandbox that dies, or machinery of ours that fails, is an error
(the grader's 503); the agent's code failing, hanging past the budget or having filled its
workspace is a verdict.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import tempfile
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, Field

from orchestrator.sandbox.backend import SandboxBackend, SandboxError, SandboxHandle

CONFIG_NAMES = ("conftest.py", "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml")
"""Files that decide how tests run: the pristine tree's are restored, the agent's new ones
removed."""
NEVER_KEPT = ("sitecustomize.py", "usercustomize.py", "*.pth")
"""Files that change what an interpreter does at start-up: the agent's are removed, the
pristine tree's kept."""
PYTHON = "/usr/bin/python3"
OUTPUT_BUDGET_BYTES = 4 << 20

RUNNER = r"""
import json, os, sys
nonce, tests = sys.argv[1], sys.argv[2:]
report = os.fdopen(os.dup(1), "w", buffering=1)
sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd()) and not p.startswith("/workspace")]
for name in [n for n in os.environ if n.startswith("PYTEST_")]:
    del os.environ[name]
os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
import pytest
sys.path.insert(0, "/workspace")
devnull = os.open(os.devnull, os.O_WRONLY)
os.dup2(devnull, 1)

def say(kind, **fields):
    report.write(nonce + " " + json.dumps({"kind": kind, **fields}) + "\n")

say("ready")

class Report:
    def pytest_sessionstart(self, session):
        say("start")
    def pytest_collectreport(self, report):
        if report.failed:
            say("collect", nodeid=report.nodeid, outcome=report.outcome)
    def pytest_runtest_logreport(self, report):
        say("test", nodeid=report.nodeid, when=report.when, outcome=report.outcome)
    def pytest_sessionfinish(self, session, exitstatus):
        say("finish", exit=int(exitstatus))

code = pytest.main(["-p", "no:cacheprovider", "-q", "-rN", "--rootdir=/workspace", *tests],
                   plugins=[Report()])
sys.exit(int(code))
"""


class TestRun(BaseModel):
    """Which tests to run against the agent's work, and how."""

    __test__ = False  # not a pytest class

    tests: list[str] = Field(min_length=1, description="pytest node ids, as listed in a row.")
    test_patch: str = Field("", description="A unified diff applied to the pristine tree.")
    timeout_s: float = Field(gt=0, description="The whole run's budget.")


class TestOutcome(StrEnum):
    __test__ = False

    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"
    MISSING = "missing"  # never reported: not collected, or the run ended first


class TestRunResult(BaseModel):
    """What a run found; ``error`` (ours: the sandbox, the machinery) means no verdict."""

    __test__ = False

    outcomes: dict[str, TestOutcome] = Field(default_factory=dict)
    ready: bool = Field(False, description="The runner had the system's pytest imported.")
    started: bool = Field(False, description="pytest's session started.")
    exit_code: int | None = None
    timed_out: bool = False
    no_space: bool = Field(False, description="Set-up failed: the agent filled its workspace.")
    collect_errors: list[str] = Field(default_factory=list)
    restored: list[str] = Field(default_factory=list)
    removed: list[str] = Field(default_factory=list)
    patch_error: str | None = Field(None, description="The row's patch does not apply.")
    stderr_tail: str = ""
    error: str | None = None


class TestPatchError(ValueError):
    """The row's test patch is not a patch, or does not apply to the pristine tree."""

    __test__ = False


def run_tests(backend: SandboxBackend, handle: SandboxHandle, run: TestRun) -> TestRunResult:
    """Run ``run`` in ``handle`` as the module docstring says. Raises :class:`SandboxError`
    when the sandbox or the backend fails."""
    with backend.pristine_workspace(handle) as pristine:
        if pristine is None:
            raise SandboxError(f"the {backend.name} backend cannot show an image's pristine tree")
        try:
            files, deleted = patched_files(pristine, run.test_patch)
        except TestPatchError as exc:
            return TestRunResult(patch_error=str(exc))
        config = pristine_config(pristine)
    write = {**config, **files}
    staged = backend.stage(
        handle,
        purge=[*CONFIG_NAMES, *NEVER_KEPT],
        keep=sorted(config),
        remove=sorted(deleted),
        write=write,
    )
    restored = sorted(write)
    if staged.no_space:
        return TestRunResult(no_space=True, restored=restored, removed=staged.removed)
    nonce = secrets.token_hex(16)
    result = backend.exec(
        handle,
        [PYTHON, "-s", "-E", "-c", RUNNER, nonce, *run.tests],
        timeout_s=run.timeout_s,
        output_budget_bytes=OUTPUT_BUDGET_BYTES,
    )
    stderr = (result.stderr.head + result.stderr.tail)[-2000:]
    if result.stdout.truncated:
        return TestRunResult(
            error=f"the runner's report was cut at {result.stdout.kept_bytes} bytes",
            stderr_tail=stderr,
        )
    parsed = parse_report(result.stdout.head + result.stdout.tail, nonce, run.tests)
    return parsed.model_copy(
        update={
            "timed_out": result.timed_out,
            "restored": restored,
            "removed": staged.removed,
            "stderr_tail": stderr,
            "exit_code": parsed.exit_code if parsed.exit_code is not None else result.exit_code,
        }
    )


def parse_report(stdout: str, nonce: str, tests: list[str]) -> TestRunResult:
    """Each listed test's outcome from the runner's lines (only those under ``nonce``): it
    passed when its call passed and neither its set-up nor its tear-down failed."""
    phases: dict[str, dict[str, str]] = {}
    ready = started = False
    exit_code: int | None = None
    collect_errors: list[str] = []
    prefix = nonce + " "
    for line in stdout.splitlines():
        if not line.startswith(prefix):
            continue
        event = json.loads(line[len(prefix) :])
        kind = event.get("kind")
        if kind == "ready":
            ready = True
        elif kind == "start":
            started = True
        elif kind == "finish":
            exit_code = int(event["exit"])
        elif kind == "collect":
            collect_errors.append(str(event["nodeid"]))
        elif kind == "test":
            phases.setdefault(str(event["nodeid"]), {})[str(event["when"])] = str(event["outcome"])
    outcomes = {test: _outcome(phases.get(test)) for test in tests}
    return TestRunResult(
        outcomes=outcomes,
        ready=ready,
        started=started,
        exit_code=exit_code,
        collect_errors=collect_errors,
    )


def _outcome(phases: dict[str, str] | None) -> TestOutcome:
    if not phases:
        return TestOutcome.MISSING
    if "failed" in (phases.get("setup"), phases.get("teardown"), phases.get("call")):
        return TestOutcome.FAILED
    if phases.get("call") == "passed":
        return TestOutcome.PASSED
    if "skipped" in phases.values():
        return TestOutcome.SKIPPED
    return TestOutcome.MISSING


def pristine_config(pristine: Path) -> dict[str, bytes]:
    """The pristine tree's files of :data:`CONFIG_NAMES`, by path under /workspace."""
    found: dict[str, bytes] = {}
    for top, dirs, names in os.walk(pristine):
        if Path(top) == pristine and ".git" in dirs:
            dirs.remove(".git")
        for name in names:
            if name in CONFIG_NAMES:
                path = Path(top) / name
                if path.is_file() and not path.is_symlink():
                    found[str(path.relative_to(pristine))] = path.read_bytes()
    return found


_HEADER = re.compile(r"^(---|\+\+\+) (?:\"?)([^\t\n\"]+)")


def patch_paths(patch: str) -> tuple[set[str], set[str]]:
    """The paths a unified diff changes (``a/``, ``b/`` prefixes dropped), and those it
    deletes. :class:`TestPatchError` for text that changes no file."""
    touched: set[str] = set()
    deleted: set[str] = set()
    old: str | None = None
    for line in patch.splitlines():
        header = _HEADER.match(line)
        if header is None:
            continue
        path = header[2].strip()
        if header[1] == "---":
            old = path
            continue
        for side in (old, path):
            if side is not None and side != "/dev/null":
                touched.add(_relative(side))
        if path == "/dev/null" and old is not None and old != "/dev/null":
            deleted.add(_relative(old))
        old = None
    if not touched:
        raise TestPatchError("it changes no file (not a unified diff)")
    return touched, deleted


def _relative(path: str) -> str:
    if not path.startswith(("a/", "b/")):
        raise TestPatchError(f"it names {path!r} without git's a/ or b/ prefix")
    normal = os.path.normpath(path[2:])
    if normal.startswith(("/", "..")) or normal in (".", ".git") or normal.startswith(".git/"):
        raise TestPatchError(f"it names {path!r}, which is not a file of the repository")
    return normal


def patched_files(pristine: Path, patch: str) -> tuple[dict[str, bytes], set[str]]:
    """The files ``patch`` leaves when applied to the pristine tree (path -> contents), and
    the paths it deletes. :class:`TestPatchError` when it does not apply cleanly."""
    if not patch.strip():
        return {}, set()
    touched, deleted = patch_paths(patch)
    with tempfile.TemporaryDirectory(prefix="orch-test-patch-") as scratch:
        root = Path(scratch)
        for relative in touched:
            source = pristine / relative
            if source.is_file() and not source.is_symlink():
                target = root / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(source.read_bytes())
        applied = subprocess.run(
            [
                *("patch", "-p1", "--batch", "--forward", "--silent", "--fuzz=0"),
                *("--no-backup-if-mismatch", "-r", "-", "-d", str(root)),
            ],
            input=patch.encode(),
            capture_output=True,
            timeout=60,
            check=False,
        )
        if applied.returncode != 0:
            said = (applied.stdout + applied.stderr).decode(errors="replace").strip()
            raise TestPatchError(f"it does not apply to the pristine tree: {said[:500]}")
        files = {
            relative: (root / relative).read_bytes()
            for relative in touched - deleted
            if (root / relative).is_file()
        }
    return files, deleted
