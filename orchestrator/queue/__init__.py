"""The queue: Celery over Redis, one queue per worker host, and the tasks workers run."""
