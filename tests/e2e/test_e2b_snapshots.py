"""Snapshots and forks through the stock ``e2b`` SDK (docs/snapshots.md, docs/e2b.md), on the
shared side deployment: ``create_snapshot`` (filesystem), ``list_snapshots``,
``Sandbox.create(snapshot)``, ``delete_snapshot``, ``fork``; what a sandbox made from a
snapshot sees, and that nothing one of them does reaches another, under runc and gVisor."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from e2b import Sandbox, SandboxException, SandboxNotFoundException

from orchestrator.config import Runtime
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
