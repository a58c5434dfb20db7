"""The queue's wire as one table (state/wire.Tasks): every task named once, with its
request and reply, and registered on the worker under that name by a handler that takes
the request model and gives back the reply model (state/broker.handles)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

import orchestrator.celery_main  # noqa: F401  # registers both sides' tasks
from orchestrator.sandbox.backend import FileOpResult, FileRefused, SandboxHandle
from orchestrator.state import broker
from orchestrator.state.wire import (
    Created,
    DropSnapshot,
    FileOpDone,
    FileOpReply,
    InfraFault,
    InputNotTaken,
    InputSent,
    InputWritten,
    OpDone,
    Request,
    RunTestsReply,
    SandboxCreated,
    SandboxKilled,
    SandboxMeasured,
    Signalled,
    SignalReply,
    SnapshotDropped,
    SnapshotMade,
    SnapshotNotTaken,
    Task,
    TaskName,
    Tasks,
)


def _table() -> list[Task[Any, Any]]:
    return [value for value in vars(Tasks).values() if isinstance(value, Task)]


def test_every_task_is_in_the_table_once_under_its_own_name() -> None:
    names = [task.name for task in _table()]
    assert sorted(names) == sorted(TaskName)
    for attribute, task in vars(Tasks).items():
        if isinstance(task, Task):
            assert attribute == task.name.name


def test_every_task_of_the_table_is_registered_on_the_worker() -> None:
    registered = broker.celery_app().tasks
    for task in _table():
        assert task.name.value in registered, task.name


def test_a_handler_takes_its_request_model_and_its_reply_is_pushed_to_the_caller() -> None:
    pushed: list[tuple[Request, BaseModel]] = []
    seen: list[DropSnapshot] = []

    def drop(request: DropSnapshot) -> SnapshotDropped:
        seen.append(request)
        return SnapshotDropped(removed=True)

    run = broker.runner(Tasks.DROP_SNAPSHOT, drop, lambda r, reply: pushed.append((r, reply)))
    run({"snapshot_id": "s1", "reply_to": "reply:1"})  # as Celery calls it
    assert seen == [DropSnapshot(snapshot_id="s1", reply_to="reply:1")]
    assert pushed == [(seen[0], SnapshotDropped(removed=True))]
    with pytest.raises(ValidationError):  # a payload that is not the request: never run
        run({"reply_to": "reply:2"})
    assert len(seen) == 1


def test_a_handler_that_replies_later_pushes_nothing_now() -> None:
    pushed: list[Any] = []
    run = broker.runner(Tasks.SWEEP_HOST, lambda request: None, lambda *a: pushed.append(a))
    run({})
    assert pushed == []


_NOW = datetime(2026, 12, 4, tzinfo=UTC)
_HANDLE = SandboxHandle(
    sandbox_id="sbx-1",
    backend="docker",
    native_id="c1",
    rollout_id="r1",
    host="h1",
    image="i",
    runtime="runc",
    created_at=_NOW,
    expires_at=_NOW,
)
_FAULT = InfraFault(error="SandboxUnavailable: gone", evidence={"probe": {"state": "exited"}})


@pytest.mark.parametrize(
    "reply",
    [
        SandboxCreated(Created(handle=_HANDLE)),
        SandboxCreated(_FAULT),
        FileOpReply(FileOpDone(result=FileOpResult(data=b"\xff\x00 not utf-8"))),
        FileOpReply(FileRefused(error="not_found", message="/x: no such file")),
        FileOpReply(_FAULT),
        RunTestsReply(_FAULT),
        SignalReply(Signalled(found=False)),
        SignalReply(_FAULT),
        InputSent(InputWritten(found=True)),
        InputSent(InputNotTaken(reason="its input is closed")),
        InputSent(_FAULT),
        SnapshotMade(SnapshotNotTaken(reason="too many generations")),
        SnapshotMade(_FAULT),
        SandboxMeasured(_FAULT),
        OpDone(outcome=FileRefused(error="binary", message="a binary file")),
        OpDone(outcome=SandboxKilled(cause="memory_limit", detail="oom_killed=True")),
        OpDone(outcome=_FAULT, queue_ms=1.5, exec_ms=2.5),
    ],
)
def test_a_reply_is_one_variant_of_its_union_and_crosses_the_wire_as_it(reply: Any) -> None:
    """Either/or results are tagged unions (ok | the caller's or agent's doing | ours), the
    infrastructure's fault the one InfraFault in every reply that can have one: what the
    worker sends is what the API matches on, variant and all."""
    again = type(reply).model_validate_json(reply.model_dump_json())
    assert again == reply
    inner = again.outcome if isinstance(again, OpDone) else again.root
    sent = reply.outcome if isinstance(reply, OpDone) else reply.root
    assert type(inner) is type(sent)


def test_a_reply_of_another_shape_is_refused_not_read_as_empty() -> None:
    """An optional pair read a reply it did not know as all-None (a tool call's "result"
    missing scored as nothing); a tagged union refuses it."""
    with pytest.raises(ValidationError):
        OpDone.model_validate({"result": None, "infra_error": None})
    with pytest.raises(ValidationError):
        FileOpReply.model_validate({"kind": "moved", "result": {}})
