"""Kubernetes sandbox backend: one pod per sandbox in ``k8s_namespace``, driven through its
exec agent over the pod network (docs/kubernetes-backend.md).

The API server is on the lifecycle path only (create, watch until Ready, delete, list,
probe's status read); tool calls go straight to the agent at the pod's IP with the
sandbox's token, so they neither load the API server nor ride exec streams pinned to one
API server replica.
"""

from __future__ import annotations

import base64
import os
import secrets
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import httpx2
from lightkube import ApiError, Client, ConfigError
from lightkube.resources.core_v1 import Event, Pod, Secret

from orchestrator.config import Runtime, Settings
from orchestrator.observability.logging import get_logger
from orchestrator.sandbox import labels
from orchestrator.sandbox.agent import AGENT_MODULES
from orchestrator.sandbox.agent import agent_protocol as protocol
from orchestrator.sandbox.agent import client as agent
from orchestrator.sandbox.backend import (
    BackendUnavailable,
    HostHealth,
    ProbeResult,
    SandboxError,
    SandboxHandle,
    SandboxSpec,
    SandboxUnavailable,
)
from orchestrator.sandbox.k8s import pods
from orchestrator.sandbox.k8s.states import PodVerdict, assess
from orchestrator.sandbox.k8s.watch import watch_pod

log = get_logger(__name__)

T = TypeVar("T")

SANDBOX_ID_HEX = 12
PING_TIMEOUT_S = 5.0
EVIDENCE_EVENTS = 5
RUNTIMES: tuple[Runtime, ...] = ("runc", "runsc", "kata")
# What a call to the API server raises when it fails: refusals (ApiError is an
# HTTPStatusError), transport failures, and a missing or broken kubeconfig.
KUBE_FAILURES = (httpx2.HTTPError, ConfigError, OSError)
# Answers of an API server that is there but cannot serve for now: 429 (priority and
# fairness, or a server shutting down), 500 and 503 (its storage or caches not ready yet,
# as right after a restart), 502 and 504 (a load balancer with no replica behind it).
TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
# A cut watch is followed by a read of the pod after this long, doubling up to the max
# while the API server does not answer: a restart takes seconds, and every pending create
# of every worker retries at once.
WATCH_RETRY_MIN_S = 0.2
WATCH_RETRY_MAX_S = 2.0


class Endpoint(NamedTuple):
    """Where a sandbox's agent listens, and the token it wants."""

    ip: str
    token: str


