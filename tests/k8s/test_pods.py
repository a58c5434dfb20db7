"""Sandbox pods and Secrets as rendered for several environments, checked field by field and
validated offline against the Kubernetes 1.30 schemas in strict mode (unknown fields fail)."""

from __future__ import annotations

import base64
import importlib
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from lightkube.resources.core_v1 import Pod, Secret

from orchestrator.config import Runtime, Settings
from orchestrator.sandbox import labels
from orchestrator.sandbox.agent import AGENT_LOADER, AGENT_MODULES
from orchestrator.sandbox.backend import SandboxLimits, SandboxSpec, ScratchDir
from orchestrator.sandbox.k8s import pods

K8S_VERSION = "1.30.0"
# Untyped (no py.typed): used through Any.
kubernetes_validate: Any = importlib.import_module("kubernetes_validate")
NOW = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


def k8s_settings(**overrides: Any) -> Settings:
    return Settings(**{"deployment": "prod-1", "host_id": "worker-7f9c", **overrides})


def identity(lifetime_s: int = 3600) -> pods.SandboxIdentity:
    return pods.SandboxIdentity(
        sandbox_id="sbx-0123456789ab",
        host="worker-7f9c",
        created_at=NOW,
        expires_at=NOW + timedelta(seconds=lifetime_s),
    )


def render(spec: SandboxSpec, settings: Settings | None = None, disk_mb: int = 2048) -> Pod:
    return pods.render_pod(
        settings or k8s_settings(), spec, identity(spec.lifetime_s), disk_mb=disk_mb, output_mb=64
    )


def validated(obj: Pod | Secret) -> dict[str, Any]:
    """The object as the API server would receive it, after a strict schema check."""
    data = dict(obj.to_dict())
    kubernetes_validate.validate(data, K8S_VERSION, strict=True)
    return data


def container(data: dict[str, Any], name: str) -> dict[str, Any]:
    spec = data["spec"]
    everyone: list[dict[str, Any]] = spec["containers"] + spec.get("initContainers", [])
    found = [c for c in everyone if c["name"] == name]
    assert len(found) == 1
    return found[0]


