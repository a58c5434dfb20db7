"""A command's output as it is printed, from the worker that runs it to the API that
serves it to a client (the E2B API's commands: docs/e2b.md). Each piece is appended to the
call's stream list (``Keys.output_stream``) by the worker while the command runs, before its
result; readers follow the list from their own position, so a client that reattaches to a
command reads it from the start, and two readers never take pieces from each other."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable

import redis.asyncio as aioredis

from orchestrator.state.connection import SyncRedis

STREAM_TTL_S = 900
"""A stream outlives its command by this much at most (a reattaching client reads it)."""
FOLLOW_POLL_S = (0.02, 0.1)
"""How often a reader looks for new pieces: at first, and at most (backing off)."""


class OutputSink:
    """The worker's side: ``sink(stream, data)`` appends a piece (one round trip)."""

    def __init__(self, client: SyncRedis, key: str) -> None:
        self._client = client
        self._key = key
        self._first = True

    def __call__(self, stream: str, data: bytes) -> None:
        piece = json.dumps([stream, base64.b64encode(data).decode()])
        if self._first:  # the list's lifetime, set once
            pipe = self._client.pipeline(transaction=False)
            pipe.rpush(self._key, piece)
            pipe.expire(self._key, STREAM_TTL_S)
            pipe.execute()
            self._first = False
        else:
            self._client.rpush(self._key, piece)


async def follow(
    client: aioredis.Redis, key: str, done: Callable[[], bool]
) -> AsyncIterator[tuple[str, bytes]]:
    """The API's side: every piece of the stream, from its start, as it comes, until
    ``done()`` (the command's result is in: its worker appended every piece before it)."""
    position = 0
    delay = FOLLOW_POLL_S[0]
    while True:
        finished = done()  # before the read: nothing comes after a result
        pieces = await client.lrange(key, position, -1)
        for raw in pieces:
            stream, data = json.loads(raw)
            yield str(stream), base64.b64decode(data)
        position += len(pieces)
        if finished:
            return
        if pieces:
            delay = FOLLOW_POLL_S[0]
        else:
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, FOLLOW_POLL_S[1])