class KubernetesBackend(agent.AgentBackend):
    """Sandboxes as pods on a Kubernetes cluster. Any worker can reach any sandbox of its
    deployment (the pod IP and the token come from the API), so ``list_owned`` spans the
    whole namespace while ``host_health`` counts this worker's own."""

    name = "kubernetes"

    def __init__(self, settings: Settings, client: Client | None = None) -> None:
        self.settings = settings
        self.host = settings.host_id
        self.namespace = settings.k8s_namespace
        if client is None:
            try:
                client = Client(namespace=self.namespace, field_manager="orchestrator")
            except KUBE_FAILURES as exc:
                raise BackendUnavailable(
                    f"no Kubernetes configuration (in-cluster or KUBECONFIG): {exc}"
                ) from exc
        self.client = client
        self.agent_files = {f"{name}.py": path.read_bytes() for name, path in AGENT_MODULES.items()}
        self._endpoints: dict[str, Endpoint] = {}
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------

    def create(self, spec: SandboxSpec) -> SandboxHandle:
        if spec.egress is not None:
            # The environment loader refuses such environments here; this is the backstop.
            raise SandboxError("egress policies are enforced by the Docker backend only")
        sandbox_id = "sbx-" + uuid.uuid4().hex[:SANDBOX_ID_HEX]
        created_at = datetime.now(UTC)
        identity = pods.SandboxIdentity(
            sandbox_id=sandbox_id,
            host=self.host,
            created_at=created_at,
            expires_at=created_at + timedelta(seconds=spec.lifetime_s),
        )
        pod = pods.render_pod(
            self.settings,
            spec,
            identity,
            disk_mb=spec.limits.disk_mb_in(self.settings),
            output_mb=spec.limits.output_mb_in(self.settings),
        )
        name = pods.pod_name(self.settings, sandbox_id)
        handle = SandboxHandle(
            sandbox_id=sandbox_id,
            backend=self.name,
            host=self.host,
            runtime=spec.runtime,
            rollout_id=spec.rollout_id,
            image=spec.image,
            native_id=name,
            created_at=created_at,
            expires_at=identity.expires_at,
        )
        token = secrets.token_urlsafe(32)
        try:
            made = self._api("create sandbox pod", lambda: self.client.create(pod))
            # After the pod, so the Secret can name it as its owner (Kubernetes deletes it
            # with the pod); the kubelet waits for the Secret before starting containers.
            uid = made.metadata.uid if made.metadata else None
            secret = pods.render_secret(
                pod, token=token, agent_files=self.agent_files, owner_uid=uid
            )
            self._api("create sandbox secret", lambda: self.client.create(secret))
            ip = self._wait_ready(name, made)
            self._remember(sandbox_id, Endpoint(ip, token))
            self._wait_for_agent(handle)
        except BaseException:
            try:
                self.destroy(handle)
            except SandboxError as exc:
                log.warning("sandbox.cleanup_failed", sandbox_id=sandbox_id, error=str(exc))
            raise
        log.info(
            "sandbox.created",
            sandbox_id=sandbox_id,
            rollout_id=spec.rollout_id,
            host=self.host,
            image=spec.image,
            runtime=spec.runtime,
            ms=round((datetime.now(UTC) - created_at).total_seconds() * 1000, 1),
        )
        return handle

    def _wait_ready(self, name: str, pod: Pod) -> str:
        """Watch the pod until it is Ready (returns its IP), fails, or stays unready past
        ``k8s_pending_timeout_s`` (raises SandboxError with the pod's evidence).

        A watch the API server cuts (a restart, a rollout of its replicas, a proxy dropping
        the stream) or cannot serve for a moment says nothing about the pod, which runs
        on without it: the pod is read again, with a backoff, until the deadline
        (``_read_again``). Only an API server that stays unreachable until then fails the
        create, as ``BackendUnavailable``; one that refuses (401, 403, ...) fails it at once,
        as ``SandboxError``."""
        timeout = self.settings.k8s_pending_timeout_s
        started = time.monotonic()
        deadline = started + timeout
        current: Pod | None = pod
        version = pod.metadata.resourceVersion if pod.metadata else None
        while True:
            elapsed = time.monotonic() - started
            verdict = assess(current, pending_for_s=elapsed, pending_timeout_s=timeout)
            ip = current.status.podIP if current and current.status else None
            if verdict.ready and ip:
                return ip
            if verdict.fatal or elapsed >= timeout:
                raise SandboxError(
                    f"sandbox pod {name} did not start ({verdict.state}): {verdict.detail}"
                    f"{self._events(name)}"
                )
            try:
                for kind, obj in watch_pod(
                    self.client,
                    namespace=self.namespace,
                    name=name,
                    resource_version=version,
                    timeout_s=timeout - elapsed,
                ):
                    version = obj.metadata.resourceVersion if obj.metadata else version
                    current = None if kind == "DELETED" else obj
                    seen = assess(current)
                    if seen.ready or seen.fatal:
                        break
            except httpx2.HTTPStatusError as exc:
                code = _status_code(exc)
                if code == 410:
                    # Our version is too old for the watch cache: start again from a read.
                    current = self._get_pod(name)
                elif code in TRANSIENT_STATUSES:
                    current = self._read_again(name, exc, deadline)
                else:
                    raise _fault("watch sandbox pod", exc) from exc
                version = current.metadata.resourceVersion if current and current.metadata else None
            except KUBE_FAILURES as exc:
                # Cut mid-stream (httpx2 RemoteProtocolError, ReadError) or not reopened
                # (ConnectError): what happened to the pod meanwhile is read, not watched.
                current = self._read_again(name, exc, deadline)
                version = current.metadata.resourceVersion if current and current.metadata else None

    def _read_again(self, name: str, cut: BaseException, deadline: float) -> Pod | None:
        """The pod, read again after its watch was cut by ``cut``: retried with a backoff
        while the API server does not answer or cannot serve yet, until ``deadline``; then
        the last failure, as ``_fault`` says it (BackendUnavailable when unreachable)."""
        log.warning("sandbox.watch_cut", pod=name, error=f"{type(cut).__name__}: {cut}")
        failure = cut
        delay = WATCH_RETRY_MIN_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _fault("watch sandbox pod", failure) from failure
            time.sleep(min(delay, left))
            delay = min(delay * 2, WATCH_RETRY_MAX_S)
            try:
                return self.client.get(Pod, name, namespace=self.namespace)
            except httpx2.HTTPStatusError as exc:
                code = _status_code(exc)
                if code == 404:
                    return None  # gone while we could not watch: the caller says so
                if code not in TRANSIENT_STATUSES:
                    raise _fault("read sandbox pod", exc) from exc
                failure = exc
            except KUBE_FAILURES as exc:
                failure = exc

    def _wait_for_agent(self, handle: SandboxHandle) -> None:
        deadline = time.monotonic() + self.settings.sandbox_start_timeout_s
        while True:
            try:
                self._call(handle, protocol.ping(), PING_TIMEOUT_S)
                return
            except SandboxUnavailable as exc:
                if time.monotonic() > deadline:
                    raise SandboxError(
                        f"exec agent did not answer within "
                        f"{self.settings.sandbox_start_timeout_s} s: {exc}"
                    ) from exc
            time.sleep(0.1)

    def destroy(self, handle: SandboxHandle) -> None:
        self._forget(handle.sandbox_id)
        for kind, action in ((Pod, "delete sandbox pod"), (Secret, "delete sandbox secret")):
            try:
                self.client.delete(kind, handle.native_id, namespace=self.namespace, grace_period=0)
            except ApiError as exc:
                if exc.status.code != 404:
                    raise _fault(action, exc) from exc
            except KUBE_FAILURES as exc:
                raise _fault(action, exc) from exc
        log.info("sandbox.destroyed", sandbox_id=handle.sandbox_id, rollout_id=handle.rollout_id)

    # -- commands --------------------------------------------------------------------------

    def _call(
        self,
        handle: SandboxHandle,
        request: dict[str, Any],
        timeout_s: float,
        on_chunk: agent.OnChunk | None = None,
    ) -> dict[str, Any]:
        endpoint = self._endpoint(handle)
        try:
            return agent.call_tcp(
                endpoint.ip,
                self.settings.k8s_agent_port,
                endpoint.token,
                request,
                timeout_s,
                watch=lambda: self._why_not_answering(handle),
                on_chunk=on_chunk,
            )
        except (SandboxUnavailable, agent.AgentUnauthorized) as exc:
            # A refused token means the pod IP now belongs to another sandbox (pod IPs are
            # reused): this sandbox's agent is as unreachable as if nothing answered.
            self._forget(handle.sandbox_id)
            # Only on failure, so calls never pay for it: what the pod's status says.
            kind = agent.AgentSilent if isinstance(exc, agent.AgentSilent) else SandboxUnavailable
            raise kind(f"{exc}; {self._state_evidence(handle)}") from exc

    def _endpoint(self, handle: SandboxHandle) -> Endpoint:
        """The agent's address and token: remembered from create, else (another worker's
        sandbox, or after a restart) read from the pod and its Secret."""
        with self._lock:
            known = self._endpoints.get(handle.sandbox_id)
        if known is not None:
            return known
        pod = self._get_pod(handle.native_id)
        ip = pod.status.podIP if pod and pod.status else None
        verdict = assess(pod)
        # An ended pod keeps its podIP in its status, but the IP is free for other pods.
        if pod is None or not ip or not verdict.alive:
            raise SandboxUnavailable(
                f"sandbox {handle.sandbox_id} has no agent to reach: {verdict.state}: "
                f"{verdict.detail}"
            )
        try:
            secret = self.client.get(Secret, handle.native_id, namespace=self.namespace)
        except ApiError as exc:
            if exc.status.code == 404:
                raise SandboxUnavailable(f"sandbox {handle.sandbox_id} has no Secret") from exc
            raise _fault("read sandbox secret", exc) from exc
        except KUBE_FAILURES as exc:
            raise _fault("read sandbox secret", exc) from exc
        encoded = (secret.data or {}).get(pods.TOKEN_KEY, "")
        endpoint = Endpoint(ip, base64.b64decode(encoded).decode())
        self._remember(handle.sandbox_id, endpoint)
        return endpoint

    def _remember(self, sandbox_id: str, endpoint: Endpoint) -> None:
        with self._lock:
            self._endpoints[sandbox_id] = endpoint

    def _forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._endpoints.pop(sandbox_id, None)

    def _why_not_answering(self, handle: SandboxHandle) -> str | None:
        """For a slow reply: the pod's state when its agent cannot answer at all."""
        try:
            verdict = assess(self._get_pod(handle.native_id))
        except SandboxError:
            return None  # the API server is slow too: keep waiting for the agent
        return None if verdict.alive else f"sandbox state: {verdict.state} {verdict.detail}"

    def _state_evidence(self, handle: SandboxHandle) -> str:
        try:
            verdict = assess(self._get_pod(handle.native_id))
        except SandboxError as exc:
            return f"sandbox state unknown: {exc}"
        return f"sandbox state: {verdict.state} {verdict.detail}".rstrip()

    # -- health ----------------------------------------------------------------------------

    def probe(self, handle: SandboxHandle) -> ProbeResult:
        """The pod's status from the API server, then a trivial command through the agent.

        Says ``agent_caused`` when the agent broke the sandbox itself: OOM-killed at its
        memory limit, evicted past its own disk limit, or no command can start because its
        processes fill the pids limit. Every other fault (evicted for the node's sake, node
        lost, pod gone, past its lifetime, agent not answering) is ours."""
        verdict = assess(self._get_pod(handle.native_id))
        if not verdict.alive:
            # Its IP is free for other pods now: never dial the remembered one again.
            self._forget(handle.sandbox_id)
            return _stopped_probe(verdict)
        probed = self._probe_agent(handle, verdict.state)
        if probed is not None:
            return probed
        # A pod being killed drops the agent's connection before its status says so:
        # watch it for a moment, so the evidence is its end and the end's cause.
        settled = self._settled(handle.native_id)
        if not settled.alive:
            self._forget(handle.sandbox_id)
            return _stopped_probe(settled)
        return ProbeResult(
            alive=True,
            state=settled.state,
            agent_ok=False,
            detail=f"the exec agent is gone or silent: {settled.state} {settled.detail}".rstrip(),
        )

    def _still_running(self, handle: SandboxHandle) -> bool:
        try:
            return assess(self._get_pod(handle.native_id)).alive
        except SandboxError:
            return False

    def _settled(self, name: str) -> PodVerdict:
        pod = self._get_pod(name)
        verdict = assess(pod)
        if not verdict.alive or pod is None or pod.metadata is None:
            return verdict
        try:
            for kind, obj in watch_pod(
                self.client,
                namespace=self.namespace,
                name=name,
                resource_version=pod.metadata.resourceVersion,
                timeout_s=agent.PROBE_SETTLE_S,
            ):
                verdict = assess(None if kind == "DELETED" else obj)
                if not verdict.alive:
                    break
        except KUBE_FAILURES:
            pass  # the verdict so far is the evidence there is
        return verdict

    def host_health(self) -> HostHealth:
        """This worker's health for its heartbeat. ``backend_ok`` means "the backend is
        reachable" (here: the API server answered a list of this worker's sandboxes, timed
        as ``backend_ping_ms``); ``disk_free_bytes`` is the worker's own ``state_dir`` (the
        sandboxes' disks are the nodes', watched by the kubelet). An unreachable API server
        only cordons this worker: its pods run on and are reached without it
        (``outage_loses_sandboxes``). Never raises."""
        disk_free = _free_bytes(self.settings.state_dir)
        started = time.monotonic()
        # Only this worker's pods, selected by the API server: every worker lists on every
        # heartbeat, and the namespace may hold thousands of other workers' sandboxes.
        selector = self._selector()
        if pods.label_safe(self.host):
            selector[labels.HOST] = self.host
        try:
            found = self.client.list(Pod, namespace=self.namespace, labels=selector)
            mine = [h for h in map(self._handle_of, found) if h.host == self.host]
        except KUBE_FAILURES as exc:
            return HostHealth(
                backend_ok=False,
                disk_free_bytes=disk_free,
                sandboxes=0,
                error=str(_fault("list sandbox pods", exc))[:500],
                outage_loses_sandboxes=False,
            )
        ping_ms = round((time.monotonic() - started) * 1000, 2)
        return HostHealth(
            backend_ok=True,
            backend_ping_ms=ping_ms,
            disk_free_bytes=disk_free,
            sandboxes=len(mine),
            outage_loses_sandboxes=False,
        )

    def _get_pod(self, name: str) -> Pod | None:
        try:
            return self.client.get(Pod, name, namespace=self.namespace)
        except ApiError as exc:
            if exc.status.code == 404:
                return None
            raise _fault("read sandbox pod", exc) from exc
        except KUBE_FAILURES as exc:
            raise _fault("read sandbox pod", exc) from exc

    def _events(self, name: str) -> str:
        """The pod's latest events, as evidence of a failed start ('' when unreadable)."""
        try:
            events = list(
                self.client.list(
                    Event, namespace=self.namespace, fields={"involvedObject.name": name}
                )
            )
        except KUBE_FAILURES as exc:
            # Evidence, not the outcome: the create fails either way, with less to say
            # (a Role without events list is the usual cause: say so in the log).
            log.warning("sandbox.events_unreadable", pod=name, error=str(exc))
            return ""
        # The API server lists by name, not by time: the latest are found by their stamps
        # (to the second), then by name (the recorders name an event `<pod>.<ns since
        # epoch, hex>`, so within a second names are in time order too).
        events.sort(key=_event_order)
        lines = [
            f"{e.reason}: {(e.message or '').strip()}"
            for e in evidence_events(events)
            if e.reason or e.message
        ]
        return f"; events: {' | '.join(lines)}" if lines else ""

    # -- ownership -------------------------------------------------------------------------

    def list_owned(self) -> list[SandboxHandle]:
        try:
            found = list(self.client.list(Pod, namespace=self.namespace, labels=self._selector()))
        except KUBE_FAILURES as exc:
            raise _fault("list sandbox pods", exc) from exc
        return [self._handle_of(pod) for pod in found]

    def _handle_of(self, pod: Pod) -> SandboxHandle:
        stamp = pods.stamp_of(pod.metadata)
        image = pod.spec.containers[0].image if pod.spec and pod.spec.containers else None
        runtime = stamp.get(labels.RUNTIME, "runc")
        return SandboxHandle(
            sandbox_id=stamp.get(labels.SANDBOX, ""),
            backend=self.name,
            host=stamp.get(labels.HOST, self.host),
            runtime=runtime if runtime in RUNTIMES else "runc",
            rollout_id=stamp.get(labels.ROLLOUT, ""),
            image=(image or "").removeprefix(self.settings.k8s_image_registry),
            native_id=(pod.metadata.name if pod.metadata else None) or "",
            created_at=labels.parse_time(stamp.get(labels.CREATED)),
            expires_at=labels.parse_time(stamp.get(labels.EXPIRES)),
        )

    def sweep_leftovers(self, *, everything: bool = False) -> int:
        """Delete Secrets whose pod is gone (Kubernetes' garbage collector deletes them with
        their pod; this catches any it has not, e.g. one made without its owner). Returns
        how many were removed. ``everything`` changes nothing: a pod has no network of its
        own to remove."""
        live = {h.native_id for h in self.list_owned()}
        # The Secret is made just after its pod: a young one may belong to a pod being
        # created right now, listed after the pods were.
        settled = datetime.now(UTC) - timedelta(seconds=self.settings.sandbox_start_timeout_s * 2)
        try:
            found = list(
                self.client.list(Secret, namespace=self.namespace, labels=self._selector())
            )
        except KUBE_FAILURES as exc:
            raise _fault("list sandbox secrets", exc) from exc
        removed = 0
        for secret in found:
            meta = secret.metadata
            if meta is None or not meta.name or meta.name in live:
                continue
            born = meta.creationTimestamp
            if born is not None and born > settled:
                continue
            try:
                self.client.delete(Secret, meta.name, namespace=self.namespace)
                removed += 1
            except ApiError as exc:
                if exc.status.code != 404:
                    log.warning("sandbox.sweep_secret_failed", secret=meta.name, error=str(exc))
            except KUBE_FAILURES as exc:
                raise _fault("delete sandbox secret", exc) from exc
        return removed

    def _selector(self) -> dict[str, Any]:
        return dict(pods.selector(self.settings))

    def _api(self, action: str, call: Any) -> Any:
        try:
            return call()
        except KUBE_FAILURES as exc:
            raise _fault(action, exc) from exc


