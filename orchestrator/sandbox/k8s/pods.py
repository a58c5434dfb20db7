"""A sandbox's Pod and its Secret, rendered from its spec and the deployment's settings.

Pure: nothing here talks to a cluster, so every rendered object is tested as it is (and
validated against the Kubernetes schemas) without one.

The pod mirrors the Docker sandbox: the exec agent as the one container's process, root
with only SETUID, SETGID, SETPCAP and KILL, running every command as uid 1000 (so nothing a
command does can kill, stop or replace it); no network (the NetworkPolicy of the Helm
chart), a read-only root, /tmp and the home as size-limited memory-backed volumes (tmpfs on
Docker), and /workspace as a volume of its own seeded from the image's /workspace by an init
container (uid 1000, no capabilities). The agent listens on TCP and requires the sandbox's
token, which lives in the sandbox's Secret (readable by root alone) together with the
agent's code (so the agent always matches the worker that made the sandbox, whatever the
image).
"""

from __future__ import annotations

import base64
import re
from datetime import datetime

from lightkube.models.core_v1 import (
    Capabilities,
    Container,
    ContainerPort,
    EmptyDirVolumeSource,
    KeyToPath,
    LocalObjectReference,
    PodSecurityContext,
    PodSpec,
    Probe,
    ResourceRequirements,
    SeccompProfile,
    SecretVolumeSource,
    SecurityContext,
    TCPSocketAction,
    Toleration,
    Volume,
    VolumeMount,
)
from lightkube.models.meta_v1 import ObjectMeta, OwnerReference
from lightkube.resources.core_v1 import Pod, Secret
from pydantic import BaseModel, ConfigDict

from orchestrator.config import Settings
from orchestrator.sandbox import labels
from orchestrator.sandbox.agent import (
    AGENT_CAPABILITIES,
    AGENT_LOADER,
    AGENT_MODULES,
    HOME_MB,
    SANDBOX_HOME,
    SANDBOX_UID,
    agent_arguments,
)
from orchestrator.sandbox.backend import SandboxSpec

AGENT_UID = 0
CONTAINER = "sandbox"
SEED_CONTAINER = "workspace-seed"
AGENT_DIR = "/opt/orchestrator/agent"
AGENT_KEYS = [f"{name}.py" for name in AGENT_MODULES]
"""The Secret's keys of the agent's modules, each a file of the agent's directory."""
AGENT_KEY = "exec_agent.py"
TOKEN_KEY = "token"  # noqa: S105 - the key of the Secret, not a secret
SEED_MOUNT = "/seed"
# The agent exits at once on SIGTERM and a sandbox holds nothing worth a graceful stop.
TERMINATION_GRACE_S = 1
# A sandbox on a node that stopped answering is lost for its rollout: have Kubernetes
# delete it soon instead of the default five minutes, so the evidence comes quickly.
NODE_LOST_TOLERATION_S = 30

MANAGED_BY = "app.kubernetes.io/managed-by"
ROLE = "orchestrator/role"
DEPLOYMENT = "orchestrator/deployment"
MANAGED_BY_VALUE = "orchestrator"
ROLE_VALUE = "sandbox"

# A label value: at most 63 characters, alphanumeric at both ends, [-_.] inside.
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?$")


class SandboxIdentity(BaseModel):
    """Who a sandbox is: what its labels say besides its spec."""

    model_config = ConfigDict(frozen=True)

    sandbox_id: str
    host: str
    created_at: datetime
    expires_at: datetime


def pod_name(settings: Settings, sandbox_id: str) -> str:
    """The sandbox's pod (and Secret) name, as the Docker backend names its container."""
    return f"orch-{settings.deployment}-{sandbox_id}"


def image_ref(settings: Settings, image: str) -> str:
    """The image as the cluster pulls it: the registry prefix in front of its name."""
    return settings.k8s_image_registry + image


def selector(settings: Settings) -> dict[str, str]:
    """Labels selecting every sandbox pod and Secret of this deployment."""
    return {
        MANAGED_BY: MANAGED_BY_VALUE,
        ROLE: ROLE_VALUE,
        DEPLOYMENT: settings.deployment,
        labels.MANAGED: "true",
        labels.DEPLOYMENT: settings.deployment,
    }


def label_safe(value: str) -> bool:
    return bool(_LABEL_VALUE.match(value))


def ownership(
    settings: Settings, spec: SandboxSpec, identity: SandboxIdentity
) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) of a sandbox's objects: the Docker backend's labels, each as a
    label when Kubernetes allows its value and as an annotation otherwise (timestamps,
    long or odd rollout ids), plus the labels the Helm chart's policies select on."""
    stamp = labels.sandbox_labels(
        deployment=settings.deployment,
        sandbox_id=identity.sandbox_id,
        rollout_id=spec.rollout_id,
        host=identity.host,
        runtime=spec.runtime,
        created_at=identity.created_at,
        expires_at=identity.expires_at,
    )
    found = {key: value for key, value in stamp.items() if label_safe(value)}
    notes = {key: value for key, value in stamp.items() if key not in found}
    return {**found, **selector(settings)}, notes


