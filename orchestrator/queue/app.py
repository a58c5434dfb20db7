"""The Celery application: broker and results in Redis, one queue per worker host.

Delivery, deliberately:

- ``task_acks_late=False``: a message is acknowledged when its task starts. Whether a
  tool call ran is not Celery's to decide: the call's run ticket (rollouts/tickets.py) is
  claimed before it runs, so it runs at most once even if a message were delivered twice,
  and a worker that dies mid-call is noticed by its heartbeat and the ticket, not by a
  redelivery that would run the command again.
- ``visibility_timeout``: a message a worker reserved but never started (the worker was
  killed) comes back after this long. By then its ``expires`` (the call's own bound) has
  passed and the API has cancelled its ticket, so it is dropped; it is set just above the
  longest bound so nothing still wanted is ever dropped early.
- Every publish carries ``expires``; replies go through Redis lists, not the result
  backend (queue/client.py). Results expire after an hour; the rollout store keeps what
  matters.
"""

from __future__ import annotations

from functools import lru_cache

from celery import Celery
from kombu.transport.redis import PRIORITY_STEPS, Channel

from orchestrator.config import Settings, get_settings


def make_celery(settings: Settings) -> Celery:
    app = Celery("orchestrator", broker=settings.redis_url, backend=settings.redis_url)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_acks_late=False,
        worker_prefetch_multiplier=1,
        task_default_queue=settings.shared_queue,
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
                "task": "orchestrator.reap",
                "schedule": settings.reaper_interval_s,
                "args": ({},),
                "options": {"queue": settings.shared_queue, "expires": settings.reaper_interval_s},
            }
        },
    )
    import orchestrator.queue.tasks  # noqa: F401 - registers the shared tasks on this app

    return app


@lru_cache(maxsize=1)
def celery_app() -> Celery:
    """The process's Celery app, from the process's settings."""
    return make_celery(get_settings())


def queue_depth_keys(queue: str) -> list[str]:
    """The Redis lists kombu keeps one Celery queue's waiting messages in (one per
    priority step: the queue's own name, then siblings with kombu's separator)."""
    return [queue if step == 0 else f"{queue}{Channel.sep}{step}" for step in PRIORITY_STEPS]
