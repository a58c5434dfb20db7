"""What a sandbox pod's status says: its state, whether it can serve, whose fault a broken
one is, and the outcome a call to it gets. Pure, so each case is tested on the status
objects Kubernetes reports (tests/k8s/test_states.py).

The mapping (docs/kubernetes-backend.md has it as a table):

- Running and Ready: ``running``, ok.
- Pending: ``pending`` while it may still start; ``unschedulable`` (no node fits it) and
  ``image_pull_failed`` are evidence; past the pending timeout, or pulling in back-off, the
  create fails: infra_error.
- The sandbox container OOM-killed: ``oom_killed``, agent_error (``memory_limit``): the
  sandbox's own memory limit, which only what the agent ran can fill (on cgroup v2 the
  kubelet kills the whole container at its first OOM kill, like gVisor on Docker).
- Evicted for going past its own /workspace or ephemeral-storage limit: ``evicted``,
  agent_error (``disk_limit``); evicted because the node ran short: infra_error.
- Past ``activeDeadlineSeconds`` (its lifetime): ``deadline_exceeded``, infra_error.
- Node lost (phase Unknown, a NodeLost reason, a DisruptionTarget condition, or deleted by
  the taint manager), pod gone or being deleted: infra_error.
- The agent ended otherwise (exit status, Succeeded): ``exited``, infra_error.
"""

from __future__ import annotations

from lightkube.models.core_v1 import ContainerStatus, PodCondition
from lightkube.resources.core_v1 import Pod
from pydantic import BaseModel

from orchestrator.outcomes import Outcome

CONTAINER = "sandbox"
# Waiting reasons that end a start at once: retrying will not find the image.
PULL_FATAL = frozenset({"ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"})
PULL_FAILING = PULL_FATAL | {"ErrImagePull"}
# What the kubelet's eviction message says when the pod went past its own limits (the
# agent filled its disk) rather than the node running short.
OWN_DISK_LIMIT_TEXT = (
    "exceeds the limit",
    "exceeded its local ephemeral storage limit",
    "exceeds the total limit of containers",
)
NODE_LOST_REASONS = frozenset({"NodeLost", "NodeShutdown", "Shutdown", "Terminated"})
SIGKILL_EXIT = 137


class PodVerdict(BaseModel):
    """One reading of a sandbox pod."""

    state: str
    alive: bool = False
    ready: bool = False
    outcome: Outcome
    fatal: bool = False
    agent_caused: str | None = None
    exit_code: int | None = None
    oom_killed: bool = False
    detail: str = ""

    @property
    def starting(self) -> bool:
        """Still on its way to Ready: worth waiting for."""
        return not self.ready and not self.fatal


def assess(
    pod: Pod | None, *, pending_for_s: float = 0.0, pending_timeout_s: float = 0.0
) -> PodVerdict:
    """Read a pod's status. ``pending_for_s`` (how long the pod has waited to be Ready) past
    ``pending_timeout_s`` (> 0) makes a pod still starting fatal, with its state as the
    evidence of why it did not start."""
    if pod is None:
        return _infra(
            "missing",
            "the pod is gone (destroyed, evicted through the API, or deleted with its lost node)",
        )
    status = pod.status
    meta = pod.metadata
    phase = (status.phase if status else None) or "Pending"
    conditions = {c.type: c for c in (status.conditions if status else None) or []}
    disruption = conditions.get("DisruptionTarget")
    containers = (status.containerStatuses if status else None) or []
    main = next((c for c in containers if c.name == CONTAINER), None)
    terminated = main.state.terminated if main and main.state else None

    if terminated is not None and terminated.reason == "OOMKilled":
        return PodVerdict(
            state="oom_killed",
            outcome=Outcome.AGENT_ERROR,
            agent_caused="memory_limit",
            fatal=True,
            exit_code=terminated.exitCode,
            oom_killed=True,
            detail=f"the sandbox was OOM-killed at its memory limit (exit {terminated.exitCode})",
        )
    reason = (status.reason if status else None) or ""
    message = ((status.message if status else None) or "").strip()
    if phase == "Failed" and reason == "Evicted":
        if any(text in message for text in OWN_DISK_LIMIT_TEXT):
            return PodVerdict(
                state="evicted",
                outcome=Outcome.AGENT_ERROR,
                agent_caused="disk_limit",
                fatal=True,
                detail=f"evicted for going past its own disk limit: {message}",
            )
        return _infra("evicted", f"evicted by its node: {message}")
    if phase == "Failed" and reason == "DeadlineExceeded":
        return _infra("deadline_exceeded", f"past its lifetime (activeDeadlineSeconds): {message}")
    if phase == "Unknown" or reason in NODE_LOST_REASONS:
        return _infra("node_lost", f"its node is lost: phase={phase} reason={reason} {message}")
    if disruption is not None and disruption.status == "True":
        return _infra("node_lost", f"being removed: {_condition(disruption)}")
    if meta is not None and meta.deletionTimestamp is not None:
        return _infra("terminating", "the pod is being deleted")
    seed = _failed_init(pod) if terminated is None else None
    if phase == "Failed" and seed is not None:
        # The agent never started: the evidence is the init container that failed.
        ended = seed.state.terminated if seed.state else None
        seed_code = ended.exitCode if ended else None
        seed_why = f"{ended.reason or ''} {(ended.message or '').strip()}".strip() if ended else ""
        return PodVerdict(
            state="exited",
            outcome=Outcome.INFRA_ERROR,
            fatal=True,
            exit_code=seed_code,
            detail=f"init container {seed.name} failed: exit={seed_code} reason={seed_why} "
            f"{message}".strip(),
        )
    if phase in ("Failed", "Succeeded") or terminated is not None:
        code = terminated.exitCode if terminated else None
        why = terminated.reason if terminated else reason
        return PodVerdict(
            state="exited",
            outcome=Outcome.INFRA_ERROR,
            fatal=True,
            exit_code=code,
            detail=f"the exec agent ended: phase={phase} exit={code} reason={why} {message}",
        )
    if phase == "Running":
        ready = conditions.get("Ready")
        if ready is not None and ready.status == "True":
            return PodVerdict(state="running", alive=True, ready=True, outcome=Outcome.OK)
        # Its containers run but it is not Ready: the agent stopped listening, or its node
        # stopped reporting (the node controller marks the pods of a NotReady node so).
        detail = f"running but not Ready: {_condition(ready) if ready else 'no Ready condition'}"
        return _starting("not_ready", detail, True, pending_for_s, pending_timeout_s)
    return _pending(pod, conditions, pending_for_s, pending_timeout_s)


