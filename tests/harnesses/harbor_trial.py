"""One stock Harbor trial (harbor 0.26.0, Python >= 3.12) on the orchestrator's E2B API.

Run by the Harbor interpreter, never by the product's (it does not import ``orchestrator``):

    E2B_API_URL=http://127.0.0.1:8000 E2B_SANDBOX_URL=http://127.0.0.1:8000 \\
    E2B_API_KEY="$ORCH_API_TOKEN" .venv-harbor/bin/python tests/harnesses/harbor_trial.py \\
        --template harbor --solution correct wrong --trace --out /tmp/harbor-report.json

Everything Harbor does is its own: its built-in E2B environment
(``EnvironmentConfig(type="e2b", kwargs={"prebuilt_template_id": <template>, ...})``), its
``oracle`` agent (runs the task's ``solution/solve.sh``; no model) and its verifier (runs
``tests/test.sh``, which writes ``/logs/verifier/reward.txt``). The task is written here:
``instruction.md``, ``task.toml``, ``environment/Dockerfile`` (unused: the template is
prebuilt), ``solution/solve.sh``, ``tests/test.sh``. One trial per ``--solution``: ``correct``
(reward 1) and ``wrong`` (a wrong answer: reward 0, scored, not an error), in one process.

``--trace`` also records every call Harbor's provider makes through the e2b SDK (method,
path or command, user, and how it ended), by wrapping the SDK's methods: an observer only,
the calls and their arguments are Harbor's.

Writes one JSON object (to ``--out``, else stdout): ``trials``, one per solution, each with
``solution``, ``rewards``, ``exception`` (type and message, or null), ``sandbox_id`` (the
E2B sandbox id: the orchestrator's rollout id), ``trial_dir``, ``seconds`` (the whole trial,
measured here), ``phases`` (Harbor's own timings, in seconds) and, with ``--trace``,
``calls``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from e2b import AsyncSandbox
from e2b.sandbox_async.commands.command import Commands
from e2b.sandbox_async.commands.command_handle import AsyncCommandHandle
from e2b.sandbox_async.filesystem.filesystem import Filesystem
from harbor.models.trial.config import (  # type: ignore[import-not-found]
    AgentConfig,
    EnvironmentConfig,
    TaskConfig,
    TrialConfig,
)
from harbor.models.trial.result import TimingInfo  # type: ignore[import-not-found]
from harbor.trial.trial import Trial  # type: ignore[import-not-found]

# The task: count the lines of a file the solution itself writes (so the task needs no
# files in the sandbox beforehand), and write the count where the verifier looks.
INSTRUCTION = (
    "Write the numbers 1 to 7, one per line, to /workspace/numbers.txt, then write how many "
    "lines that file has to /workspace/answer.txt.\n"
)
TASK_TOML = """\
[task]
name = "orchestrator/count-lines"

[metadata]
difficulty = "easy"

[verifier]
timeout_sec = 60

[agent]
timeout_sec = 60

[environment]
network_mode = "no-network"
"""
DOCKERFILE = "FROM debian:bookworm-slim\nWORKDIR /workspace\n"
SOLUTIONS = {
    "correct": "#!/bin/bash\nset -e\nseq 1 7 > /workspace/numbers.txt\n"
    "wc -l < /workspace/numbers.txt > /workspace/answer.txt\n",
    "wrong": "#!/bin/bash\nset -e\nseq 1 7 > /workspace/numbers.txt\n"
    "echo 6 > /workspace/answer.txt\n",
}
TEST_SH = """\
#!/bin/bash
# The verifier: reward 1 when the answer is the file's line count, else 0.
expected=$(wc -l < /workspace/numbers.txt 2>/dev/null || echo missing)
got=$(tr -d '[:space:]' < /workspace/answer.txt 2>/dev/null || echo none)
echo "expected=$expected got=$got"
reward=0
if [ "$got" = "$expected" ]; then reward=1; fi
echo $reward > /logs/verifier/reward.txt
"""


def write_task(root: Path, solution: str) -> Path:
    task = root / "count-lines"
    for sub in ("environment", "solution", "tests"):
        (task / sub).mkdir(parents=True, exist_ok=True)
    (task / "instruction.md").write_text(INSTRUCTION)
    (task / "task.toml").write_text(TASK_TOML)
    (task / "environment" / "Dockerfile").write_text(DOCKERFILE)
    (task / "solution" / "solve.sh").write_text(SOLUTIONS[solution])
    (task / "tests" / "test.sh").write_text(TEST_SH)
    for script in (task / "solution" / "solve.sh", task / "tests" / "test.sh"):
        script.chmod(0o755)
    return task


class Recorder:
    """Wraps the e2b SDK's async methods Harbor's provider calls; records each call."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.sandbox_ids: list[str] = []
        self.waiting: dict[int, dict[str, Any]] = {}

    def install(self) -> None:
        self._wrap_wait()
        self._wrap(Commands, "run", lambda a, k: k.get("cmd", a[0] if a else None))
        self._wrap(Commands, "connect", lambda a, k: k.get("pid", a[0] if a else None))
        for name in ("write", "read", "get_info", "exists", "list", "remove", "make_dir"):
            self._wrap(Filesystem, name, lambda a, k: k.get("path", a[0] if a else None))
        self._wrap(AsyncSandbox, "kill", lambda a, k: None)
        self._wrap(AsyncSandbox, "set_timeout", lambda a, k: k.get("timeout", a[0] if a else None))
        create = AsyncSandbox.create.__func__  # type: ignore[attr-defined]

        @functools.wraps(create)
        async def created(cls: type[AsyncSandbox], *args: Any, **kwargs: Any) -> AsyncSandbox:
            entry = {"method": "Sandbox.create", "what": kwargs.get("template"), "user": None}
            self.calls.append(entry)
            try:
                sandbox: AsyncSandbox = await create(cls, *args, **kwargs)
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"
                raise
            self.sandbox_ids.append(sandbox.sandbox_id)
            entry["ok"] = True
            return sandbox

        AsyncSandbox.create = classmethod(created)  # type: ignore[method-assign,assignment]

    def _wrap(
        self, owner: type, name: str, what: Callable[[tuple[Any, ...], dict[str, Any]], Any]
    ) -> None:
        original = owner.__dict__[name]  # the descriptor itself (some are dual class/instance)
        label = f"{owner.__name__.lower().replace('asyncsandbox', 'sandbox')}.{name}"

        @functools.wraps(original)
        async def wrapper(instance: Any, *args: Any, **kwargs: Any) -> Any:
            target = what(args, kwargs)
            entry: dict[str, Any] = {
                "method": label,
                "what": target if isinstance(target, (str, int)) or target is None else str(target),
                "user": kwargs.get("user"),
            }
            if kwargs.get("background"):
                entry["background"] = True
            self.calls.append(entry)
            try:
                result = await original.__get__(instance, type(instance))(*args, **kwargs)
            except Exception as exc:
                entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                raise
            if kwargs.get("background") and isinstance(result, AsyncCommandHandle):
                self.waiting[id(result)] = entry  # its end is its wait()'s
            else:
                entry["ok"] = True
            return result

        setattr(owner, name, wrapper)

    def _wrap_wait(self) -> None:
        original = AsyncCommandHandle.wait

        @functools.wraps(original)
        async def wait(handle: AsyncCommandHandle, *args: Any, **kwargs: Any) -> Any:
            entry = self.waiting.pop(id(handle), None)
            try:
                result = await original(handle, *args, **kwargs)
            except Exception as exc:
                if entry is not None:
                    entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                raise
            if entry is not None:
                entry["ok"] = True
            return result

        AsyncCommandHandle.wait = wait  # type: ignore[method-assign,assignment]


