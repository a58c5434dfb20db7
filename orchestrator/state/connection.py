"""Connections to Redis for the code above state/, which never imports redis itself."""

from __future__ import annotations

import redis

from orchestrator.state.resp import SyncConnection

SyncRedis = redis.Redis
"""A blocking client: the worker's (Celery runs tasks in threads)."""


def worker_client(redis_url: str, name: str) -> SyncRedis:
    """A client of the worker process, its connections named ``name`` (state/keys.Keys.
    client_name). Its pool holds up to 256 connections: more than the worker's threads
    (Celery's, the creation lane's) that can hold one at once."""
    return redis.Redis.from_url(redis_url, max_connections=256, client_name=name)


def call_path_connection(redis_url: str, name: str) -> SyncConnection:
    """The worker's lean connection for the tool call's path (state/resp.py): one per
    thread, named ``name``."""
    return SyncConnection(redis_url, name)
