"""``orchestrator up`` stopped with Ctrl-C ends what it holds: its rollouts are closed as
ended by us (a trainer coming back is told to discard them, a graded one keeps its
score), and every sandbox it made, the warm pool's included, is destroyed, so nothing is
left running until the next start. ``--keep-sandboxes`` leaves both as they were, and the
restarted stack takes them up again."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.local import free_port
from orchestrator.outcomes import Cause
from tests.e2e.helpers import error_code, function_call, new_trace, owned_count, wait_for
from tests.stacks import Stack, deployment

pytestmark = pytest.mark.xdist_group("e2e")

POOL = 2


@pytest.fixture()
def up_stack(stack: Stack, tmp_path: Path) -> Iterator[Stack]:
    """The settings of an ``orchestrator up`` of its own (deployment, port, host), with a
    warm pool; its Redis keys and any sandbox left are removed at the end."""
    env_file = tmp_path / "environments.yaml"
    env_file.write_text(
        yaml.safe_dump(
            {
                "environments": [
                    {
                        "name": "pooled",
                        "codebase": stack.codebase,
                        "pool_size": POOL,
                        "tools": ["shell", "read_file"],
                        "grader": {"name": "file_f1"},
                        # A graded rollout stays open (and is the teardown's to end).
                        "grace_after_grade_s": 60,
                    }
                ]
            }
        )
    )
    up = deployment(
        stack.settings,
        f"up{uuid.uuid4().hex[:4]}",
        logs=tmp_path,
        codebase=stack.codebase,
        environments_file=env_file,
        default_environment="pooled",
        reaper_interval_s=1.0,
        worker_metrics_port=free_port(),
    )
    try:
        yield up
    finally:
        # `orchestrator up` is the test's to start and stop; what it left is the stack's.
        up.shut_down()


@contextmanager
def running_up(stack: Stack, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """``orchestrator up ARGS`` until ready (its warm pool full); the block stops it."""
    assert stack.logs is not None
    log = (stack.logs / "up.log").open("ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "up", *args],
        env=stack.env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        stack.wait_ready(timeout_s=90)
        wait_for(lambda: owned_count(stack.settings) >= POOL, timeout_s=60, what="the pool to fill")
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _ctrl_c(proc: subprocess.Popen[bytes], logs: Path) -> str:
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=90) == 0, (logs / "up.log").read_text()[-3000:]
    return (logs / "up.log").read_text()


def _grade(trace: str, item: dict[str, Any]) -> dict[str, Any]:
    return {"sample": {"output_text": "src/requests/api.py"}, "item": item, "trace_id": trace}


def _item(stack: Stack) -> dict[str, Any]:
    return {
        "codebase": stack.codebase,
        "prompt": "Make Session.request honour a default timeout.",
        "gold_files": ["src/requests/api.py"],
    }


def test_ctrl_c_ends_its_rollouts_and_destroys_every_sandbox(up_stack: Stack) -> None:
    item = _item(up_stack)
    working, graded = new_trace(), new_trace()
    with running_up(up_stack) as proc:
        with up_stack.client() as client:
            for trace in (working, graded):
                shell = function_call(trace, item, "shell", {"command": "echo hi"})
                reply = client.post("/agent-rft/tools", json=shell)
                assert reply.status_code == 200, reply.text
            scored = client.post("/agent-rft/grade", json=_grade(graded, item))
            assert scored.status_code == 200, scored.text
            assert scored.json()["score"] == 1.0
        # Two rollouts' sandboxes and the refilled pool.
        wait_for(lambda: owned_count(up_stack.settings) >= 2 + POOL, timeout_s=60)
        output = _ctrl_c(proc, up_stack.logs or Path())
    assert "ended 2 rollouts" in output, output[-2000:]
    assert owned_count(up_stack.settings) == 0, "every sandbox went with the stack"

    # The trainer comes back to a restarted stack: the rollout it was working on is to be
    # discarded (503, the cause said), never scored; the graded one keeps its score.
    with running_up(up_stack) as proc, up_stack.client() as client:
        view = client.get(f"/v1/rollouts/{working}").json()
        assert view["state"] == "closed", view
        assert view["ended_by"]["cause"] == Cause.STACK_STOPPED, view
        later = client.post(
            "/agent-rft/tools", json=function_call(working, item, "shell", {"command": "ls"})
        )
        assert later.status_code == 503, later.text
        assert error_code(later) == Cause.STACK_STOPPED
        refused = client.post("/agent-rft/grade", json=_grade(working, item))
        assert refused.status_code == 503, refused.text
        kept = client.post("/agent-rft/grade", json=_grade(graded, item))
        assert kept.status_code == 200, kept.text
        assert kept.json()["score"] == 1.0
        assert client.get(f"/v1/rollouts/{graded}").json()["ended_by"] is None
        _ctrl_c(proc, up_stack.logs or Path())
    assert owned_count(up_stack.settings) == 0


def test_keep_sandboxes_leaves_them_for_the_next_start(up_stack: Stack) -> None:
    item = _item(up_stack)
    trace = new_trace()
    echo = {"command": "echo kept > /tmp/mark; cat /tmp/mark"}
    with running_up(up_stack, "--keep-sandboxes") as proc:
        with up_stack.client() as client:
            reply = client.post("/agent-rft/tools", json=function_call(trace, item, "shell", echo))
            assert reply.status_code == 200, reply.text
        wait_for(lambda: owned_count(up_stack.settings) >= 1 + POOL, timeout_s=60)
        output = _ctrl_c(proc, up_stack.logs or Path())
    assert "ended" not in output.split("Ctrl-C stops everything.")[-1]
    assert owned_count(up_stack.settings) == 1 + POOL, "kept: the rollout's and the pool's"
    with running_up(up_stack) as proc, up_stack.client() as client:
        again = client.post(
            "/agent-rft/tools",
            json=function_call(trace, item, "shell", {"command": "cat /tmp/mark"}),
        )
        assert again.status_code == 200, again.text
        assert again.json()["output"].strip() == "kept", "the same sandbox, taken up again"
        output = _ctrl_c(proc, up_stack.logs or Path())
    assert owned_count(up_stack.settings) == 0


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed parent's children may be left unreaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def test_a_killed_up_takes_its_worker_api_and_reaper_with_it(up_stack: Stack) -> None:
    """SIGKILLed, ``up`` cannot stop its children: they end themselves when it dies (a
    worker left running went on refilling its pool with nobody to end it)."""
    with running_up(up_stack) as proc:
        children = _children(proc.pid)
        assert len(children) == 3, children  # worker, reaper, API
        proc.kill()
        proc.wait()
        wait_for(
            lambda: not any(_running(pid) for pid in children),
            timeout_s=60,
            what="the worker, reaper and API to end with their parent",
        )
    # The drained worker kept its pool's sandboxes, as a restarted production worker does;
    # the next start's sweep (here, the fixture's) takes them.
