"""The task message we push ourselves (state/broker.task_message) is the one Celery's own
publish pushes, on real Redis, and a real Celery worker runs it."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker

from orchestrator.config import Settings
from orchestrator.state.broker import celery_url, make_celery, task_message
from orchestrator.state.forget import forget_deployment
from orchestrator.state.keys import Keys
from orchestrator.state.wire import TaskName

# Set by each message's own publish: ids, clocks, who sent it.
_PER_MESSAGE_HEADERS = {"id", "root_id", "expires", "origin", "argsrepr", "kwargsrepr"}
_PER_MESSAGE_PROPERTIES = {"correlation_id", "reply_to", "delivery_tag"}


@pytest.fixture
def scratch(settings: Settings) -> Iterator[tuple[Settings, str]]:
    own = settings.model_copy(
        update={"deployment": f"{settings.deployment}-broker-{uuid.uuid4().hex[:8]}"}
    )
    queue = Keys.of(own.deployment).host_queue("scratch")
    yield own, queue
    forget_deployment(own.redis_url, own.deployment)


def _pushed(client: redis.Redis, queue: str) -> dict[str, Any]:
    raw = client.rpop(queue)
    assert isinstance(raw, bytes), "nothing was pushed"
    message: dict[str, Any] = json.loads(raw)
    return message


def test_the_message_is_the_one_celery_publishes(scratch: tuple[Settings, str]) -> None:
    settings, queue = scratch
    app = make_celery(settings)
    payload = {"rollout_id": "r1", "arguments": {"cmd": "echo é"}, "n": [1, 2.5, None]}
    client = redis.Redis.from_url(settings.redis_url)
    try:
        app.send_task(
            TaskName.RUN_OP.value, args=[payload], queue=queue, expires=30, ignore_result=True
        )
        theirs = _pushed(client, queue)
        client.lpush(
            queue,
            task_message(app, TaskName.RUN_OP, json.dumps(payload), queue=queue, expires_s=30),
        )
        ours = _pushed(client, queue)
    finally:
        client.close()
    assert ours.keys() == theirs.keys()
    for part in ("content-encoding", "content-type"):
        assert ours[part] == theirs[part]
    assert ours["headers"].keys() == theirs["headers"].keys()
    for name, value in theirs["headers"].items():
        if name not in _PER_MESSAGE_HEADERS:
            assert ours["headers"][name] == value, name
    assert ours["headers"]["id"] == ours["headers"]["root_id"]
    assert ours["properties"].keys() == theirs["properties"].keys()
    for name, value in theirs["properties"].items():
        if name not in _PER_MESSAGE_PROPERTIES:
            assert ours["properties"][name] == value, name
    assert ours["properties"]["correlation_id"] == ours["headers"]["id"]
    decoded = [json.loads(base64.b64decode(m["body"])) for m in (ours, theirs)]
    assert decoded[0] == decoded[1]


def test_a_real_worker_runs_it(scratch: tuple[Settings, str]) -> None:
    settings, queue = scratch
    app: Celery = make_celery(settings)
    seen: list[dict[str, Any]] = []
    # A task of its own name on a throwaway app: the product's tasks need a sandbox host.
    echo_name = f"test.echo.{uuid.uuid4().hex[:6]}"

    @app.task(name=echo_name)  # type: ignore[untyped-decorator]
    def echo(payload: dict[str, Any]) -> None:
        seen.append(payload)

    message = task_message(app, TaskName.RUN_OP, '{"x": 1}', queue=queue, expires_s=60)
    # The same envelope, naming the throwaway task.
    envelope = json.loads(message)
    envelope["headers"]["task"] = echo_name
    client = redis.Redis.from_url(settings.redis_url)
    try:
        with start_worker(app, queues=[queue], perform_ping_check=False, pool="solo"):
            client.lpush(queue, json.dumps(envelope))
            deadline = time.monotonic() + 10
            while not seen and time.monotonic() < deadline:
                time.sleep(0.02)
    finally:
        client.close()
    assert seen == [{"x": 1}]


def test_a_unix_socket_url_is_spelled_for_kombu() -> None:
    assert celery_url("unix:///run/redis.sock?db=2") == ("redis+socket:///run/redis.sock?db=2", {})
    assert celery_url("redis://127.0.0.1:6379/0") == ("redis://127.0.0.1:6379/0", {})
    assert celery_url("rediss://:pw@h:6380/1") == ("rediss://:pw@h:6380/1", {})
    # Behind Sentinel: kombu's list of Sentinels, the service as its master_name.
    assert celery_url("redis+sentinel://:pw@s1:26379,s2:26380/orch/2") == (
        "sentinel://:pw@s1:26379/2;sentinel://:pw@s2:26380/2",
        {"master_name": "orch", "sentinel_kwargs": {"username": None, "password": "pw"}},
    )
