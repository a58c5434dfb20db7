"""The Celery application: broker and results in Redis, one queue per worker host.

Delivery, deliberately:

- ``task_acks_late=False``: a message is acknowledged when its task starts. Whether a
  tool call ran is not Celery's to decide: the call's run ticket (state/calls.py) is
  claimed before it runs, so it runs at most once even if a message were delivered twice,
  and a worker that dies mid-call is noticed by its heartbeat and the ticket, not by a
  redelivery that would run the command again.
- ``ack_emulation=False``: kombu's emulation of acknowledgements keeps every delivered
  message in an "unacked" hash until its ack, and puts it back after a visibility timeout
  if the worker was killed first: two more round trips per message (measured by
  tests/e2e/test_round_trips.py) for a redelivery we never want. A message a killed worker
  had reserved is past its ``expires`` (the call's own bound) by the time it would come
  back, and the API has cancelled its ticket when the heartbeat stopped, so it would be
  dropped anyway; the API answers such a call 503, never run, and its retry runs it. A
  worker that stops warmly still gives its reserved messages back.
- Every publish carries ``expires``; replies go through Redis lists, not the result
  backend (state/replies.py). Results expire after an hour; the rollout store keeps what
  matters.
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from typing import Any

from celery import Celery
from celery import shared_task as _shared_task
from pydantic import BaseModel

from orchestrator.config import Settings, get_settings
from orchestrator.state.keys import Keys
from orchestrator.state.resp import CONNECT_TIMEOUT_S, REPLY_TIMEOUT_S
from orchestrator.state.sentinel import SentinelUrl, is_sentinel
from orchestrator.state.wire import ReplyT, Request, RequestT, Task, TaskName

HUNG_REDIS_OPTIONS: dict[str, Any] = {
    "socket_timeout": REPLY_TIMEOUT_S,
    "socket_connect_timeout": CONNECT_TIMEOUT_S,
    "health_check_interval": 5,
}
"""kombu's, for a Redis that hangs (frozen, or cut off without a reset: a failover's old
primary). Without a socket timeout a publish on it waited forever, and with it the worker's
whole consumer loop, a Celery heartbeat's publish included (tests/k8s/test_helm_install.py,
the chart's Sentinel mode: no task consumed again after the failover). The health check
drops the consumer's BRPOP connection once its reply is overdue by this many seconds past
the BRPOP's own second, so it finds the new primary within about 11 s (kombu's default,
25, is about 51 s)."""


def make_celery(settings: Settings) -> Celery:
    keys = Keys.of(settings.deployment)
    # The tasks register themselves where they are defined (:func:`handles`): a worker
    # process imports them through celery_main.py; the API publishes by name
    # (state/wire.TaskName) and never loads a worker's code.
    url, sentinel_options = celery_url(settings.redis_url)
    app = Celery("orchestrator", broker=url, backend=url)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_acks_late=False,
        worker_prefetch_multiplier=1,
        task_default_queue=keys.shared_queue,
        result_expires=3600,
        broker_connection_retry_on_startup=True,
        # Named, not left to Celery to look up: every received message with an expiry
        # (all of ours) asks for it, and the lookup walked every layer of the settings.
        timezone="UTC",
        # No rate limits are set: without this, every message is checked for one.
        worker_disable_rate_limits=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_ignore_result=False,
        broker_transport_options={
            "ack_emulation": False,
            "client_name": keys.client_name("broker"),
            **HUNG_REDIS_OPTIONS,
            **sentinel_options,
        },
        result_backend_transport_options={**HUNG_REDIS_OPTIONS, **sentinel_options},
        redis_socket_timeout=REPLY_TIMEOUT_S,
        redis_socket_connect_timeout=CONNECT_TIMEOUT_S,
    )
    return app


def celery_url(redis_url: str) -> tuple[str, dict[str, Any]]:
    """``redis_url`` as kombu and Celery's Redis backend spell it, with the transport
    options it needs: a Unix socket is ``redis+socket:///path`` to them (``unix:///path``
    to redis-py and the settings); a Sentinel-watched primary (state/sentinel.py) is
    ``sentinel://host:port;sentinel://...`` and the service's name as ``master_name``."""
    if is_sentinel(redis_url):
        return SentinelUrl.parse(redis_url).celery()
    if redis_url.startswith("unix://"):
        return "redis+socket://" + redis_url.removeprefix("unix://"), {}
    return redis_url, {}


@lru_cache(maxsize=1)
def celery_app() -> Celery:
    """The process's Celery app, from the process's settings."""
    return make_celery(get_settings())


