"""Entry point for ``celery -A orchestrator.celery_main``: the process's Celery app, with
the tasks of both sides registered (the worker's, queue/handlers.py; the reaper's,
rollouts/reaper.py). The one module that imports both: the composition root."""

import orchestrator.rollouts.reaper  # noqa: F401 - registers the reaper's task
from orchestrator.queue import handlers
from orchestrator.state.broker import celery_app

handlers.connect_to_celery()
app = celery_app()
