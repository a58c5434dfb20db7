"""The queue's wire as one table (state/wire.Tasks): every task named once, with its
request and reply, and registered on the worker under that name by a handler that takes
the request model and gives back the reply model (state/broker.handles)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

import orchestrator.celery_main  # noqa: F401  # registers both sides' tasks
from orchestrator.state import broker
from orchestrator.state.wire import (
    DropSnapshot,
    Request,
    SnapshotDropped,
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
