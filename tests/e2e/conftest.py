"""The end-to-end suite's deployments (tests/stacks.py makes every one): the main stack
(API and worker on Redis started by `make test`'s host set-up, real sandboxes, a real
codebase) that most tests use, and the shared side deployments with a reaper that tests
borrow by name instead of each starting one.
"""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.config import Settings
from orchestrator.environments.examples import ensure_requests_codebase
from orchestrator.environments.loader import default_environments_text
from orchestrator.images.codebases import remove_codebase
from orchestrator.local import free_port
from tests import agent_caused
from tests.judge_server import JudgeServer
from tests.stacks import TOKEN, Stack, Stacks, deployment, running


@pytest.fixture(scope="session")
def e2e_codebase(settings: Settings, base_image: str) -> Iterator[str]:
    """The main stack's codebase: the `requests` library as a git repository, offline,
    under a name of this worker's own. Removed once every stack is down (``stacks``
    depends on it, so it ends first)."""
    codebase = f"e2e-requests-{uuid.uuid4().hex[:6]}"
    ensure_requests_codebase(settings, codebase)
    yield codebase
    remove_codebase(settings, codebase)


@pytest.fixture(scope="session")
def stacks(
    settings: Settings, e2e_codebase: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stacks]:
    """This worker's shelf of shared deployments (tests/stacks.py)."""
    shelf = Stacks(settings, tmp_path_factory.mktemp("stacks"))
    try:
        yield shelf
    finally:
        shelf.close()


@pytest.fixture(scope="session")
def stack(stacks: Stacks, e2e_codebase: str) -> Stack:
    """The main stack: API and worker, no reaper, on the default environments."""
    return stacks.borrow(
        "e2e", codebase=e2e_codebase, roles=("worker", "api"), worker_metrics_port=free_port()
    )


def python() -> str:
    return sys.executable


# --- fixtures added for the end-to-end suite (issue 3) -------------------------------------


@pytest.fixture(scope="session")
def finqa_codebase(stack: Stack) -> str:
    """The `finqa-corpus` codebase the `finqa-demo` environment runs (built if missing)."""
    from orchestrator.environments.examples import FINQA_CODEBASE, ensure_finqa_corpus

    ensure_finqa_corpus(stack.settings)
    return FINQA_CODEBASE


@pytest.fixture()
def planning_item(stack: Stack) -> dict[str, Any]:
    """A codebase-planning dataset row on the stack's real codebase."""
    return {
        "codebase": stack.codebase,
        "prompt": "Make Session.request honour a default timeout.",
        "gold_files": ["src/requests/sessions.py", "src/requests/adapters.py"],
    }


REAPED = "codebase-planning-reaped"
"""codebase-planning with a 4 s idle timeout and 2 s of grace after grading: the reaper (every
second on the side stack) ends its rollouts within a test's patience."""

REWARDED = "rewards-multi"
"""codebase-planning scored by ``multi``: file_f1, less 0.1 per tool call past the first and
0.0001 per output token (tests/e2e/test_rewards.py)."""
REWARD_FORMULA = "files - 0.1 * max(0, tool_calls - 1) - 0.0001 * output_tokens"
REGRADER = "rewards-files-only"
"""codebase-planning scored by file_f1 alone, in ``multi``: what test_rewards.py regrades by."""

SWE_TESTS = "swe-tests"
"""Rows name their codebase; scored by sandbox_tests (tests/e2e/test_sandbox_tests.py)."""

JUDGED = "judged"
"""codebase-planning scored by ``score_model``, the steered judge "fair" (0.75, as JSON), one
call at a time across the deployment (tests/e2e/test_judge.py)."""
JUDGED_MODELS = {"judged-lined": "lined", "judged-garbage": "garbage", "judged-over": "overscored"}
"""Environments scored by the other steered judges (tests/judge_models.VERDICTS)."""
JUDGED_LATE = "judged-late"
"""Scored by a judge model whose directory the test makes only after the server's first
500 for it."""
JUDGE_KEY = "sk-test-0123456789-never-logged"
"""The side stack's judge key: tests/e2e/test_judge.py looks for it in every log."""

