"""Entry point for ``celery -A orchestrator.queue.celery_main``: the process's Celery app."""

from orchestrator.queue.app import celery_app

app = celery_app()
