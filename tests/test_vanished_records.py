"""A missing rollout record is handled one way (rollouts/lookup.py), against a real Redis:
an id nobody created is the client's 404; a record that vanishes mid-operation is our 503
(never an assertion); failing a vanished rollout raises nothing, so its caller's own 503
and the reaper's pass go on."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest

from orchestrator.config import Settings
from orchestrator.environments.loader import load_environments
from orchestrator.outcomes import Cause
from orchestrator.rollouts.errors import InfraError, Rejected, RejectedKind, RolloutVanished
from orchestrator.rollouts.lookup import known, present
from orchestrator.rollouts.service import RolloutService
from orchestrator.state.broker import celery_app
from orchestrator.state.forget import forget_deployment
from orchestrator.state.models import RolloutSource, RolloutState
from orchestrator.state.records import Rollout, RolloutStore
from orchestrator.state.replies import WorkerClient

pytestmark = pytest.mark.anyio


@pytest.fixture()
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture()
async def service(settings: Settings) -> AsyncIterator[RolloutService]:
    """A service on its own deployment's keys (nothing runs: no worker is asked)."""
    own = settings.model_copy(
        update={"deployment": f"{settings.deployment}-vn{uuid.uuid4().hex[:4]}"}
    )
    store = RolloutStore.connect(own)
    queue = WorkerClient(own, celery_app(), store)
    yield RolloutService(own, store, load_environments(own), queue)
    await store.close()
    forget_deployment(own.redis_url, own.deployment)


def _record(rollout_id: str, state: RolloutState) -> Rollout:
    now = time.time()
    return Rollout(
        rollout_id=rollout_id,
        source=RolloutSource.API,
        environment="default",
        image="unused",
        state=state,
        created_at=now,
        last_activity=now,
    )


async def test_an_id_nobody_created_is_a_404(service: RolloutService) -> None:
    with pytest.raises(Rejected) as found:
        await known(service.store, "never-made")
    assert (found.value.kind, found.value.code) == (RejectedKind.NOT_FOUND, "unknown_rollout")
    with pytest.raises(Rejected) as closed:
        await service.close("never-made", "deleted")
    assert (closed.value.kind, closed.value.code) == (RejectedKind.NOT_FOUND, "unknown_rollout")


async def test_a_record_that_vanishes_while_its_sandbox_is_made_is_a_503(
    service: RolloutService,
) -> None:
    store = service.store
    assert await store.create(_record("r1", RolloutState.CREATING))
    creating = await known(store, "r1")
    waiting = asyncio.ensure_future(service.starter.wait_ready(creating))
    await asyncio.sleep(0.05)
    await store.redis.delete(store.keys.rollout("r1"))
    with pytest.raises(RolloutVanished) as vanished:
        await asyncio.wait_for(waiting, 5)
    assert isinstance(vanished.value, InfraError)
    assert vanished.value.code == Cause.STATE_LOST
    assert vanished.value.message == "the rollout vanished while its sandbox was being made"


async def test_present_passes_a_record_through_and_names_what_was_under_way() -> None:
    record = _record("r2", RolloutState.ACTIVE)
    assert present(record, "r2", "it was graded") is record
    with pytest.raises(RolloutVanished, match="the rollout vanished while it was graded"):
        present(None, "r2", "it was graded")


async def test_failing_a_vanished_rollout_raises_nothing_but_its_own_error(
    service: RolloutService,
) -> None:
    error = await service.fail("gone", Cause.SANDBOX_DEAD, "the sandbox died", {})
    assert (error.code, error.message) == (Cause.SANDBOX_DEAD, "the sandbox died")