GROUPED = "grouped"
"""A side-stack environment with a set-up step (docs/snapshots.md): each group's set-up
leaves its own id, files in /workspace, /tmp and the home, and a process (not kept)."""
GROUPED_BROKEN = "grouped-broken"
"""Its set-up exits 3."""
GROUPED_SLOW = "grouped-slow"
"""Its set-up runs past its timeout."""
GROUP_SETUP = (
    "cat /proc/sys/kernel/random/uuid > .setup-id && echo set > /tmp/setup && "
    "mkdir -p ~/.cache && echo warm > ~/.cache/c && rm README.md && "
    "(setsid sleep 600 > /dev/null 2>&1 < /dev/null &)"
)


def group_environments(data: dict[str, Any]) -> dict[str, Any]:
    """:data:`GROUPED` and :data:`GROUPED_BROKEN`, on the row's codebase."""
    base = {"tools": ["shell", "read_file"], "grader": {"name": "file_f1"}}
    data["environments"] += [
        {**base, "name": GROUPED, "setup": {"command": GROUP_SETUP, "timeout_s": 60}},
        {**base, "name": GROUPED_BROKEN, "setup": {"command": "echo broken >&2; exit 3"}},
        {**base, "name": GROUPED_SLOW, "setup": {"command": "sleep 60", "timeout_s": 1}},
    ]
    return data


ACT_ENVIRONMENTS = {"runc": "acts-runc", "runsc": "acts-runsc"}
"""The agent-caused table's environments (tests/agent_caused.py), one per runtime."""


