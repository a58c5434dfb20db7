"""Entry point for ``celery -A orchestrator.celery_main``: the worker process's Celery app,
with the worker's tasks registered (queue/handlers.py) and its lifecycle wired to Celery's
signals. The reaper is a process of its own (``orchestrator reaper``, rollouts/reaper.py)."""

from orchestrator.queue import handlers
from orchestrator.state.broker import celery_app

handlers.connect_to_celery()
app = celery_app()