def _stopped_probe(verdict: PodVerdict) -> ProbeResult:
    return ProbeResult(
        alive=False,
        state=verdict.state,
        agent_ok=False,
        detail=verdict.detail,
        exit_code=verdict.exit_code,
        oom_killed=verdict.oom_killed,
        agent_caused=verdict.agent_caused,
    )


def _free_bytes(path: Path) -> int:
    """Free bytes on the filesystem of ``path`` or of its nearest existing parent."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        st = os.statvfs(path)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def evidence_events(events: list[Event]) -> list[Event]:
    """At most ``EVIDENCE_EVENTS`` of ``events`` (sorted by time), kept in that order:
    the latest warnings first, then the latest of the rest. The warning says why (a real
    kubelet's failed pull: "Failed to pull image ...: no such host"); the normal events
    after it (its retries, "Pulling" again, "BackOff") only say that it goes on, and a
    cut by time alone dropped it (seen on the real node, 2 starts in 3)."""
    warnings = [e for e in events if e.type == "Warning"][-EVIDENCE_EVENTS:]
    kept = {id(e) for e in warnings}
    room = EVIDENCE_EVENTS - len(kept)
    if room:
        kept |= {id(e) for e in [e for e in events if id(e) not in kept][-room:]}
    return [e for e in events if id(e) in kept]


def _event_order(event: Event) -> tuple[datetime, str]:
    """When the event last happened (its newest stamp), then its name."""
    meta = event.metadata
    stamps = [event.lastTimestamp, event.eventTime, event.firstTimestamp]
    stamps.append(meta.creationTimestamp if meta else None)
    at = next((s for s in stamps if s is not None), datetime.min.replace(tzinfo=UTC))
    return at, (meta.name if meta and meta.name else "")


def _status_code(exc: httpx2.HTTPStatusError) -> int:
    """The HTTP status of a refusal. The API server reports an expired watch (410) as an
    ERROR event inside a 200 stream: lightkube raises that as an ApiError with a Status and
    no response."""
    if isinstance(exc, ApiError):
        return int(exc.status.code or 0)
    return exc.response.status_code


def _fault(action: str, exc: BaseException) -> SandboxError:
    """The API server refusing vs. not answering: both infrastructure, told apart for the
    evidence."""
    if isinstance(exc, ApiError):
        status = exc.status
        return SandboxError(
            f"kubernetes refused to {action}: {status.code} {status.reason}: {status.message}"
        )
    if isinstance(exc, httpx2.HTTPStatusError):
        return SandboxError(
            f"kubernetes refused to {action}: {exc.response.status_code} {exc.response.text[:300]}"
        )
    return BackendUnavailable(f"kubernetes API unreachable while trying to {action}: {exc}")
