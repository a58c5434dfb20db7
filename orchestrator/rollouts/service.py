"""The rollout lifecycle: create a rollout's sandbox on its first call, route its calls to
the host holding it, keep calls idempotent and within budget, record the trajectory,
grade, and end.

The API calls this; it never talks to Docker. Workers run the tools (queue/handlers.py).

:class:`RolloutService` is the one object the API, the E2B layer and the reaper hold. It
owns nothing of its own: it wires the lifecycle's parts, each a module readable alone, and
its public methods are theirs:

- ``starts.py`` (:class:`Starter`): resolve a row, acquire and start a sandbox, wait for it;
- ``calls.py`` (:class:`ToolCalls`): the call loop, given the start and the close;
- ``grades.py`` (:class:`Grading`): grade once, given the start and the close;
- ``closes.py`` (:class:`Closer`): close a rollout, fail it, refuse one that failed;
- ``snapshots.py`` (:class:`Snapshots`): snapshot a rollout's sandbox, start from one.

They share ``models.py`` (a call's reply, a new record) and ``lookup.py`` (a missing record:
the client's 404, or a 503 when it vanished mid-operation).
"""

from __future__ import annotations

from orchestrator.config import Settings
from orchestrator.environments.loader import EnvironmentRegistry
from orchestrator.rollouts.calls import ToolCalls
from orchestrator.rollouts.closes import Closer
from orchestrator.rollouts.dispatch import CallDispatcher
from orchestrator.rollouts.grades import Grading
from orchestrator.rollouts.recycling import RecyclePolicy
from orchestrator.rollouts.snapshots import Snapshots
from orchestrator.rollouts.starts import Starter
from orchestrator.state.admission import Admission
from orchestrator.state.pools import PoolClaims
from orchestrator.state.quotas import TenantQuotas
from orchestrator.state.records import RolloutStore
from orchestrator.state.replies import WorkerClient


class RolloutService:
    def __init__(
        self,
        settings: Settings,
        store: RolloutStore,
        environments: EnvironmentRegistry,
        queue: WorkerClient,
    ) -> None:
        self.settings = settings
        self.store = store
        self.environments = environments
        self.queue = queue
        self.keys = store.keys
        self.dispatcher = CallDispatcher(settings, store, queue)
        self.admission = Admission(settings, store.redis)
        self.pools = PoolClaims(settings, store.redis)
        self.quotas = TenantQuotas(store)
        # The close comes first: every other part may fail a rollout or refuse a failed one.
        self.closer = Closer(store, queue, self.admission, self.quotas)
        self.starter = Starter(
            settings, store, environments, queue, self.admission, self.pools, self.closer
        )
        self.closer.recycling = RecyclePolicy(settings, self.starter.environment_of)
        self.closer.pools = self.pools
        self.calls = ToolCalls(settings, store, queue, self.dispatcher, self.starter, self.closer)
        self.grading = Grading(settings, store, self.starter, self.closer)
        self.snapshots = Snapshots(
            settings, queue, self.starter, self.calls.call_tool, self.closer.close
        )
        self.starter.group_setup = self.snapshots.for_group

        self.resolve = self.starter.resolve
        self.aresolve = self.starter.aresolve
        self.environment_of = self.starter.environment_of
        self.start = self.starter.start
        self.call_tool = self.calls.call_tool
        self.grade = self.grading.grade
        self.close = self.closer.close
        self.fail = self.closer.fail
        self.mark_infra_failed = self.closer.mark_infra_failed
