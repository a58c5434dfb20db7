"""Pod statuses, in the shapes Kubernetes reports them, mapped to a state, an outcome and
whose fault it is; and the events kept as a failed start's evidence."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from lightkube.models.core_v1 import ObjectReference
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Pod

from orchestrator.outcomes import Outcome
from orchestrator.sandbox.k8s.backend import evidence_events
from orchestrator.sandbox.k8s.states import assess

T0 = "2030-01-02T03:04:05Z"
IMAGE = "registry.example.com/orchestrator/codebase:flask"


def pod(status: dict[str, Any], **meta: Any) -> Pod:
    return cast(
        Pod,
        Pod.from_dict(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "orch-prod-sbx-0123456789ab", "namespace": "sbx", **meta},
                "spec": {"containers": [{"name": "sandbox", "image": IMAGE}]},
                "status": status,
            }
        ),
    )


def cond(
    kind: str, status: str, reason: str | None = None, message: str | None = None
) -> dict[str, Any]:
    found: dict[str, Any] = {
        "type": kind,
        "status": status,
        "lastTransitionTime": T0,
        "lastProbeTime": None,
    }
    if reason:
        found["reason"] = reason
    if message:
        found["message"] = message
    return found


def sandbox_status(state: dict[str, Any], ready: bool = False) -> dict[str, Any]:
    return {
        "name": "sandbox",
        "image": IMAGE,
        "imageID": "",
        "ready": ready,
        "restartCount": 0,
        "started": ready,
        "state": state,
        "lastState": {},
    }


RUNNING_READY = {
    "phase": "Running",
    "podIP": "10.244.1.17",
    "podIPs": [{"ip": "10.244.1.17"}],
    "hostIP": "192.168.49.2",
    "qosClass": "Guaranteed",
    "startTime": T0,
    "conditions": [
        cond("PodReadyToStartContainers", "True"),
        cond("Initialized", "True"),
        cond("Ready", "True"),
        cond("ContainersReady", "True"),
        cond("PodScheduled", "True"),
    ],
    "containerStatuses": [sandbox_status({"running": {"startedAt": T0}}, ready=True)],
}

UNSCHEDULABLE = {
    "phase": "Pending",
    "qosClass": "Guaranteed",
    "conditions": [
        cond(
            "PodScheduled",
            "False",
            "Unschedulable",
            "0/3 nodes are available: 3 Insufficient memory. preemption: 0/3 nodes are "
            "available: 3 No preemption victims found for incoming pod.",
        )
    ],
}

SEED_PULLING: dict[str, Any] = {
    "name": "workspace-seed",
    "image": IMAGE,
    "imageID": "",
    "ready": False,
    "restartCount": 0,
    "started": False,
    "lastState": {},
}

IMAGE_PULL_BACKOFF: dict[str, Any] = {
    "phase": "Pending",
    "hostIP": "192.168.49.2",
    "podIP": "10.244.1.18",
    "qosClass": "Guaranteed",
    "startTime": T0,
    "conditions": [
        cond(
            "Initialized",
            "False",
            "ContainersNotInitialized",
            "containers with incomplete status: [workspace-seed]",
        ),
        cond("Ready", "False", "ContainersNotReady", "containers with unready status: [sandbox]"),
        cond("PodScheduled", "True"),
    ],
    "initContainerStatuses": [
        {
            "name": "workspace-seed",
            "image": IMAGE,
            "imageID": "",
            "ready": False,
            "restartCount": 0,
            "started": False,
            "state": {
                "waiting": {
                    "reason": "ImagePullBackOff",
                    "message": f'Back-off pulling image "{IMAGE}"',
                }
            },
            "lastState": {},
        }
    ],
    "containerStatuses": [sandbox_status({"waiting": {"reason": "PodInitializing"}})],
}

ERR_IMAGE_PULL = {
    **IMAGE_PULL_BACKOFF,
    "initContainerStatuses": [
        {
            **SEED_PULLING,
            "state": {
                "waiting": {
                    "reason": "ErrImagePull",
                    "message": f'failed to pull and unpack image "{IMAGE}": not found',
                }
            },
        }
    ],
}

OOM_KILLED = {
    "phase": "Failed",
    "podIP": "10.244.1.17",
    "qosClass": "Guaranteed",
    "startTime": T0,
    "conditions": [
        cond("Ready", "False", "PodFailed"),
        cond("ContainersReady", "False", "PodFailed"),
        cond("PodScheduled", "True"),
    ],
    "containerStatuses": [
        sandbox_status(
            {
                "terminated": {
                    "exitCode": 137,
                    "reason": "OOMKilled",
                    "startedAt": T0,
                    "finishedAt": T0,
                    "containerID": "containerd://0f1e2d",
                }
            }
        )
    ],
}

EVICTED_NODE_PRESSURE = {
    "phase": "Failed",
    "reason": "Evicted",
    "message": "The node was low on resource: memory. Threshold quantity: 100Mi, available: "
    "84Mi. Container sandbox was using 912Mi, request is 1Gi, has larger consumption of memory. ",
    "startTime": T0,
    "conditions": [
        cond(
            "DisruptionTarget",
            "True",
            "TerminationByKubelet",
            "The node was low on resource: memory.",
        )
    ],
    "containerStatuses": [
        sandbox_status(
            {
                "terminated": {
                    "exitCode": 137,
                    "reason": "ContainerStatusUnknown",
                    "startedAt": T0,
                    "finishedAt": T0,
                }
            }
        )
    ],
}

EVICTED_OWN_DISK = {
    "phase": "Failed",
    "reason": "Evicted",
    "message": 'Usage of EmptyDir volume "workspace" exceeds the limit "2Gi". ',
    "startTime": T0,
    "containerStatuses": [
        sandbox_status(
            {"terminated": {"exitCode": 137, "reason": "Error", "startedAt": T0, "finishedAt": T0}}
        )
    ],
}

EVICTED_EPHEMERAL_TOTAL = {
    **EVICTED_OWN_DISK,
    "message": "Pod ephemeral local storage usage exceeds the total limit of containers 2Gi. ",
}

DEADLINE_EXCEEDED = {
    "phase": "Failed",
    "reason": "DeadlineExceeded",
    "message": "Pod was active on the node longer than the specified deadline",
    "startTime": T0,
    "containerStatuses": [
        sandbox_status(
            {"terminated": {"exitCode": 137, "reason": "Error", "startedAt": T0, "finishedAt": T0}}
        )
    ],
}

# The node stopped reporting: the node controller marks the pod not Ready, then the taint
# manager deletes it (DisruptionTarget, deletionTimestamp); the container status is stale.
NODE_NOT_READY = {
    **RUNNING_READY,
    "conditions": [
        cond("Initialized", "True"),
        cond("Ready", "False"),
        cond("PodScheduled", "True"),
    ],
}
NODE_LOST_TAINT = {
    **RUNNING_READY,
    "conditions": [
        cond(
            "DisruptionTarget",
            "True",
            "DeletionByTaintManager",
            "Taint manager: deleting due to NoExecute taint",
        ),
        cond("Ready", "False"),
        cond("PodScheduled", "True"),
    ],
}
NODE_LOST_OLD = {
    "phase": "Unknown",
    "reason": "NodeLost",
    "message": "Node worker-3 which was running pod orch-prod-sbx-0123456789ab is unresponsive",
    "startTime": T0,
}
AGENT_EXITED = {
    "phase": "Succeeded",
    "startTime": T0,
    "containerStatuses": [
        sandbox_status(
            {
                "terminated": {
                    "exitCode": 0,
                    "reason": "Completed",
                    "startedAt": T0,
                    "finishedAt": T0,
                }
            }
        )
    ],
}


def test_running_and_ready_is_ok() -> None:
    verdict = assess(pod(RUNNING_READY))
    assert (verdict.state, verdict.alive, verdict.ready, verdict.outcome) == (
        "running",
        True,
        True,
        Outcome.OK,
    )
    assert not verdict.starting


@pytest.mark.parametrize(
    ("status", "state", "outcome", "agent_caused", "evidence"),
    [
        (OOM_KILLED, "oom_killed", Outcome.AGENT_ERROR, "memory_limit", "OOM-killed"),
        (
            EVICTED_OWN_DISK,
            "evicted",
            Outcome.AGENT_ERROR,
            "disk_limit",
            'EmptyDir volume "workspace"',
        ),
        (
            EVICTED_EPHEMERAL_TOTAL,
            "evicted",
            Outcome.AGENT_ERROR,
            "disk_limit",
            "ephemeral local storage",
        ),
        (EVICTED_NODE_PRESSURE, "evicted", Outcome.INFRA_ERROR, None, "low on resource: memory"),
        (
            DEADLINE_EXCEEDED,
            "deadline_exceeded",
            Outcome.INFRA_ERROR,
            None,
            "longer than the specified deadline",
        ),
        (NODE_LOST_TAINT, "node_lost", Outcome.INFRA_ERROR, None, "DeletionByTaintManager"),
        (NODE_LOST_OLD, "node_lost", Outcome.INFRA_ERROR, None, "unresponsive"),
        (AGENT_EXITED, "exited", Outcome.INFRA_ERROR, None, "exit=0"),
    ],
)
def test_ended_pods(
    status: dict[str, Any], state: str, outcome: Outcome, agent_caused: str | None, evidence: str
) -> None:
    verdict = assess(pod(status))
    assert verdict.state == state
    assert verdict.outcome == outcome
    assert verdict.agent_caused == agent_caused
    assert verdict.fatal and not verdict.alive and not verdict.starting
    assert evidence in verdict.detail


def test_oom_killed_carries_exit_status() -> None:
    verdict = assess(pod(OOM_KILLED))
    assert verdict.oom_killed and verdict.exit_code == 137


def test_image_pull_backoff_fails_the_start_at_once() -> None:
    verdict = assess(pod(IMAGE_PULL_BACKOFF), pending_for_s=3, pending_timeout_s=300)
    assert (verdict.state, verdict.outcome, verdict.fatal) == (
        "image_pull_failed",
        Outcome.INFRA_ERROR,
        True,
    )
    assert "workspace-seed" in verdict.detail and "Back-off pulling image" in verdict.detail


def test_a_first_failed_pull_is_retried_until_the_timeout() -> None:
    early = assess(pod(ERR_IMAGE_PULL), pending_for_s=3, pending_timeout_s=300)
    assert early.state == "image_pull_failed" and early.starting
    late = assess(pod(ERR_IMAGE_PULL), pending_for_s=301, pending_timeout_s=300)
    assert late.fatal and "not Ready within 300 s" in late.detail and "not found" in late.detail


def test_unschedulable_waits_then_fails_with_the_schedulers_words() -> None:
    early = assess(pod(UNSCHEDULABLE), pending_for_s=10, pending_timeout_s=300)
    assert early.state == "unschedulable" and early.starting and not early.alive
    late = assess(pod(UNSCHEDULABLE), pending_for_s=301, pending_timeout_s=300)
    assert late.state == "unschedulable" and late.fatal
    assert late.outcome == Outcome.INFRA_ERROR
    assert "Insufficient memory" in late.detail


def test_pending_while_containers_start() -> None:
    creating = {
        "phase": "Pending",
        "conditions": [cond("PodScheduled", "True")],
        "containerStatuses": [sandbox_status({"waiting": {"reason": "ContainerCreating"}})],
    }
    verdict = assess(pod(creating), pending_for_s=1, pending_timeout_s=300)
    assert verdict.state == "pending" and verdict.starting
    assert "ContainerCreating" in verdict.detail


def test_node_not_ready_is_running_but_not_ready() -> None:
    verdict = assess(pod(NODE_NOT_READY))
    assert verdict.state == "not_ready" and verdict.alive and not verdict.ready
    assert verdict.outcome == Outcome.INFRA_ERROR


def test_pod_gone_or_being_deleted() -> None:
    gone = assess(None)
    assert (gone.state, gone.outcome, gone.fatal) == ("missing", Outcome.INFRA_ERROR, True)
    deleting = assess(pod(RUNNING_READY, deletionTimestamp=T0, deletionGracePeriodSeconds=0))
    assert deleting.state == "terminating" and deleting.fatal and not deleting.alive


def test_a_failed_starts_evidence_keeps_its_warnings_over_later_normal_events() -> None:
    """As a real kubelet's failed pull reads (one second, seven events): the warning that
    says why is kept over the normal events of its retries; then the latest of the rest,
    in time order."""
    at = datetime(2026, 12, 5, 11, 0, 0, tzinfo=UTC)
    seen = [
        ("Scheduled", "Normal"),
        ("Pulling", "Normal"),
        ("Failed", "Warning"),  # Failed to pull image ...: no such host
        ("Failed", "Warning"),  # Error: ErrImagePull
        ("Pulling", "Normal"),
        ("BackOff", "Normal"),
        ("Failed", "Warning"),  # Error: ImagePullBackOff
    ]
    events = [
        Event(
            metadata=ObjectMeta(name=f"pod.{index:02x}"),
            involvedObject=ObjectReference(name="pod"),
            reason=reason,
            type=kind,
            lastTimestamp=at + timedelta(seconds=index),
        )
        for index, (reason, kind) in enumerate(seen)
    ]
    kept = evidence_events(events)
    assert [e.metadata.name for e in kept if e.metadata] == [
        "pod.02", "pod.03", "pod.04", "pod.05", "pod.06"
    ]  # fmt: skip
    assert evidence_events(events[:3]) == events[:3]
