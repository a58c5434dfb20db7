"""Connections to Redis for the code above state/, which never imports redis itself, and
the one place a redis-py client is made from the deployment's ``redis_url``: a plain Redis
URL, or a Sentinel-watched primary (state/sentinel.py)."""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis

from orchestrator.state.resp import CONNECT_TIMEOUT_S, REPLY_TIMEOUT_S, SyncConnection
from orchestrator.state.sentinel import SentinelUrl, is_sentinel

SyncRedis = redis.Redis
"""A blocking client: the worker's (Celery runs tasks in threads)."""


def redis_client(redis_url: str, **options: Any) -> redis.Redis:
    """A blocking redis-py client of ``redis_url``; ``options`` are redis-py's (timeouts,
    ``client_name``, ...). Behind Sentinel its pool asks the Sentinels where the primary is
    at each new connection, so it follows a failover."""
    if not is_sentinel(redis_url):
        return redis.Redis.from_url(redis_url, **options)
    parsed = SentinelUrl.parse(redis_url)
    made: redis.Redis = parsed.sentinel().master_for(
        parsed.service, db=parsed.db, **parsed.auth(), **options
    )
    return made


def async_redis_client(redis_url: str, **options: Any) -> aioredis.Redis:
    """:func:`redis_client`, asyncio."""
    if not is_sentinel(redis_url):
        return aioredis.Redis.from_url(redis_url, **options)
    parsed = SentinelUrl.parse(redis_url)
    made: aioredis.Redis = parsed.async_sentinel().master_for(
        parsed.service, db=parsed.db, **parsed.auth(), **options
    )
    return made


def worker_client(redis_url: str, name: str) -> SyncRedis:
    """A client of the worker process, its connections named ``name`` (state/keys.Keys.
    client_name). Its pool holds up to 256 connections: more than the worker's threads
    (Celery's, the creation lane's) that can hold one at once. A reply later than
    :data:`~orchestrator.state.resp.REPLY_TIMEOUT_S` is an error (a hung Redis answers
    nothing), and the next command connects again."""
    return redis_client(
        redis_url,
        max_connections=256,
        client_name=name,
        socket_timeout=REPLY_TIMEOUT_S,
        socket_connect_timeout=CONNECT_TIMEOUT_S,
    )


def call_path_connection(redis_url: str, name: str) -> SyncConnection:
    """The worker's lean connection for the tool call's path (state/resp.py): one per
    thread, named ``name``."""
    return SyncConnection(redis_url, name)