def stamp_of(meta: ObjectMeta | None) -> dict[str, str]:
    """The Docker-style ownership labels of an object, from its labels and annotations."""
    if meta is None:
        return {}
    found = {k: v for k, v in (meta.annotations or {}).items() if k.startswith(labels.PREFIX)}
    found.update({k: v for k, v in (meta.labels or {}).items() if k.startswith(labels.PREFIX)})
    return found


def agent_command(settings: Settings, spec: SandboxSpec, disk_mb: int, output_mb: int) -> list[str]:
    """The exec agent's command line: on TCP with the token (a pod spec has no pids limit,
    the kubelet's podPidsLimit being per node: see agent_arguments for the process limit)."""
    return [
        "python3",
        "-I",
        "-S",
        # Loaded as a module from its directory, where its other modules are (the Secret's
        # volume): -I leaves a script's own directory off sys.path.
        "-c",
        AGENT_LOADER,
        f"{AGENT_DIR}/{AGENT_KEY}",
        "--listen",
        f"tcp:0.0.0.0:{settings.k8s_agent_port}",
        "--token-file",
        f"{AGENT_DIR}/{TOKEN_KEY}",
        *agent_arguments(spec, disk_mb=disk_mb, output_mb=output_mb),
    ]


def _resources(spec: SandboxSpec, disk_mb: int) -> ResourceRequirements:
    # Requests equal to limits: Guaranteed QoS, so the node's OOM killer and evictions
    # under pressure reach sandboxes last, and a sandbox gets what it was sized for.
    amounts = {"cpu": f"{round(spec.limits.cpus * 1000)}m", "memory": f"{spec.limits.memory_mb}Mi"}
    if disk_mb:
        amounts["ephemeral-storage"] = f"{disk_mb}Mi"
    return ResourceRequirements(requests=dict(amounts), limits=dict(amounts))


def _security(*, agent: bool) -> SecurityContext:
    """The init container runs as SANDBOX_UID with nothing; the agent as root with just
    AGENT_CAPABILITIES (no-new-privileges either way: commands can never regain them)."""
    uid = AGENT_UID if agent else SANDBOX_UID
    return SecurityContext(
        runAsNonRoot=not agent,
        runAsUser=uid,
        runAsGroup=uid,
        readOnlyRootFilesystem=True,
        allowPrivilegeEscalation=False,
        privileged=False,
        capabilities=Capabilities(drop=["ALL"], add=AGENT_CAPABILITIES if agent else None),
        seccompProfile=SeccompProfile(type="RuntimeDefault"),
    )


