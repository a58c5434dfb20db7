"""The E2B wire's shapes: the control plane's JSON (camelCase, as the SDK's generated client
reads it) and the sandbox plane's messages (proto3 JSON: lowerCamelCase, bytes as base64,
enums by name, defaults omitted), and what a rollout keeps of its E2B sandbox."""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from orchestrator.sandbox.backend import FileEntry

ENVD_VERSION = "0.6.7"
"""The envd version reported: the SDK gates features on it (0.4.0 and later: it names no
user unless asked; 0.6.4: every path of its files API)."""
CLIENT_ID = "orchestrator"
SANDBOX_USER = "user"
"""The user name E2B clients know for the sandbox's unprivileged user (uid 1000 here)."""
ROOT_USER = "root"
"""Refused, or that same user where the environment says so (``e2b.root_user: alias``)."""


class _Wire(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


# -- control plane ----------------------------------------------------------------------------


class NetworkOptions(_Wire):
    """``network`` of ``POST /sandboxes`` (the SDK's ``network=``): what of it this
    deployment honours (docs/egress.md, "E2B")."""

    allow_out: list[str] = Field(
        default_factory=list,
        alias="allowOut",
        description="Domains, addresses, CIDRs: the sandbox's egress becomes these, each of "
        "which the template's policy must allow.",
    )
    deny_out: list[str] = Field(
        default_factory=list,
        alias="denyOut",
        description="0.0.0.0/0 (the SDK's ALL_TRAFFIC): no network, unless allowOut names "
        "some; other entries must not overlap what the template allows (it denies the rest).",
    )
    rules: dict[str, Any] | None = Field(None, description="Refused: no transform rules here.")
    egress_proxy: dict[str, Any] | None = Field(
        None, alias="egressProxy", description="Refused: no SOCKS proxy here."
    )


class NewSandbox(_Wire):
    """``POST /sandboxes`` and ``/v2/sandboxes``."""

    template_id: str = Field("base", alias="templateID", min_length=1, max_length=200)
    timeout: int | None = Field(None, ge=1, description="Seconds until it is killed.")
    metadata: dict[str, str] = Field(default_factory=dict)
    env_vars: dict[str, str] = Field(default_factory=dict, alias="envVars")
    auto_pause: bool = Field(
        False, alias="autoPause", description="The SDK's lifecycle on_timeout='pause'."
    )
    allow_internet_access: bool | None = Field(
        None,
        validation_alias=AliasChoices("allow_internet_access", "allowInternetAccess"),
        description="False: no network, whatever the template allows; true or unset: the "
        "template's egress policy (deny by default: docs/egress.md).",
    )
    network: NetworkOptions | None = None


class SnapshotBody(_Wire):
    """``POST /sandboxes/{id}/snapshots`` (``sbx.create_snapshot(name, mode=)``)."""

    name: str | None = Field(None, min_length=1, max_length=200)
    memory: bool | None = Field(
        None, description="True: a memory snapshot (refused here); unset or False: filesystem."
    )


class SnapshotOut(_Wire):
    """A snapshot, as ``create_snapshot`` answers and ``list_snapshots`` lists it."""

    snapshot_id: str = Field(alias="snapshotID")
    names: list[str] = Field(default_factory=list)


FORK_MAX = 20
"""The most sandboxes one fork makes (the SDK's own bound)."""


class ForkBody(_Wire):
    """``POST /sandboxes/{id}/fork`` (``sbx.fork(count, timeout)``)."""

    count: int = Field(1, ge=1, le=FORK_MAX)
    timeout: int | None = Field(None, ge=1, description="Seconds until each fork is killed.")


class PauseBody(_Wire):
    """``POST /sandboxes/{id}/pause`` (``sbx.pause(mode=)``)."""

    memory: bool | None = Field(
        None, description="True: keep memory (refused here); unset or False: filesystem."
    )
    require_healthy_guest: bool | None = Field(None, alias="requireHealthyGuest")


class TimeoutBody(_Wire):
    timeout: int = Field(ge=1)


class ConnectBody(_Wire):
    timeout: int | None = Field(None, ge=1)


class SandboxOut(_Wire):
    """A created or connected sandbox, as the SDK needs it to reach the sandbox."""

    template_id: str = Field(alias="templateID")
    sandbox_id: str = Field(alias="sandboxID")
    client_id: str = Field(CLIENT_ID, alias="clientID")
    envd_version: str = Field(ENVD_VERSION, alias="envdVersion")
    envd_access_token: str = Field(alias="envdAccessToken")
    domain: None = None


class SandboxDetail(_Wire):
    """``GET /sandboxes/{id}`` and the items of ``GET /v2/sandboxes``."""

    template_id: str = Field(alias="templateID")
    sandbox_id: str = Field(alias="sandboxID")
    client_id: str = Field(CLIENT_ID, alias="clientID")
    envd_version: str = Field(ENVD_VERSION, alias="envdVersion")
    started_at: datetime = Field(alias="startedAt")
    end_at: datetime = Field(alias="endAt")
    cpu_count: int = Field(alias="cpuCount")
    memory_mb: int = Field(alias="memoryMB")
    disk_size_mb: int = Field(alias="diskSizeMB")
    state: Literal["running", "paused"] = "running"
    metadata: dict[str, str] = Field(default_factory=dict)


class MetricOut(_Wire):
    """One entry of ``GET /sandboxes/{id}/metrics`` (``sbx.get_metrics()``)."""

    timestamp: datetime
    timestamp_unix: int = Field(alias="timestampUnix")
    cpu_count: int = Field(alias="cpuCount")
    cpu_used_pct: float = Field(alias="cpuUsedPct")
    mem_used: int = Field(alias="memUsed")
    mem_total: int = Field(alias="memTotal")
    mem_cache: int = Field(alias="memCache")
    disk_used: int = Field(alias="diskUsed")
    disk_total: int = Field(alias="diskTotal")


class E2BState(BaseModel):
    """What a rollout keeps of its E2B sandbox (the record's ``e2b`` field)."""

    template: str
    metadata: dict[str, str] = Field(default_factory=dict)
    env_vars: dict[str, str] = Field(default_factory=dict)
    access_token: str
    end_at: float = Field(description="When the client's timeout kills it (epoch seconds).")
    left_s: float | None = Field(
        None, description="While it is paused: the time its timeout had left (it resumes so)."
    )


def wire_json(model: BaseModel) -> dict[str, Any]:
    """A control-plane answer, as the SDK reads it (by alias, no nulls but ``domain``)."""
    data = model.model_dump(mode="json", by_alias=True)
    return {k: v for k, v in data.items() if v is not None or k == "domain"}


def epoch_to_datetime(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


# -- sandbox plane (envd) ---------------------------------------------------------------------


class ProcessConfig(_Wire):
    cmd: str = Field(min_length=1)
    args: list[str] = Field(default_factory=list)
    envs: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None


class PtySize(_Wire):
    rows: int = Field(ge=1, le=10_000)
    cols: int = Field(ge=1, le=10_000)


class Pty(_Wire):
    size: PtySize


class StartRequest(_Wire):
    process: ProcessConfig
    pty: Pty | None = None
    tag: str | None = None
    stdin: bool | None = None


class ProcessSelector(_Wire):
    pid: int | None = None
    tag: str | None = None


class SelectorRequest(_Wire):
    """``Connect``, ``CloseStdin`` and the like: which process."""

    process: ProcessSelector = Field(default_factory=ProcessSelector)


class ProcessInput(_Wire):
    stdin: str | None = Field(None, description="Bytes, base64.")
    pty: str | None = None


class SendInputRequest(_Wire):
    """``SendInput`` (``commands.send_stdin``) and ``CloseStdin`` (``close_stdin``)."""

    process: ProcessSelector = Field(default_factory=ProcessSelector)
    input: ProcessInput | None = None


class UpdateRequest(_Wire):
    """``Update`` (``pty.resize``)."""

    process: ProcessSelector = Field(default_factory=ProcessSelector)
    pty: Pty | None = None


class SendSignalRequest(_Wire):
    process: ProcessSelector = Field(default_factory=ProcessSelector)
    signal: str | int = "SIGNAL_SIGKILL"


class WatchRequest(_Wire):
    """``CreateWatcher`` (``files.watch_dir``)."""

    path: str = Field(min_length=1)
    recursive: bool = False


class WatcherRequest(_Wire):
    """``GetWatcherEvents`` and ``RemoveWatcher``."""

    watcher_id: str = Field(alias="watcherId", min_length=1, max_length=100)


class PathRequest(_Wire):
    """``Stat``, ``MakeDir``, ``Remove``, ``ListDir`` (with ``depth``)."""

    path: str = Field(min_length=1)
    depth: int = 1


class MoveRequest(_Wire):
    source: str = Field(min_length=1)
    destination: str = Field(min_length=1)


def entry_json(entry: FileEntry) -> dict[str, Any]:
    """A file's ``EntryInfo`` message."""
    message: dict[str, Any] = {
        "name": entry.name,
        "type": "FILE_TYPE_DIRECTORY" if entry.type == "dir" else "FILE_TYPE_FILE",
        "path": entry.path,
        "size": str(entry.size),
        "mode": entry.mode,
        "permissions": entry.permissions,
        "owner": entry.owner,
        "group": entry.group,
        "modifiedTime": entry.modified.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
    }
    if entry.symlink:
        message["isSymlink"] = True
        message["type"] = "FILE_TYPE_SYMLINK"
        if entry.symlink_target is not None:
            message["symlinkTarget"] = entry.symlink_target
    return message


def process_event(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """One ``StartResponse``/``ConnectResponse``: ``{"event": {kind: body}}``."""
    return {"event": {kind: body}}


def data_event(stream: Literal["stdout", "stderr", "pty"], text: str) -> dict[str, Any]:
    return process_event("data", {stream: base64.b64encode(text.encode()).decode()})