HARDENED = {
    "runAsNonRoot": True,
    "runAsUser": 1000,
    "runAsGroup": 1000,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
    "privileged": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
# The agent: root with just what it needs to run commands as another uid and kill them,
# as on Docker, so no command can kill, stop or replace it.
AGENT = {
    **HARDENED,
    "runAsNonRoot": False,
    "runAsUser": 0,
    "runAsGroup": 0,
    "capabilities": {"drop": ["ALL"], "add": ["SETUID", "SETGID", "SETPCAP", "KILL"]},
}


@pytest.mark.parametrize(
    ("runtime", "runtime_class"), [("runc", None), ("runsc", "gvisor"), ("kata", "kata")]
)
def test_runtime_class_per_runtime(runtime: Runtime, runtime_class: str | None) -> None:
    data = validated(render(SandboxSpec(image="orchestrator/sandbox-base:latest", runtime=runtime)))
    assert data["spec"].get("runtimeClassName") == runtime_class
    assert data["metadata"]["labels"][labels.RUNTIME] == runtime


def test_runtime_classes_come_from_settings() -> None:
    settings = k8s_settings(k8s_runtime_classes={"runc": "runc-hardened", "runsc": "gvisor-kvm"})
    data = validated(render(SandboxSpec(image="img", runtime="runsc"), settings))
    assert data["spec"]["runtimeClassName"] == "gvisor-kvm"
    data = validated(render(SandboxSpec(image="img", runtime="runc"), settings))
    assert data["spec"]["runtimeClassName"] == "runc-hardened"


def test_pod_is_hardened() -> None:
    data = validated(render(SandboxSpec(image="img")))
    spec = data["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["enableServiceLinks"] is False
    assert spec["restartPolicy"] == "Never"
    assert spec["shareProcessNamespace"] is True
    assert spec["terminationGracePeriodSeconds"] <= 2
    assert "hostNetwork" not in spec and "hostPID" not in spec and "hostIPC" not in spec
    # No pod-wide user (the pause process keeps its own) and no fsGroup (it would let the
    # commands' group read the Secret).
    assert spec["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert container(data, "workspace-seed")["securityContext"] == HARDENED
    assert container(data, "sandbox")["securityContext"] == AGENT
    # Sandboxes on a lost node go soon, not after the default five minutes.
    tolerated = {t["key"]: t["tolerationSeconds"] for t in spec["tolerations"]}
    assert tolerated == {
        "node.kubernetes.io/not-ready": pods.NODE_LOST_TOLERATION_S,
        "node.kubernetes.io/unreachable": pods.NODE_LOST_TOLERATION_S,
    }


def test_lifetime_is_the_active_deadline() -> None:
    data = validated(render(SandboxSpec(image="img", lifetime_s=900)))
    assert data["spec"]["activeDeadlineSeconds"] == 900
    assert (
        data["metadata"]["annotations"][labels.EXPIRES]
        == (NOW + timedelta(seconds=900)).isoformat()
    )


@pytest.mark.parametrize(
    ("limits", "disk_mb", "cpu", "memory", "storage"),
    [
        (SandboxLimits(), 2048, "1000m", "1024Mi", "2048Mi"),
        (SandboxLimits(cpus=0.25, memory_mb=256, tmp_mb=64), 512, "250m", "256Mi", "512Mi"),
        (SandboxLimits(cpus=4, memory_mb=8192), 0, "4000m", "8192Mi", None),
    ],
)
def test_requests_equal_limits(
    limits: SandboxLimits, disk_mb: int, cpu: str, memory: str, storage: str | None
) -> None:
    data = validated(render(SandboxSpec(image="img", limits=limits), disk_mb=disk_mb))
    expected = {"cpu": cpu, "memory": memory}
    if storage:
        expected["ephemeral-storage"] = storage
    for name in ("sandbox", "workspace-seed"):
        resources = container(data, name)["resources"]
        assert resources == {"requests": expected, "limits": expected}
    volumes = {v["name"]: v for v in data["spec"]["volumes"]}
    workspace = volumes["workspace"]["emptyDir"]
    assert workspace.get("sizeLimit") == storage  # uncapped (0): no limit at all
    assert volumes["tmp"]["emptyDir"] == {"medium": "Memory", "sizeLimit": f"{limits.tmp_mb}Mi"}
    assert volumes["home"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Mi"}
    agent = container(data, "sandbox")["command"]
    told = json.loads(agent[agent.index("--limits") + 1])
    assert told == {
        "memory_mb": limits.memory_mb,
        "pids": limits.pids,
        "output_mb": 64,
        "disk": {"/workspace": disk_mb, "/tmp": limits.tmp_mb, "/home/agent": 16},
    }


def test_agent_listens_on_tcp_with_the_token_and_runs_commands_as_another_uid() -> None:
    data = validated(render(SandboxSpec(image="img"), k8s_settings(k8s_agent_port=7444)))
    sandbox = container(data, "sandbox")
    command = sandbox["command"]
    assert command[:6] == [
        "python3",
        "-I",
        "-S",
        "-c",
        AGENT_LOADER,
        "/opt/orchestrator/agent/exec_agent.py",
    ]
    assert command[command.index("--listen") + 1] == "tcp:0.0.0.0:7444"
    assert command[command.index("--token-file") + 1] == "/opt/orchestrator/agent/token"
    assert command[command.index("--uid") + 1] == command[command.index("--gid") + 1] == "1000"
    assert sandbox["ports"] == [{"name": "agent", "containerPort": 7444, "protocol": "TCP"}]
    assert sandbox["readinessProbe"]["tcpSocket"] == {"port": "agent"}
    assert "livenessProbe" not in sandbox
    mounts = {m["mountPath"]: m for m in sandbox["volumeMounts"]}
    assert set(mounts) == {"/workspace", "/tmp", "/home/agent", "/opt/orchestrator/agent"}
    assert mounts["/opt/orchestrator/agent"]["readOnly"] is True
    volumes = {v["name"]: v for v in data["spec"]["volumes"]}
    assert volumes["agent"]["secret"] == {
        "secretName": "orch-prod-1-sbx-0123456789ab",
        "defaultMode": 0o400,
        "items": [
            *({"key": f"{name}.py", "path": f"{name}.py"} for name in AGENT_MODULES),
            {"key": "token", "path": "token"},
        ],
    }


@pytest.mark.parametrize(
    ("runtime", "as_mb", "nproc"),
    [("runc", None, None), ("runsc", "768", "256"), ("kata", None, "256")],
)
def test_per_command_limits_where_the_sandbox_has_its_own_kernel(
    runtime: Runtime, as_mb: str | None, nproc: str | None
) -> None:
    command = container(validated(render(SandboxSpec(image="img", runtime=runtime))), "sandbox")[
        "command"
    ]

    def value(flag: str) -> str | None:
        return command[command.index(flag) + 1] if flag in command else None

    assert value("--limit-as-mb") == as_mb
    assert value("--limit-nproc") == nproc
    assert ("--preload" in command) == (runtime == "runsc")


def test_codebase_is_seeded_into_its_own_workspace_volume() -> None:
    settings = k8s_settings(k8s_image_registry="registry.example.com/team/")
    data = validated(render(SandboxSpec(image="orchestrator/codebase:flask"), settings))
    seed = container(data, "workspace-seed")
    sandbox = container(data, "sandbox")
    assert (
        seed["image"] == sandbox["image"] == "registry.example.com/team/orchestrator/codebase:flask"
    )
    assert seed["command"][:2] == ["find", "/workspace"]
    assert seed["volumeMounts"] == [{"name": "workspace", "mountPath": "/seed"}]
    assert {"name": "workspace", "mountPath": "/workspace"} in sandbox["volumeMounts"]
    assert data["spec"]["initContainers"] == [seed]
    assert "imagePullSecrets" not in data["spec"]


def test_scratch_dirs_are_memory_volumes_the_agent_counts() -> None:
    spec = SandboxSpec(
        image="img", scratch_dirs=(ScratchDir(path="/logs"), ScratchDir(path="/tests", size_mb=8))
    )
    data = validated(render(spec))
    sandbox = container(data, "sandbox")
    mounts = {m["mountPath"]: m["name"] for m in sandbox["volumeMounts"]}
    volumes = {v["name"]: v for v in data["spec"]["volumes"]}
    assert volumes[mounts["/logs"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Mi"}
    assert volumes[mounts["/tests"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Mi"}
    # Only the sandbox's own container mounts them (the seed writes /workspace alone).
    assert all(
        "/logs" not in m["mountPath"] for m in container(data, "workspace-seed")["volumeMounts"]
    )
    limits = json.loads(sandbox["command"][sandbox["command"].index("--limits") + 1])
    assert limits["disk"]["/logs"] == 64 and limits["disk"]["/tests"] == 8


def test_pull_secret_and_node_selector() -> None:
    settings = k8s_settings(
        k8s_image_pull_secret="regcred", k8s_node_selector={"pool": "sandboxes"}
    )
    data = validated(render(SandboxSpec(image="img"), settings))
    assert data["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert data["spec"]["nodeSelector"] == {"pool": "sandboxes"}


def test_labels_as_on_docker_with_odd_values_in_annotations() -> None:
    settings = k8s_settings(k8s_namespace="sbx")
    odd_rollout = "trace_" + "x" * 80  # longer than a label value may be
    data = validated(render(SandboxSpec(image="img", rollout_id=odd_rollout), settings))
    meta = data["metadata"]
    assert meta["name"] == "orch-prod-1-sbx-0123456789ab"
    assert meta["namespace"] == "sbx"
    assert meta["labels"] == {
        "app.kubernetes.io/managed-by": "orchestrator",
        "orchestrator/role": "sandbox",
        "orchestrator/deployment": "prod-1",
        labels.MANAGED: "true",
        labels.DEPLOYMENT: "prod-1",
        labels.SANDBOX: "sbx-0123456789ab",
        labels.HOST: "worker-7f9c",
        labels.RUNTIME: "runc",
    }
    assert meta["annotations"] == {
        labels.ROLLOUT: odd_rollout,
        labels.CREATED: NOW.isoformat(),
        labels.EXPIRES: (NOW + timedelta(hours=1)).isoformat(),
    }
    # Read back, labels and annotations together are the Docker backend's labels.
    pod = render(SandboxSpec(image="img", rollout_id=odd_rollout), settings)
    assert pods.stamp_of(pod.metadata) == labels.sandbox_labels(
        deployment="prod-1",
        sandbox_id="sbx-0123456789ab",
        rollout_id=odd_rollout,
        host="worker-7f9c",
        runtime="runc",
        created_at=NOW,
        expires_at=NOW + timedelta(hours=1),
    )


def test_secret_holds_token_and_agent_and_is_owned_by_its_pod() -> None:
    pod = render(SandboxSpec(image="img", rollout_id="r-1"))
    files = {f"{name}.py": path.read_bytes() for name, path in AGENT_MODULES.items()}
    secret = validated(
        pods.render_secret(pod, token="s3cret-token", agent_files=files, owner_uid="uid-123")
    )
    assert secret["metadata"]["name"] == pod.metadata.name if pod.metadata else False
    assert secret["metadata"]["labels"] == (pod.metadata.labels if pod.metadata else None)
    assert secret["metadata"]["ownerReferences"] == [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": "orch-prod-1-sbx-0123456789ab",
            "uid": "uid-123",
        }
    ]
    assert secret["immutable"] is True
    assert base64.b64decode(secret["data"]["token"]) == b"s3cret-token"
    for key, code in files.items():  # every module of the agent, side by side
        assert base64.b64decode(secret["data"][key]) == code
    # A Secret may hold at most 1 MiB.
    assert len(json.dumps(secret).encode()) < 1 << 20


def test_strict_validation_catches_a_wrong_field() -> None:
    """The schema check above is real: a misspelt field fails it."""
    data = render(SandboxSpec(image="img")).to_dict()
    data["spec"]["containers"][0]["securityContxt"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(data, K8S_VERSION, strict=True)


def test_pod_name_fits_a_hostname() -> None:
    settings = k8s_settings(deployment="d" * 41)
    assert len(pods.pod_name(settings, "sbx-" + "0" * 12)) <= 63
