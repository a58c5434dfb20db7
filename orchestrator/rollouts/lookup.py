"""A rollout's record, looked up one way everywhere on the API side.

An id the client names and no record has, or another tenant's, is the client's mistake: a
404 (:func:`unknown`, :func:`known`, :func:`owned`). A record that was there when an
operation began and is gone before it ends is ours: Redis lost it (records are never
expired), so the request is a 503 (:class:`RolloutVanished`, via :func:`present`), never
an assertion or a quiet success.
"""

from __future__ import annotations

from orchestrator.rollouts.errors import Rejected, RejectedKind, RolloutVanished
from orchestrator.state.records import Rollout, RolloutStore
from orchestrator.tenants import OPERATOR, Principal


def unknown(rollout_id: str) -> Rejected:
    """The 404 for an id no rollout has."""
    return Rejected(RejectedKind.NOT_FOUND, f"unknown rollout {rollout_id}", code="unknown_rollout")


async def known(store: RolloutStore, rollout_id: str, caller: Principal = OPERATOR) -> Rollout:
    """The rollout the client names; :func:`unknown` when there is none, or it is another
    tenant's (docs/tenancy.md: a 404, never a 403, so an id says nothing)."""
    return owned(await store.get(rollout_id), rollout_id, caller)


def owned(rollout: Rollout | None, rollout_id: str, caller: Principal) -> Rollout:
    """``rollout`` when ``caller`` may see it; :func:`unknown` when it is None or not."""
    if rollout is None or not caller.sees(rollout.tenant):
        raise unknown(rollout_id)
    return rollout


def present(record: Rollout | None, rollout_id: str, during: str) -> Rollout:
    """``record`` (a read or an update of a rollout known to exist); :class:`RolloutVanished`
    (``"the rollout vanished while " + during``) when it came back None."""
    if record is None:
        raise RolloutVanished(rollout_id, during)
    return record