Handler = Callable[[RequestT], ReplyT | None]
Push = Callable[[Request, BaseModel], None]


def handles(
    task: Task[RequestT, ReplyT], push: Push | None = None
) -> Callable[[Handler[RequestT, ReplyT]], Handler[RequestT, ReplyT]]:
    """Register ``handler`` as ``task``'s Celery task (``shared_task`` by the task's name):
    the JSON payload is validated into ``task.request``, and a reply the handler returns
    is given to ``push`` (the worker's: to the list the caller waits on, state/replies.py);
    a handler that replies later itself, or never, returns None. Celery gets None back:
    results are ignored, and it would make a repr of one after every run. The handler is
    returned as it was, to be called directly."""

    def register(handler: Handler[RequestT, ReplyT]) -> Handler[RequestT, ReplyT]:
        _shared_task(name=task.name.value)(runner(task, handler, push))
        return handler

    return register


def runner(
    task: Task[RequestT, ReplyT], handler: Handler[RequestT, ReplyT], push: Push | None
) -> Callable[[dict[str, Any]], None]:
    """What Celery runs for ``handler``: the payload validated into ``task.request`` (one
    that is not raises, and nothing runs), the reply, if any, given to ``push``."""

    def run(payload: dict[str, Any]) -> None:
        request = task.request.model_validate(payload)
        reply = handler(request)
        if reply is not None and push is not None:
            push(request, reply)

    run.__name__ = run.__qualname__ = handler.__name__
    run.__doc__ = handler.__doc__
    run.__module__ = handler.__module__
    return run


def task_message(
    app: Celery, task: TaskName, payload_json: str, *, queue: str, expires_s: float | None
) -> str:
    """The message that publishing ``task`` with ``payload_json`` (its one argument, as
    JSON text) to ``queue`` puts on the queue's Redis list,
    built without publishing it: Celery's own task message (protocol 2) in kombu's Redis
    envelope (the body base64, the delivery info naming the queue). Pushed by our own
    client, it costs one round trip on the event loop instead of a thread hop into kombu's
    producer, and a Lua script can push it in the same step as the state change it belongs
    to (state/calls.ApiCalls.begin).

    The headers are ``app.amqp.as_task_v2``'s, made once per task and process
    (:func:`_headers`): per message only the id, the expiry and the arguments' summary
    change. Made whole for each message they cost 270 us of the API's CPU per tool call,
    most of it Celery's timezone arithmetic for ``expires``. tests/test_broker.py checks the
    result against what ``send_task`` pushes, field by field, and every tool call of the
    suite is delivered this way to a real Celery worker."""
    task_id = str(uuid.uuid4())
    headers = dict(_headers(app, task.value, os.getpid()))
    headers["id"] = headers["root_id"] = task_id
    # argsrepr is what monitoring shows of the arguments: saferepr of a tool call's whole
    # payload cost more than the rest of the message.
    headers["argsrepr"] = f"[{task.name.lower()}]"
    properties: dict[str, Any] = {
        "correlation_id": task_id,
        "reply_to": "",
        "delivery_mode": 2,
        "priority": 0,
        "delivery_info": {"exchange": "", "routing_key": queue},
        "body_encoding": "base64",
        "delivery_tag": str(uuid.uuid4()),
    }
    if expires_s is not None:
        headers["expires"] = (datetime.now(UTC) + timedelta(seconds=expires_s)).isoformat()
        properties["expiration"] = str(int(expires_s * 1000))
    # The payload arrives as JSON already (a model's dump): spliced in, not parsed again.
    body = f"[[{payload_json}],{{}},{_NO_CANVAS}]".encode()
    return json.dumps(
        {
            "body": base64.b64encode(body).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": headers,
            "properties": properties,
        },
        separators=(",", ":"),
    )


# A task message's embed: no callbacks, errbacks, chain or chord.
_NO_CANVAS = json.dumps(
    {"callbacks": None, "errbacks": None, "chain": None, "chord": None}, separators=(",", ":")
)


@lru_cache(maxsize=64)
def _headers(app: Celery, task: str, pid: int) -> dict[str, Any]:
    """The protocol-2 headers Celery gives a message of ``task`` sent by this process
    (``pid``: its ``origin`` names the process), with no expiry, the result ignored."""
    message = app.amqp.as_task_v2(
        "", task, args=[], kwargs={}, expires=None, ignore_result=True, kwargsrepr="{}"
    )
    headers: dict[str, Any] = message.headers
    return headers
