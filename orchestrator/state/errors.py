"""What a failure of shared state looks like to the code above it."""

from __future__ import annotations

from redis.exceptions import RedisError

StateError = RedisError
"""Redis failed us (down, restarting, a command timed out): an infrastructure fault the
API answers with 503 (api/errors.py) and the status view shows as Redis down. The layers
above state/ catch this name, never Redis's own."""
