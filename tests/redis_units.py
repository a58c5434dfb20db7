"""Helpers for the tests of state/ on real Redis (no fixtures here: see conftest.py): a
deployment of a test's own, its keys deleted after, and pool sandbox handles."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import redis

from orchestrator.config import Settings
from orchestrator.sandbox.backend import SandboxHandle
from orchestrator.state.forget import forget_deployment

POOLED_ENVIRONMENT = """\
environments:
  - name: pooled
    image: orchestrator/sandbox-base:latest
    pool_size: 2
    tools: [shell]
    grader: {name: file_f1}
"""
"""One environment, ``pooled``, with a warm pool (its pool: ``pooled:-``)."""


@contextmanager
def own_deployment(
    settings: Settings, suffix: str, environments: Path | None = None
) -> Iterator[Settings]:
    """``settings`` on a deployment of their own (and ``environments``, if given); every
    Redis key of that deployment is deleted at the end."""
    update: dict[str, object] = {"deployment": f"{settings.deployment}-{suffix}"}
    if environments is not None:
        update["environments_file"] = environments
    own = settings.model_copy(update=update)
    try:
        yield own
    finally:
        forget_deployment(own.redis_url, own.deployment)


def delete_keys(redis_url: str, pattern: str) -> None:
    """Delete every key matching ``pattern``: a test's own keys that belong to no
    deployment (a deployment's go with state/forget.forget_deployment). Scanned 1,000 at a
    time, as Redis may hold many keys of others."""
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=pattern, count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def pool_handle(host: str, sandbox_id: str, image: str = "img") -> SandboxHandle:
    """A pool sandbox's handle (rollout ``pool``), an hour from its expiry."""
    now = datetime.now(UTC)
    return SandboxHandle(
        sandbox_id=sandbox_id,
        backend="docker",
        host=host,
        runtime="runc",
        rollout_id="pool",
        image=image,
        native_id=sandbox_id,
        created_at=now,
        expires_at=now + timedelta(hours=1),
    )
