"""The Celery application: broker and results in Redis, one queue per worker host.

Delivery, deliberately:

- ``task_acks_late=False``: a message is acknowledged when its task starts. Whether a
  tool call ran is not Celery's to decide: the call's run ticket (state/tickets.py) is
  claimed before it runs, so it runs at most once even if a message were delivered twice,
  and a worker that dies mid-call is noticed by its heartbeat and the ticket, not by a
  redelivery that would run the command again.
- ``visibility_timeout``: a message a worker reserved but never started (the worker was
  killed) comes back after this long. By then its ``expires`` (the call's own bound) has
  passed and the API has cancelled its ticket, so it is dropped; it is set just above the
  longest bound so nothing still wanted is ever dropped early.
- Every publish carries ``expires``; replies go through Redis lists, not the result
  backend (state/replies.py). Results expire after an hour; the rollout store keeps what
  matters.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

from celery import Celery
from celery import shared_task as _shared_task

from orchestrator.config import Settings, get_settings
from orchestrator.state.keys import Keys
from orchestrator.state.tasks import TaskName


def make_celery(settings: Settings) -> Celery:
    keys = Keys.of(settings.deployment)
    # The tasks register themselves where they are defined (:func:`task`): a worker
    # process imports them through celery_main.py; the API publishes by name
    # (state/tasks.TaskName) and never loads a worker's code.
    app = Celery("orchestrator", broker=settings.redis_url, backend=settings.redis_url)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_acks_late=False,
        worker_prefetch_multiplier=1,
        task_default_queue=keys.shared_queue,
        result_expires=3600,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        task_ignore_result=False,
        broker_transport_options={
            "visibility_timeout": int(settings.command_timeout_max_s + settings.queue_wait_s + 60)
        },
        beat_schedule={
            "reap": {
                "task": TaskName.REAP.value,
                "schedule": settings.reaper_interval_s,
                "args": ({},),
                "options": {"queue": keys.shared_queue, "expires": settings.reaper_interval_s},
            }
        },
    )
    return app


@lru_cache(maxsize=1)
def celery_app() -> Celery:
    """The process's Celery app, from the process's settings."""
    return make_celery(get_settings())


Task = Callable[[dict[str, Any]], dict[str, Any]]


def task(name: TaskName) -> Callable[[Task], Task]:
    """Register a task under its name (Celery's ``shared_task``, typed): it takes and
    returns a JSON payload, the models of state/tasks.py dumped."""
    decorator: Callable[[Task], Task] = _shared_task(name=name.value)
    return decorator
