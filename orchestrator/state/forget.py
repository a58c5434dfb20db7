"""Forgetting a deployment: every key it left in Redis deleted, for a deployment that is
over for good (a benchmark's, a test run's). A deployment that keeps running keeps its
records for their retention (state/records.py); this is not how they expire."""

from __future__ import annotations

from orchestrator.state.connection import redis_client
from orchestrator.state.keys import deployment_patterns

_BATCH = 1000


def forget_deployment(redis_url: str, deployment: str) -> int:
    """Delete every key of ``deployment`` (state/keys.deployment_patterns: a trailing ``*``
    takes every deployment named with that prefix); returns how many went. Scanned 1,000
    at a time: Redis may hold many keys of others (at SCAN's default of 10, one clean-up
    among a bench's 100,000 retained records took 20 s)."""
    client = redis_client(redis_url)
    deleted = 0
    try:
        for pattern in deployment_patterns(deployment):
            doomed = list(client.scan_iter(match=pattern, count=_BATCH))
            for start in range(0, len(doomed), _BATCH):
                deleted += int(client.delete(*doomed[start : start + _BATCH]))
    finally:
        client.close()
    return deleted
