"""The Celery application: broker and results in Redis, one queue per worker host.

Delivery is at most once (early acknowledgement): a tool call whose worker dies is
reported to the trainer as an infrastructure error after a bounded wait, never run again
behind its back. Results expire after an hour; the rollout store keeps what matters.
"""

from __future__ import annotations

from functools import lru_cache

from celery import Celery

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
        broker_transport_options={"visibility_timeout": 3600},
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
