"""Which ended rollouts give their sandbox back to a pool instead of destroying it.

A sandbox is recycled only after a clean end: its rollout neither failed for an
infrastructure reason nor ran out its lifetime, it is not an E2B client's (whose templates
and timeouts are the client's), its environment asks for reuse (``reuse``, default
``settings.sandbox_reuse``) and it has served fewer than ``max_reuses`` rollouts after its
first, and it has half its lifetime left at least (a pool prunes those anyway). The worker
then says no as well when the sandbox hit a limit (an OOM kill, its process limit, a full
/workspace), when its pool is full or no longer wants its spec, or when the reset's audit
finds any difference from a fresh sandbox (queue/handlers.recycle_sandbox): then it is
destroyed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from orchestrator.config import Settings
from orchestrator.environments.loader import ResolvedEnvironment
from orchestrator.outcomes import Cause, Outcome
from orchestrator.rollouts.errors import InfraError
from orchestrator.state.models import RolloutState
from orchestrator.state.pool_sizing import POOL_LABEL, pool_name, recycles
from orchestrator.state.records import Rollout
from orchestrator.state.wire import RecycleSandbox


class RecyclePolicy:
    def __init__(
        self, settings: Settings, environment_of: Callable[[Rollout], ResolvedEnvironment]
    ) -> None:
        self.settings = settings
        self.environment_of = environment_of

    def request(
        self, rollout: Rollout, reason: str, ended_by: Cause | None
    ) -> RecycleSandbox | None:
        """The recycle task for ``rollout``'s sandbox (its ``transit`` still to be filled
        in by the caller), or None: destroy it."""
        handle = rollout.sandbox
        if handle is None or rollout.e2b or rollout.snapshot:
            return None  # (a snapshot's sandbox serves its own rollout only)
        failed = rollout.state == RolloutState.INFRA_FAILED or rollout.infra_failure
        if failed or rollout.outcome == Outcome.INFRA_ERROR:
            return None
        if ended_by == Cause.LIFETIME_EXCEEDED:
            return None
        try:
            resolved = self.environment_of(rollout)
        except InfraError:
            return None
        env = resolved.environment
        if not recycles(env, self.settings) or handle.reuse_count >= env.max_reuses:
            return None
        if env.setup is not None:
            return None  # its rollouts start from their group's snapshot, never a pool
        spec = resolved.sandbox_spec(self.settings, POOL_LABEL)
        if handle.expires_at.timestamp() - time.time() < spec.lifetime_s / 2:
            return None
        return RecycleSandbox(
            handle=handle,
            spec=spec,
            pool=pool_name(env.name, resolved.codebase),
            transit="",
            reason=reason,
        )
