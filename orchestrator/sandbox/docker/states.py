"""A container's state and what a sandbox's manifests say (pure): the state name Docker's
inspect gives, a daemon's failure as whose fault it is, and how a reset sandbox differs
from a fresh one of its spec."""

from __future__ import annotations

import json
from typing import Any

from docker.errors import APIError

from orchestrator.sandbox.backend import BackendUnavailable, SandboxError, SandboxSpec


def overlay_at_workspace(manifest: dict[str, Any]) -> bool:
    """Whether the sandbox's own mount table (its manifest's) has an overlay at /workspace:
    the host's mount propagated into it."""
    return any(point == "/workspace" and kind == "overlay" for point, kind, _ in manifest["mounts"])


def state_name(info: dict[str, Any] | None) -> str:
    """running, paused, exited, created, dead, ... or missing when there is no container."""
    if info is None:
        return "missing"
    state = info.get("State", {})
    if state.get("Paused"):
        return "paused"
    return str(state.get("Status", "unknown"))


def docker_fault(action: str, exc: Exception) -> SandboxError:
    """Daemon unreachable vs. the daemon refusing: both infrastructure, told apart for
    the evidence."""
    text = str(exc)
    if isinstance(exc, APIError):
        return SandboxError(f"docker refused to {action}: {text}")
    return BackendUnavailable(f"docker daemon unreachable while trying to {action}: {text}")


def spec_key(spec: SandboxSpec) -> str:
    """What a fresh sandbox's manifest depends on: the spec but its owner and lifetime."""
    return spec.model_dump_json(exclude={"rollout_id", "lifetime_s"})


def manifest_differences(fresh: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Each way ``after`` differs from ``fresh`` (agent_files.sandbox_manifest), named."""
    differences = []
    for part in ("processes", "mounts", "ipc"):
        if fresh.get(part) != after.get(part):
            differences.append(f"{part}: fresh {fresh.get(part)!r}, now {after.get(part)!r}")
    fresh_trees, trees = fresh.get("trees") or {}, after.get("trees") or {}
    for point in sorted(set(fresh_trees) | set(trees)):
        was = {json.dumps(e) for e in fresh_trees.get(point) or []}
        now = {json.dumps(e) for e in trees.get(point) or []}
        if was != now:
            extra, missing = sorted(now - was)[:5], sorted(was - now)[:5]
            differences.append(f"{point}: added or changed {extra}, missing {missing}")
    return differences