def reaper_environments(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (an environments file's contents) with :data:`REAPED` added, made from its
    codebase-planning."""
    planning = next(e for e in data["environments"] if e["name"] == "codebase-planning")
    reaped = {**planning, "name": REAPED, "idle_timeout_s": 4, "grace_after_grade_s": 2}
    return {**data, "environments": [*data["environments"], reaped]}


def reward_environments(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with :data:`REWARDED` and :data:`REGRADER` (made from its codebase-planning)
    and :data:`SWE_TESTS` added."""
    planning = next(e for e in data["environments"] if e["name"] == "codebase-planning")
    files = {"files": {"name": "file_f1"}}
    rewarded = {
        **planning,
        "name": REWARDED,
        "grader": {
            "name": "multi",
            "options": {"graders": files, "formula": REWARD_FORMULA, "clamp": [0, 1]},
        },
    }
    regrader = {
        **planning,
        "name": REGRADER,
        "grader": {"name": "multi", "options": {"graders": files, "formula": "files"}},
    }
    swe = {
        "name": SWE_TESTS,
        "tools": ["shell", "read_file"],
        "grader": {"name": "sandbox_tests", "options": {"timeout_s": 60}},
    }
    return {**data, "environments": [*data["environments"], rewarded, regrader, swe]}


JUDGE_INPUT = [
    {
        "role": "system",
        "content": "Score from 0 to 1 how well the answer names the files to change.",
    },
    {
        "role": "user",
        "content": "Task: {{ item.request }}\nFiles that change: {{ item.gold_files }}\n"
        "Last calls:\n{{ trajectory }}\nAnswer: {{ answer }}",
    },
]


def judge_environments(data: dict[str, Any], judge: JudgeHome) -> dict[str, Any]:
    """``data`` with :data:`JUDGED`, :data:`JUDGED_MODELS` and :data:`JUDGED_LATE` added
    (codebase-planning's, scored by the judge at ``judge``)."""
    planning = next(e for e in data["environments"] if e["name"] == "codebase-planning")

    def judged(name: str, model: str, **options: Any) -> dict[str, Any]:
        grader = {
            "model": str(judge.models / model),
            "base_url": judge.base_url,
            "input": JUDGE_INPUT,
            "request_timeout_s": 4,
            "timeout_s": 6,
            "backoff_s": 0.2,
            **options,
        }
        return {**planning, "name": name, "grader": {"name": "score_model", "options": grader}}

    added = [judged(JUDGED, "fair", max_concurrent=1)]
    added += [judged(env, model) for env, model in JUDGED_MODELS.items()]
    # A wait between attempts the test can act in: it makes the model after the first 500.
    added.append(judged(JUDGED_LATE, "late", backoff_s=3.0, max_attempts=2))
    return {**data, "environments": [*data["environments"], *added]}


def side_environments_yaml(path: Path, judge: JudgeHome) -> Path:
    """The side stack's environments: the defaults (E2B and Harbor use them), :data:`REAPED`,
    :data:`REWARDED`, :data:`REGRADER`, the judged ones, :data:`GROUPED` and
    :data:`ACT_ENVIRONMENTS`."""
    data = reward_environments(reaper_environments(yaml.safe_load(default_environments_text())))
    data = group_environments(judge_environments(data, judge))
    data["environments"] += [
        {
            "name": name,
            "runtime": runtime,
            "tools": ["shell"],
            "limits": agent_caused.LIMITS,
            "grader": {"name": "file_f1"},
        }
        for runtime, name in ACT_ENVIRONMENTS.items()
    ]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@dataclass(frozen=True)
class JudgeHome:
    """Where the tests' judge server listens and keeps its models (tests/judge_server.py):
    fixed when the side stack's environments are written, served only when a test needs it."""

    port: int
    models: Path
    logs: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@pytest.fixture(scope="session")
def judge_home(tmp_path_factory: pytest.TempPathFactory) -> JudgeHome:
    root = tmp_path_factory.mktemp("judge")
    return JudgeHome(port=free_port(), models=root / "models", logs=root)


@pytest.fixture(scope="session")
def judge(judge_home: JudgeHome) -> Iterator[JudgeServer]:
    """The judge server of the side stack's judged environments, serving."""
    server = JudgeServer(judge_home.port, judge_home.models, judge_home.logs)
    server.build_models()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def side(
    stack: Stack, stacks: Stacks, tmp_path_factory: pytest.TempPathFactory, judge_home: JudgeHome
) -> Stack:
    """The shared side deployment, with a reaper (a pass every second): one stack for the
    tests that differ from the main stack only by the environments they run (the E2B API,
    Harbor, the agent-caused table, the reaper's tests, the judge's), on its own Redis keys
    and API port, sharing the main stack's codebase."""
    root = tmp_path_factory.mktemp("side")
    return stacks.borrow(
        "side",
        codebase=stack.codebase,
        environments_file=side_environments_yaml(root / "environments.yaml", judge_home),
        env={"OPENAI_API_KEY": JUDGE_KEY},
        reaper_interval_s=1.0,
        worker_metrics_port=free_port(),
        reaper_metrics_port=free_port(),
    )


@pytest.fixture(scope="session")
def reaper_stack(side: Stack) -> Stack:
    """The side stack, for the reaper's tests: their rows name :data:`REAPED`."""
    return side


@contextlib.contextmanager
def side_stack(
    stack: Stack,
    root: Path,
    *,
    name: str,
    environments_file: Path,
    env: dict[str, str] | None = None,
    **fields: Any,
) -> Iterator[Stack]:
    """A deployment of a test's or a module's own beside ``stack`` (own worker, reaper, API
    port, Redis keys), for what differs by more than environments (other settings, a debug
    switch), on ``environments_file`` and ``stack``'s codebase. ``fields``: settings;
    ``env``: what is not a setting."""
    made = deployment(
        stack.settings,
        name,
        logs=root / "logs",
        codebase=stack.codebase,
        env=env,
        environments_file=environments_file,
        reaper_interval_s=1.0,
        worker_metrics_port=free_port(),
        **fields,
    )
    with running(made) as started:
        yield started


@pytest.fixture(scope="module")
def e2b_stack(side: Stack, monkeypatch_module: pytest.MonkeyPatch) -> Stack:
    """The shared side deployment, on the default environments, as the stock E2B SDK
    reaches it: as docs/e2b.md tells a user to, the SDK's own settings, nothing else."""
    monkeypatch_module.setenv("E2B_API_URL", side.base_url)
    monkeypatch_module.setenv("E2B_SANDBOX_URL", side.base_url)
    monkeypatch_module.setenv("E2B_API_KEY", TOKEN)
    monkeypatch_module.setenv("NO_PROXY", "127.0.0.1,localhost")
    return side


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    patch = pytest.MonkeyPatch()
    yield patch
    patch.undo()
