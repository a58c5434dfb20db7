"""Snapshots, forks and pauses through the stock ``e2b`` SDK (docs/snapshots.md,
docs/e2b.md), on the shared side deployment: ``create_snapshot`` (filesystem),
``list_snapshots``, ``Sandbox.create(snapshot)``, ``delete_snapshot``, ``fork``, ``pause``
and resume by ``connect`` or by the next request; what a sandbox made from a snapshot sees,
that nothing one of them does reaches another, and that a paused one holds no container and
no slot, under runc and gVisor."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import redis
from e2b import Sandbox, SandboxException, SandboxNotFoundException, SandboxState

from orchestrator.config import Runtime
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.state.keys import Keys
from tests.e2e.conftest import ACT_ENVIRONMENTS
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2b")

SET_UP = (
    "echo configured >> README.md && mkdir -p .venv/bin && echo tool > .venv/bin/tool && "
    "rm -r src && echo scratch > /tmp/state && mkdir -p ~/.cache && echo warm > ~/.cache/c"
)
LOOK = "tail -1 README.md; cat .venv/bin/tool /tmp/state ~/.cache/c; ls"


@pytest.fixture()
def made(e2b_stack: Stack) -> Iterator[list[Sandbox]]:
    """Every sandbox a test makes, killed after it."""
    sandboxes: list[Sandbox] = []
    yield sandboxes
    for sandbox in sandboxes:
        sandbox.kill()


def _set_up(made: list[Sandbox], template: str) -> Sandbox:
    parent = Sandbox.create(template=template, timeout=300)
    made.append(parent)
    parent.commands.run(SET_UP)
    return parent


def _looks_set_up(sandbox: Sandbox) -> None:
    lines = sandbox.commands.run(LOOK).stdout.splitlines()
    assert lines[:4] == ["configured", "tool", "scratch", "warm"], lines
    assert "src" not in lines[4:] and "README.md" in lines[4:]


def test_snapshots_are_made_listed_used_and_deleted(e2b_stack: Stack, made: list[Sandbox]) -> None:
    parent = _set_up(made, e2b_stack.codebase)
    named = parent.create_snapshot("set-up", mode="filesystem")
    assert named.snapshot_id.startswith("snap-") and named.names == ["set-up"]
    default = parent.create_snapshot()  # the API's default kind: here, the filesystem
    listed = Sandbox.list_snapshots(sandbox_id=parent.sandbox_id)
    ids = [s.snapshot_id for s in listed.next_items()]
    assert ids == [named.snapshot_id, default.snapshot_id]
    by_name = Sandbox.list_snapshots(name="set-up").next_items()
    assert [s.snapshot_id for s in by_name] == [named.snapshot_id]

    # By its id, or by its name: the parent's files, not its processes, in a sandbox of
    # its own that the parent's later writes do not reach.
    parent.commands.run("echo later > /tmp/later")
    children = [Sandbox.create(named.snapshot_id, timeout=120), Sandbox.create("set-up")]
    made.extend(children)
    for child in children:
        _looks_set_up(child)
        assert not child.files.exists("/tmp/later")
        assert child.get_info().template_id in (named.snapshot_id, "set-up")
    children[0].commands.run("echo mine > /tmp/state")
    assert children[1].commands.run("cat /tmp/state").stdout == "scratch\n"
    assert parent.commands.run("cat /tmp/state").stdout == "scratch\n"

    # Deleted: no new sandbox from it; those made from it run on.
    assert Sandbox.delete_snapshot(named.snapshot_id) is True
    assert Sandbox.delete_snapshot(named.snapshot_id) is False
    with pytest.raises(SandboxException, match="no such snapshot"):
        Sandbox.create(named.snapshot_id)
    _looks_set_up(children[1])
    assert Sandbox.delete_snapshot(default.snapshot_id) is True


def test_a_memory_snapshot_is_refused_saying_what_is_served(
    e2b_stack: Stack, made: list[Sandbox]
) -> None:
    parent = _set_up(made, e2b_stack.codebase)
    with pytest.raises(SandboxException, match="mode='filesystem'"):
        parent.create_snapshot(mode="full")
    assert parent.commands.run("cat /tmp/state").stdout == "scratch\n"
    assert Sandbox.list_snapshots(sandbox_id=parent.sandbox_id).next_items() == []


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_a_fork_is_a_group_of_set_up_sandboxes(
    e2b_stack: Stack, made: list[Sandbox], runtime: Runtime
) -> None:
    parent = _set_up(made, f"{ACT_ENVIRONMENTS[runtime]}/{e2b_stack.codebase}")
    forks = parent.fork(count=3, timeout=120)
    sandboxes = [f for f in forks if isinstance(f, Sandbox)]
    made.extend(sandboxes)
    assert len(sandboxes) == 3, forks
    assert len({s.sandbox_id for s in [parent, *sandboxes]}) == 4
    for fork in sandboxes:
        _looks_set_up(fork)
    # Divergent from here on: each fork's writes are its own.
    for i, fork in enumerate(sandboxes):
        fork.commands.run(f"echo {i} > /tmp/state && echo {i} >> README.md")
    for i, fork in enumerate(sandboxes):
        assert fork.commands.run("cat /tmp/state; tail -1 README.md").stdout == f"{i}\n{i}\n"
    assert parent.commands.run("cat /tmp/state").stdout == "scratch\n"
    # A fork's snapshot is its own: not listed, gone with the fork's last sandbox.
    assert Sandbox.list_snapshots(sandbox_id=parent.sandbox_id).next_items() == []


def test_a_fork_of_a_sandbox_that_is_gone_is_not_found(e2b_stack: Stack) -> None:
    parent = Sandbox.create(template=e2b_stack.codebase, timeout=60)
    parent.kill()
    with pytest.raises(SandboxNotFoundException):
        parent.fork(count=2)


def _sandboxes_of(stack: Stack, sandbox_id: str) -> list[str]:
    backend = DockerBackend(stack.settings)
    try:
        return [h.sandbox_id for h in backend.list_owned() if h.rollout_id == sandbox_id]
    finally:
        backend.client.close()


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_a_paused_sandbox_holds_nothing_and_resumes_as_it_was(
    e2b_stack: Stack, made: list[Sandbox], runtime: Runtime
) -> None:
    sbx = _set_up(made, f"{ACT_ENVIRONMENTS[runtime]}/{e2b_stack.codebase}")
    sbx.set_timeout(200)
    sbx.commands.run("sleep 600", background=True, timeout=700)
    assert sbx.pause() is True
    assert sbx.pause() is False  # paused already
    # No container, no slot: its record names no host.
    assert _sandboxes_of(e2b_stack, sbx.sandbox_id) == []
    with redis.Redis.from_url(e2b_stack.settings.redis_url, decode_responses=True) as client:
        record = client.hget(Keys.of(e2b_stack.settings.deployment).rollout(sbx.sandbox_id), "host")
    assert record in (None, "", "null"), record
    info = sbx.get_info()
    assert info.state == SandboxState.PAUSED
    listed = {s.sandbox_id: s.state for s in Sandbox.list().next_items()}
    assert listed[sbx.sandbox_id] == SandboxState.PAUSED

    # connect resumes it: its files, not its processes; its timeout as it was left.
    again = Sandbox.connect(sbx.sandbox_id)
    _looks_set_up(again)
    assert again.commands.list() == []
    assert again.get_info().state == SandboxState.RUNNING
    left = (again.get_info().end_at - datetime.now(UTC)).total_seconds()
    assert 150 < left <= 200, left
    assert len(_sandboxes_of(e2b_stack, sbx.sandbox_id)) == 1

    # Paused again, the next command resumes it (as E2B resumes on traffic).
    again.commands.run("echo after > /tmp/after")
    assert again.pause() is True
    assert sbx.commands.run("cat /tmp/after /tmp/state").stdout == "after\nscratch\n"


def test_a_paused_sandbox_is_killed_and_a_memory_pause_refused(
    e2b_stack: Stack, made: list[Sandbox]
) -> None:
    sbx = _set_up(made, e2b_stack.codebase)
    with pytest.raises(SandboxException, match="mode='filesystem'"):
        sbx.pause(mode="full")
    assert sbx.is_running()
    assert sbx.pause(mode="filesystem") is True
    assert sbx.kill() is True
    assert Sandbox.kill(sbx.sandbox_id) is False
    with pytest.raises(SandboxException):
        Sandbox.connect(sbx.sandbox_id)


def test_metrics_say_what_a_sandbox_uses_now(e2b_stack: Stack, made: list[Sandbox]) -> None:
    sbx = _set_up(made, e2b_stack.codebase)
    sbx.commands.run("head -c 5000000 /dev/zero > /workspace/blob")
    busy = sbx.commands.run("timeout 3 sh -c 'while :; do :; done'", background=True)
    (metric,) = sbx.get_metrics()
    assert metric.cpu_count >= 1 and metric.cpu_used_pct > 20, metric
    assert 0 < metric.mem_used < metric.mem_total
    assert metric.disk_total > metric.disk_used >= 5_000_000, metric
    busy.kill()
    assert sbx.pause() is True
    assert Sandbox.get_metrics(sbx.sandbox_id) == []  # paused: nothing runs
