"""What a failure of shared state looks like to the code above it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

T = TypeVar("T")

StateError = RedisError
"""Redis failed us (down, restarting, a command timed out): an infrastructure fault the
API answers with 503 (api/errors.py) and the status view shows as Redis down. The layers
above state/ catch this name, never Redis's own."""


async def outlasting_an_outage(
    operation: Callable[[], Awaitable[T]], *, for_s: float, pause_s: float = 0.2
) -> T:
    """``operation()``, asked again while Redis cannot be reached, for up to ``for_s``
    seconds: for a step whose loss would strand what it records (a sandbox made, and its
    rollout never told). Only for an operation safe to run twice; any other error, or an
    outage past the bound, is raised."""
    deadline = time.monotonic() + for_s
    while True:
        try:
            return await operation()
        except (RedisConnectionError, RedisTimeoutError):
            if time.monotonic() + pause_s > deadline:
                raise
            await asyncio.sleep(pause_s)
