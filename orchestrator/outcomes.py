"""The one outcome taxonomy every tool call and rollout ends in (see docs/architecture.md)."""

from enum import StrEnum


class Outcome(StrEnum):
    """How a tool call or a rollout ended.

    ``ok`` and ``agent_error`` are the agent's business and are scored; ``infra_error`` is
    ours and must never reach the grader as a zero; ``rejected`` never reached a sandbox.
    """

    OK = "ok"
    AGENT_ERROR = "agent_error"
    INFRA_ERROR = "infra_error"
    REJECTED = "rejected"


class Cause(StrEnum):
    """Why a rollout failed for infrastructure reasons (``infra_failure.cause``, the code
    of its 503s, the ``cause`` label of ``orchestrator_infra_errors_total``); also the
    codes of 503s that fail nothing. docs/failure-model.md has the table."""

    INFRA_ERROR = "infra_error"
    """No more precise cause."""
    NOT_RUN = "not_run"
    """A call that never ran and never will: its retry may run it. Fails nothing."""
    STARTING = "starting"
    """The sandbox is still being made when the request's time is up. Fails nothing."""
    CALL_IN_PROGRESS = "call_in_progress"
    """An earlier attempt of the call still runs when the request's time is up. Fails
    nothing: a retry gets its result."""
    SANDBOX_CREATE_FAILED = "sandbox_create_failed"
    REPO_UNAVAILABLE = "repo_unavailable"
    """No host could tell whether a row's commit is in its repository (the source or a
    host's store failed, or no worker answered). Fails nothing: nothing is recorded."""
    SNAPSHOT_FAILED = "snapshot_failed"
    """A snapshot of a sandbox could not be taken (its host failed, or none answered).
    Fails nothing: the sandbox runs on, and no snapshot is recorded."""
    SNAPSHOT_UNAVAILABLE = "snapshot_unavailable"
    """The host that keeps a snapshot is gone, or lost it: no sandbox can be made from it."""
    TOOL_CALL_FAILED = "tool_call_failed"
    TOOL_SERVICE_FAILED = "tool_service_failed"
    """An HTTP tool's service answered 5xx, timed out or refused the connection (or a
    secret its headers name could not be read): the operator's service, never the agent."""
    WORKER_STOPPED = "worker_stopped"
    """The worker stopped (shutdown, scale-down) before a running call finished."""
    SANDBOX_DEAD = "sandbox_dead"
    PROBE_FAILED = "probe_failed"
    WORKER_LOST = "worker_lost"
    CALL_OVERRAN = "call_overran"
    HOST_LOST = "host_lost"
    HOST_UNHEALTHY = "host_unhealthy"
    STUCK_CREATING = "stuck_creating"
    IDLE_REAPED = "idle_reaped"
    """Ended by us: no call for the environment's ``idle_timeout_s``."""
    LIFETIME_EXCEEDED = "lifetime_exceeded"
    """Ended by us: past the environment's maximum lifetime."""
    ENVIRONMENT_REMOVED = "environment_removed"
    """Ended by us: its environment is no longer in the configuration."""
    STACK_STOPPED = "stack_stopped"
    """Ended by us: the local stack (``orchestrator up``) that held its sandbox stopped."""
    STATE_LOST = "state_lost"
    """Redis lost the rollout's record (no copy survived); its sandbox, still on a host,
    was ended by that host's worker, which failed the rollout in a record of its own."""
    STATE_FAILOVER = "state_failover"
    """Redis failed over to a replica while the rollout ran: the record may miss the last
    writes the old primary took (replication is asynchronous), so it is never scored."""