def _pending(
    pod: Pod, conditions: dict[str, PodCondition], pending_for_s: float, timeout_s: float
) -> PodVerdict:
    status = pod.status
    everyone = [*((status.initContainerStatuses if status else None) or [])]
    everyone += (status.containerStatuses if status else None) or []
    for container in everyone:
        waiting = container.state.waiting if container.state else None
        if waiting is not None and waiting.reason in PULL_FAILING:
            detail = f"cannot pull the image of {container.name}: {_waiting(container)}"
            if waiting.reason in PULL_FATAL:
                return _infra("image_pull_failed", detail)
            return _starting("image_pull_failed", detail, False, pending_for_s, timeout_s)
    scheduled = conditions.get("PodScheduled")
    if scheduled is not None and scheduled.status == "False":
        return _starting(
            "unschedulable" if scheduled.reason == "Unschedulable" else "pending",
            f"not scheduled: {_condition(scheduled)}",
            False,
            pending_for_s,
            timeout_s,
        )
    waits = [f"{c.name}: {_waiting(c)}" for c in everyone if c.state and c.state.waiting]
    detail = "pending" + (f" ({'; '.join(waits)})" if waits else "")
    return _starting("pending", detail, False, pending_for_s, timeout_s)


def _failed_init(pod: Pod) -> ContainerStatus | None:
    """The init container that ended with a non-zero exit, if any."""
    inits = (pod.status.initContainerStatuses if pod.status else None) or []
    for container in inits:
        ended = container.state.terminated if container.state else None
        if ended is not None and ended.exitCode != 0:
            return container
    return None


def _starting(
    state: str, detail: str, alive: bool, pending_for_s: float, timeout_s: float
) -> PodVerdict:
    """A pod that may still become Ready (an unschedulable pod may get a node from the
    cluster's autoscaler, a failed pull may succeed on retry), until the timeout."""
    if timeout_s and pending_for_s > timeout_s:
        return _infra(state, f"not Ready within {timeout_s:g} s: {detail}")
    return PodVerdict(state=state, alive=alive, outcome=Outcome.INFRA_ERROR, detail=detail)


def _infra(state: str, detail: str) -> PodVerdict:
    return PodVerdict(state=state, outcome=Outcome.INFRA_ERROR, fatal=True, detail=detail)


def _condition(condition: PodCondition) -> str:
    text = f"{condition.type}={condition.status}"
    if condition.reason:
        text += f" reason={condition.reason}"
    if condition.message:
        text += f" {condition.message.strip()}"
    return text


def _waiting(container: ContainerStatus) -> str:
    waiting = container.state.waiting if container.state else None
    if waiting is None:
        return "waiting"
    return f"{waiting.reason or 'waiting'} {(waiting.message or '').strip()}".strip()