async def run_trial(
    args: argparse.Namespace, work: Path, solution: str, recorder: Recorder | None
) -> dict[str, Any]:
    if recorder:
        recorder.calls, recorder.sandbox_ids = [], []
    task = write_task(work / solution / "tasks", solution)
    config = TrialConfig(
        task=TaskConfig(path=task),
        trials_dir=work / solution / "trials",
        agent=AgentConfig(name="oracle"),
        environment=EnvironmentConfig(
            type="e2b",
            kwargs={
                # A template the orchestrator serves: an environment or a codebase name.
                "prebuilt_template_id": args.template,
                "sandbox_timeout_sec": args.sandbox_timeout,
                "renew_interval_sec": 0,  # trials take seconds: no renewals
                # Both need root for real (/etc/profile.d, sysctl): nothing to do here.
                "restore_login_path": False,
                "allow_memory_overcommit": False,
            },
        ),
    )
    started = time.monotonic()
    trial = await Trial.create(config)
    result = await trial.run()
    exception = result.exception_info
    verifier = result.verifier_result
    phases = {
        "environment_setup": result.environment_setup,
        "agent_execution": result.agent_execution,
        "verifier": result.verifier,
    }
    return {
        "solution": solution,
        "rewards": verifier.rewards if verifier is not None else None,
        "exception": (
            {"type": exception.exception_type, "message": exception.exception_message}
            if exception is not None
            else None
        ),
        "sandbox_id": recorder.sandbox_ids[-1] if recorder and recorder.sandbox_ids else None,
        "trial_dir": str(work / solution / "trials" / result.trial_name),
        "seconds": round(time.monotonic() - started, 2),
        "phases": {name: _seconds(t) for name, t in phases.items()},
        **({"calls": recorder.calls} if recorder else {}),
    }


def _seconds(timing: TimingInfo | None) -> float | None:
    if timing is None or timing.started_at is None or timing.finished_at is None:
        return None
    seconds: float = (timing.finished_at - timing.started_at).total_seconds()
    return round(seconds, 2)


async def run_trials(
    args: argparse.Namespace, work: Path, recorder: Recorder | None
) -> dict[str, Any]:
    # One after the other: each trial is one sandbox, created and killed by Harbor.
    return {"trials": [await run_trial(args, work, s, recorder) for s in args.solution]}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--template", default="harbor", help="an orchestrator environment")
    parser.add_argument(
        "--solution",
        nargs="+",
        choices=sorted(SOLUTIONS),
        default=["correct"],
        help="one trial each",
    )
    parser.add_argument("--work", help="where tasks and trials go (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="write the report here (default: stdout)")
    parser.add_argument("--sandbox-timeout", type=int, default=300)
    parser.add_argument("--trace", action="store_true", help="record the provider's SDK calls")
    args = parser.parse_args()
    recorder = Recorder() if args.trace else None
    if recorder:
        recorder.install()
    work = Path(args.work or tempfile.mkdtemp(prefix="harbor-trial-"))
    work.mkdir(parents=True, exist_ok=True)
    report = json.dumps(asyncio.run(run_trials(args, work, recorder)), indent=1, default=str)
    if args.out:
        args.out.write_text(report + "\n")
    else:
        sys.stdout.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