def render_pod(
    settings: Settings,
    spec: SandboxSpec,
    identity: SandboxIdentity,
    *,
    disk_mb: int,
    output_mb: int,
) -> Pod:
    """The sandbox's pod. ``disk_mb`` caps /workspace (0: uncapped); ``output_mb`` is the
    output past which the agent kills a command."""
    name = pod_name(settings, identity.sandbox_id)
    found, notes = ownership(settings, spec, identity)
    image = image_ref(settings, spec.image)
    resources = _resources(spec, disk_mb)
    runtime_class = settings.k8s_runtime_classes.get(spec.runtime, "")
    workspace = VolumeMount(name="workspace", mountPath="/workspace")
    seed = Container(
        name=SEED_CONTAINER,
        image=image,
        imagePullPolicy="IfNotPresent",
        # The image's /workspace (the codebase) into the sandbox's own writable volume,
        # mounted elsewhere so the image's tree stays visible to copy from. Entry by entry,
        # so cp never tries to chmod the volume's root (root-owned: EPERM as uid 1000).
        command=[
            "find",
            "/workspace",
            "-mindepth",
            "1",
            "-maxdepth",
            "1",
            "-exec",
            "cp",
            "-R",
            "--preserve=mode,timestamps,links",
            "-t",
            SEED_MOUNT,
            "{}",
            "+",
        ],
        resources=resources,
        securityContext=_security(agent=False),
        volumeMounts=[VolumeMount(name="workspace", mountPath=SEED_MOUNT)],
    )
    sandbox = Container(
        name=CONTAINER,
        image=image,
        imagePullPolicy="IfNotPresent",
        command=agent_command(settings, spec, disk_mb, output_mb),
        workingDir="/workspace",
        ports=[ContainerPort(name="agent", containerPort=settings.k8s_agent_port, protocol="TCP")],
        # Ready once the agent listens. No liveness probe: a kubelet that kills a slow
        # agent under load would end a rollout (restartPolicy Never) for nothing.
        readinessProbe=Probe(
            tcpSocket=TCPSocketAction(port="agent"),
            periodSeconds=1,
            timeoutSeconds=1,
            failureThreshold=3,
        ),
        resources=resources,
        securityContext=_security(agent=True),
        volumeMounts=[
            workspace,
            VolumeMount(name="tmp", mountPath="/tmp"),
            VolumeMount(name="home", mountPath=SANDBOX_HOME),
            VolumeMount(name="agent", mountPath=AGENT_DIR, readOnly=True),
            *(
                VolumeMount(name=_scratch_volume(i), mountPath=d.path)
                for i, d in enumerate(spec.scratch_dirs)
            ),
        ],
    )
    return Pod(
        metadata=ObjectMeta(
            name=name, namespace=settings.k8s_namespace, labels=found, annotations=notes
        ),
        spec=PodSpec(
            restartPolicy="Never",
            automountServiceAccountToken=False,
            enableServiceLinks=False,
            # The pause container becomes PID 1 and reaps what commands leave behind
            # (docker-init's job on Docker); the agent is not PID 1, so it dies of signals.
            shareProcessNamespace=True,
            runtimeClassName=runtime_class or None,
            activeDeadlineSeconds=spec.lifetime_s,
            terminationGracePeriodSeconds=TERMINATION_GRACE_S,
            nodeSelector=dict(settings.k8s_node_selector) or None,
            imagePullSecrets=(
                [LocalObjectReference(name=settings.k8s_image_pull_secret)]
                if settings.k8s_image_pull_secret
                else None
            ),
            # No pod-wide user: the pause process (PID 1, sharing the process namespace)
            # keeps its image's own (65535), so commands as SANDBOX_UID cannot signal it.
            # No fsGroup either: emptyDirs are world-writable anyway, and an fsGroup would
            # give its group read access to the Secret's files (the kubelet adds g+r), the
            # group commands run in.
            securityContext=PodSecurityContext(
                seccompProfile=SeccompProfile(type="RuntimeDefault")
            ),
            tolerations=[
                Toleration(
                    key=f"node.kubernetes.io/{taint}",
                    operator="Exists",
                    effect="NoExecute",
                    tolerationSeconds=NODE_LOST_TOLERATION_S,
                )
                for taint in ("not-ready", "unreachable")
            ],
            initContainers=[seed],
            containers=[sandbox],
            volumes=[
                Volume(
                    name="workspace",
                    emptyDir=EmptyDirVolumeSource(sizeLimit=f"{disk_mb}Mi" if disk_mb else None),
                ),
                Volume(
                    name="tmp",
                    emptyDir=EmptyDirVolumeSource(
                        medium="Memory", sizeLimit=f"{spec.limits.tmp_mb}Mi"
                    ),
                ),
                Volume(
                    name="home",
                    emptyDir=EmptyDirVolumeSource(medium="Memory", sizeLimit=f"{HOME_MB}Mi"),
                ),
                # The environment's scratch directories, in memory like /tmp (emptyDirs
                # are world-writable: the sandbox user may write there).
                *(
                    Volume(
                        name=_scratch_volume(i),
                        emptyDir=EmptyDirVolumeSource(medium="Memory", sizeLimit=f"{d.size_mb}Mi"),
                    )
                    for i, d in enumerate(spec.scratch_dirs)
                ),
                Volume(
                    name="agent",
                    secret=SecretVolumeSource(
                        secretName=name,
                        # Root's alone: commands (uid 1000, fsGroup's group) cannot read the
                        # token that opens this sandbox's agent to the network.
                        defaultMode=0o400,
                        items=[
                            *(KeyToPath(key=key, path=key) for key in AGENT_KEYS),
                            KeyToPath(key=TOKEN_KEY, path=TOKEN_KEY),
                        ],
                    ),
                ),
            ],
        ),
    )


def _scratch_volume(index: int) -> str:
    return f"scratch-{index}"


def render_secret(
    pod: Pod, *, token: str, agent_files: dict[str, bytes], owner_uid: str | None = None
) -> Secret:
    """The sandbox's Secret: its token and the agent's code (``agent_files``: every module
    of the agent, by file name), owned by its pod (so Kubernetes deletes it with the
    pod) once the pod's uid is known."""
    meta = pod.metadata
    assert meta is not None and meta.name is not None  # rendered by render_pod
    owners = None
    if owner_uid:
        owners = [OwnerReference(apiVersion="v1", kind="Pod", name=meta.name, uid=owner_uid)]
    return Secret(
        metadata=ObjectMeta(
            name=meta.name,
            namespace=meta.namespace,
            labels=dict(meta.labels or {}),
            annotations=dict(meta.annotations or {}),
            ownerReferences=owners,
        ),
        type="Opaque",
        immutable=True,
        data={
            TOKEN_KEY: base64.b64encode(token.encode()).decode(),
            **{name: base64.b64encode(code).decode() for name, code in agent_files.items()},
        },
    )
