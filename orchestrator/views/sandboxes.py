"""This host's sandboxes and who holds each now.

A sandbox's labels name the rollout it was made for, fixed when it was created; a pooled
sandbox that was recycled has served others since. Its current owner is Redis's to say
(state/pools.PoolStanding: in a pool, being recycled, or taken by a rollout), so the
listing reads Redis and keeps the label only as the first owner, a hint.
"""

from __future__ import annotations

from orchestrator.config import Settings
from orchestrator.sandbox.backend import SandboxBackend
from orchestrator.state.errors import StateError
from orchestrator.state.pools import PoolStanding, read_pool_standings
from orchestrator.views.models import SandboxListing, SandboxView


def list_sandboxes(settings: Settings, backend: SandboxBackend) -> SandboxListing:
    """The deployment's sandboxes on ``backend``'s host, oldest first, each with its current
    owner (one round trip to Redis for all of them). A Redis that cannot be read leaves the
    owners to the labels, and says so (``redis_error``)."""
    handles = sorted(backend.list_owned(), key=lambda h: h.created_at)
    error = None
    standings: list[PoolStanding | None]
    try:
        standings = list(read_pool_standings(settings, handles))
    except (StateError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        standings = [None] * len(handles)
    views = [
        SandboxView(
            sandbox_id=h.sandbox_id,
            owner=h.rollout_id if standing is None else standing.owner(h.rollout_id),
            owner_known=standing is not None,
            recycling=standing is not None and standing.recycling,
            first_rollout=h.rollout_id,
            host=h.host,
            runtime=h.runtime,
            image=h.image,
            created_at=h.created_at,
            expires_at=h.expires_at,
        )
        for h, standing in zip(handles, standings, strict=True)
    ]
    return SandboxListing(sandboxes=views, redis_error=error)
