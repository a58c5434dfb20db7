"""What an E2B sandbox is here: an orchestrator rollout of source ``e2b`` (docs/e2b.md).

Its sandbox is made the way every rollout's is (admission, warm pools, the host's creation
lane); its commands are tool calls of the client tool ``sandbox.command`` (run tickets: at
most once, results kept; the trajectory; metrics); the reaper ends it at its client's
timeout; killing it closes the rollout. Its files go to the host's worker as file
operations. A sandbox that failed for infrastructure reasons answers as such: never as a
command's own failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import posixpath
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from orchestrator.e2b.connect import Code, ConnectError
from orchestrator.e2b.models import (
    E2BState,
    MetricOut,
    NewSandbox,
    SandboxDetail,
    SandboxOut,
    SnapshotOut,
    epoch_to_datetime,
)
from orchestrator.environments.loader import ResolvedEnvironment
from orchestrator.environments.models import EnvironmentConfig
from orchestrator.outcomes import Cause
from orchestrator.rollouts.errors import InfraError, Rejected, RejectedKind
from orchestrator.rollouts.lookup import present
from orchestrator.rollouts.models import CallReply
from orchestrator.rollouts.service import RolloutService
from orchestrator.sandbox.agent.client import READ_FILE_TIMEOUT_S, REPLY_SLACK_S
from orchestrator.sandbox.backend import FileAction, FileOpResult, FileRefused
from orchestrator.sandbox.egress import ALL_TRAFFIC, NO_EGRESS, EgressPolicy, EgressRefused
from orchestrator.state.admission import AtCapacity
from orchestrator.state.e2b import E2BProcesses, E2BWatchers
from orchestrator.state.models import RolloutSource, RolloutState
from orchestrator.state.records import Rollout
from orchestrator.state.replies import QueueTimeout
from orchestrator.state.snapshots import SnapshotKind, SnapshotRecord
from orchestrator.state.streams import follow
from orchestrator.state.wire import (
    FileOpRequest,
    InfraFault,
    InputNotTaken,
    MeasureSandbox,
    ReplyT,
    RequestT,
    SendInput,
    SignalExec,
    Task,
    Tasks,
)
from orchestrator.tenants import OPERATOR, Principal, Tenants
from orchestrator.tools.command import COMMAND_TOOL

# A sandbox id is a DNS label (E2B's clients may put it in a host name): lowercase
# letters and digits, "e2b" first.
ID_PREFIX = "e2b"
SIGNAL_UNTIL_STARTED_S = 10.0
"""How long a signal to a listed command waits for the agent to have started it."""
Pieces = AsyncIterator[tuple[str, bytes]]
_ALIVE = {RolloutState.CREATING.value, RolloutState.ACTIVE.value, RolloutState.PAUSED.value}
MEMORY_REFUSED = (
    "memory is not kept here: a snapshot or a pause keeps the filesystem (/workspace and the "
    "writable directories), and the sandbox made from it starts without the source's "
    "processes; ask for mode='filesystem'"
)
COMMANDS_END_S = 10.0
"""How long a pause waits for the commands it killed to be seen ended."""


class SandboxGone(Exception):
    """No such E2B sandbox, or it ended (killed, or past its timeout)."""

    def __init__(self, sandbox_id: str) -> None:
        super().__init__(f"sandbox {sandbox_id} was not found")
        self.sandbox_id = sandbox_id


class BadRequest(Exception):
    """The client asked for something this server cannot do or refuses."""


@dataclass(frozen=True)
class Process:
    """A command started through ``process.Process/Start``, by its pid."""

    pid: int
    call_id: str
    exec_id: str
    argv: list[str]
    cwd: str
    tag: str | None = None
    stdin: bool = False
    pty: tuple[int, int] | None = None


class E2BSandboxes:
    """The E2B API's view of rollouts: the control plane's operations, and what the
    sandbox plane needs of a sandbox (its record, its commands, its files)."""

    def __init__(self, service: RolloutService, tenants: Tenants) -> None:
        self.service = service
        self.tenants = tenants
        self.settings = service.settings
        self.store = service.store
        self.processes_table = E2BProcesses(service.store.redis, service.store.keys)
        self.watchers = E2BWatchers(service.store.redis, service.store.keys)

    # -- the control plane ----------------------------------------------------------------

    async def create(self, body: NewSandbox, caller: Principal) -> SandboxOut:
        """A new sandbox of ``caller``'s tenant from ``body.template``: a snapshot's id (or
        name) of those it sees, an environment's name, a codebase's name (on the default
        environment), or ``<environment>/<codebase>``."""
        if body.auto_pause:
            raise BadRequest(
                "autoPause is not supported: pause a sandbox with sbx.pause(), and it resumes "
                "on its next request"
            )
        snapshot = await self._snapshot_named(body.template_id, caller)
        if snapshot is not None:
            resolved = self.service.snapshots.environment_of(snapshot)
            environment, codebase = snapshot.environment, snapshot.codebase
        else:
            environment, codebase = self._template(body.template_id)
            resolved = await self._resolve(environment, codebase)
        resolved = _with_egress(resolved, body)
        state = self._new_state(
            body.template_id, resolved, body.timeout, body.metadata, body.env_vars
        )
        return await self._start(state, resolved, environment, codebase, snapshot, caller)

    def _new_state(
        self,
        template: str,
        resolved: ResolvedEnvironment,
        timeout: int | None,
        metadata: dict[str, str],
        env_vars: dict[str, str],
    ) -> E2BState:
        lifetime = resolved.environment.effective_lifetime_s(self.settings)
        timeout = timeout or self.settings.e2b_default_timeout_s
        if timeout > lifetime:
            raise BadRequest(f"timeout {timeout} s exceeds this sandbox's maximum of {lifetime} s")
        return E2BState(
            template=template,
            metadata=metadata,
            env_vars=env_vars,
            access_token=secrets.token_urlsafe(32),
            end_at=time.time() + timeout,
        )

    async def _start(
        self,
        state: E2BState,
        resolved: ResolvedEnvironment,
        environment: str,
        codebase: str | None,
        snapshot: SnapshotRecord | None,
        caller: Principal,
    ) -> SandboxOut:
        sandbox_id = ID_PREFIX + uuid.uuid4().hex[:20]
        item = {"environment": environment} | ({"codebase": codebase} if codebase else {})
        if snapshot is not None:
            item["snapshot"] = snapshot.snapshot_id
        await self.service.start(
            sandbox_id,
            item,
            source=RolloutSource.E2B,
            environment=environment,
            codebase=codebase,
            exclusive=True,
            resolved=resolved,
            fields={"e2b": state.model_dump(mode="json")},
            snapshot=snapshot,
            caller=caller,
        )
        return self._out(sandbox_id, state)

    # -- snapshots and forks (docs/snapshots.md) ------------------------------------------

    async def snapshot(
        self, sandbox_id: str, name: str | None, memory: bool | None, caller: Principal
    ) -> SnapshotOut:
        """``create_snapshot``: the sandbox's filesystem, kept (it runs on)."""
        self._snapshots_served()
        if memory:
            raise BadRequest(MEMORY_REFUSED)
        rollout, state = await self._running(sandbox_id, caller)
        record = await self.service.snapshots.take(rollout, name=name, template=state.template)
        return SnapshotOut(snapshot_id=record.snapshot_id, names=[name] if name else [])

    async def snapshots_listing(
        self,
        *,
        sandbox_id: str | None,
        name: str | None,
        limit: int,
        after: int,
        caller: Principal,
    ) -> tuple[list[SnapshotOut], int | None]:
        """The snapshots ``caller`` sees (of ``sandbox_id``, or named ``name``, when given),
        oldest first, from position ``after``; the position of the next page, or None."""
        found = [
            SnapshotOut(snapshot_id=r.snapshot_id, names=[r.name] if r.name else [])
            for r in await self.service.snapshots.registry.all()
            if caller.sees(r.tenant)
            and (not sandbox_id or r.parent == sandbox_id)
            and (not name or name in (r.name, r.snapshot_id))
        ]
        page = found[after : after + limit]
        return page, (after + limit if len(found) > after + limit else None)

    async def drop_snapshot(self, snapshot_id: str, caller: Principal) -> bool:
        """Delete a snapshot ``caller`` sees; False when there is none such."""
        record = await self.service.snapshots.registry.get(snapshot_id)
        if record is None or record.kind != SnapshotKind.NAMED or not caller.sees(record.tenant):
            return False
        return await self.service.snapshots.drop(snapshot_id)

    async def fork(
        self, sandbox_id: str, count: int, timeout_s: int | None, caller: Principal
    ) -> list[SandboxOut | BaseException]:
        """``fork``: a snapshot of the sandbox (it runs on), and ``count`` sandboxes made
        from it at once on its host, each of which succeeds or fails on its own. The
        snapshot is the fork's alone: forgotten once they are made, its files gone with
        the last of them."""
        self._snapshots_served()
        rollout, state = await self._running(sandbox_id, caller)
        record = await self.service.snapshots.take(
            rollout, template=state.template, kind=SnapshotKind.FORK
        )
        try:
            resolved = self.service.snapshots.environment_of(record)
            fresh = self._new_state(
                state.template, resolved, timeout_s, state.metadata, state.env_vars
            )
            made = await asyncio.gather(
                *(
                    self._start(
                        fresh.model_copy(update={"access_token": secrets.token_urlsafe(32)}),
                        resolved,
                        record.environment,
                        record.codebase,
                        record,
                        caller,
                    )
                    for _ in range(count)
                ),
                return_exceptions=True,
            )
        finally:
            await self.service.snapshots.drop(record.snapshot_id)
        return list(made)

    async def _snapshot_named(self, template: str, caller: Principal) -> SnapshotRecord | None:
        """The snapshot a template names: its id, or (not an environment's name) its name,
        of those ``caller`` sees. An id of none is refused (the snapshot was deleted, or
        never was, or is another tenant's: the same answer)."""
        registry = self.service.snapshots.registry
        if template.startswith("snap-"):
            found = await registry.get(template)
            if found is None or found.kind != SnapshotKind.NAMED or not caller.sees(found.tenant):
                raise BadRequest(
                    f"template {template!r}: no such snapshot (it may have been deleted)"
                )
            return found
        if template in self.service.environments or "/" in template:
            return None
        return await registry.find(template, caller)

    async def connect(
        self, sandbox_id: str, timeout_s: int | None, caller: Principal
    ) -> tuple[SandboxOut, bool]:
        """The same sandbox for another client, resumed if it was paused (then True)."""
        rollout, state = await self.alive(sandbox_id, caller)
        paused = rollout.state == RolloutState.PAUSED
        if paused:
            rollout, state = await self._resume(sandbox_id, timeout_s, caller)
        elif timeout_s is not None:
            state = await self._set_end(rollout, state, timeout_s)
        return self._out(sandbox_id, state), paused

    # -- pause and resume (docs/snapshots.md) ---------------------------------------------

    async def pause(self, sandbox_id: str, memory: bool | None, caller: Principal) -> bool:
        """``pause``: its filesystem kept as a snapshot, its sandbox gone (no slot, CPU or
        memory held), its commands ended; False when it was paused already. Its timeout
        stops until it resumes (``connect``, or any request to the sandbox)."""
        self._snapshots_served()
        if memory:
            raise BadRequest(MEMORY_REFUSED)
        async with self._changing(sandbox_id):
            rollout, state = await self.alive(sandbox_id, caller)
            if rollout.state == RolloutState.PAUSED:
                return False
            if rollout.state != RolloutState.ACTIVE or rollout.sandbox is None:
                raise Rejected(
                    RejectedKind.CONFLICT, f"{sandbox_id} is still being made", code="not_running"
                )
            left = max(1.0, state.end_at - time.time())
            fields = {"e2b": state.model_copy(update={"left_s": left}).model_dump(mode="json")}
            await self.service.snapshots.pause(
                rollout, self.settings.e2b_paused_keep_s, fields, self._end_commands
            )
            await self.service.starter.quotas.leave(rollout.tenant, rollout.rollout_id)
        return True

    def _snapshots_served(self) -> None:
        if self.settings.sandbox_backend != "docker":
            raise BadRequest(
                "snapshots, forks and pauses need the Docker backend (docs/snapshots.md; "
                "docs/kubernetes-backend.md says why not on Kubernetes yet)"
            )

    async def _resume(
        self, sandbox_id: str, timeout_s: int | None, caller: Principal | None
    ) -> tuple[Rollout, E2BState]:
        async with self._changing(sandbox_id):
            rollout, state = await self.alive(sandbox_id, caller)
            if rollout.state != RolloutState.PAUSED:
                return rollout, state  # resumed by another request meanwhile
            left = timeout_s or state.left_s or self.settings.e2b_default_timeout_s
            state = state.model_copy(update={"left_s": None, "end_at": time.time() + left})
            fields = {"e2b": state.model_dump(mode="json")}
            # A paused sandbox holds no place in its tenant's sandboxes quota: its resume
            # takes one again, or is refused as a new sandbox would be (429).
            quotas = self.service.starter.quotas
            await quotas.enter(self._principal(rollout.tenant), rollout.rollout_id)
            try:
                rollout = await self.service.snapshots.resume(rollout, fields)
            except BaseException:
                await quotas.leave(rollout.tenant, rollout.rollout_id)
                raise
        return rollout, state

    async def _end_commands(self, rollout: Rollout) -> None:
        """Kill every command of a sandbox being paused, and wait for them to be over."""
        for record in await self.processes(rollout.rollout_id):
            await self.signal(rollout, int(record["pid"]), kill=True)
        deadline = time.monotonic() + COMMANDS_END_S
        while time.monotonic() < deadline:
            current = await self.store.get(rollout.rollout_id)
            if current is None or current.calls_in_flight <= 0:
                return
            await asyncio.sleep(0.05)
        raise InfraError(
            f"the commands of {rollout.rollout_id} did not end for its pause; try again",
            rollout_id=rollout.rollout_id,
            code=Cause.NOT_RUN,
        )

    @contextlib.asynccontextmanager
    async def _changing(self, sandbox_id: str) -> AsyncIterator[None]:
        """One pause or resume of a sandbox at a time (its start lease)."""
        bound = self.settings.admission_wait_s + self.settings.sandbox_create_timeout_s + 60
        deadline = time.monotonic() + bound
        while not await self.store.take_start_lease(sandbox_id, bound):
            if time.monotonic() > deadline:
                raise InfraError(
                    f"{sandbox_id} is being paused or resumed by another request; try again",
                    rollout_id=sandbox_id,
                    code=Cause.NOT_RUN,
                )
            await asyncio.sleep(0.05)
        try:
            yield
        finally:
            await self.store.end_start_lease(sandbox_id)

    async def _running(self, sandbox_id: str, caller: Principal) -> tuple[Rollout, E2BState]:
        """:meth:`alive`, resumed first if it was paused."""
        rollout, state = await self.alive(sandbox_id, caller)
        if rollout.state == RolloutState.PAUSED:
            return await self._resume(sandbox_id, None, caller)
        return rollout, state

    async def detail(self, sandbox_id: str, caller: Principal) -> SandboxDetail:
        rollout, state = await self.alive(sandbox_id, caller)
        return self._detail(rollout, state)

    async def listing(
        self, *, metadata: dict[str, str], limit: int, after: int, caller: Principal
    ) -> tuple[list[SandboxDetail], int | None]:
        """Live sandboxes ``caller`` sees whose metadata has ``metadata``, from position
        ``after`` of the listing; the position of the next page, or None."""
        found: list[SandboxDetail] = []
        ids = await self.store.live_ids()
        records = await self.store.get_many(ids)
        alive = [
            r
            for r in records
            if r is not None
            and r.e2b is not None
            and r.state in _ALIVE
            and r.closed_at is None
            and caller.sees(r.tenant)
        ]
        alive.sort(key=lambda r: r.created_at)
        for rollout in alive[after:]:
            state = E2BState.model_validate(rollout.e2b)
            if all(state.metadata.get(k) == v for k, v in metadata.items()):
                found.append(self._detail(rollout, state))
        page = found[:limit]
        return page, (after + limit if len(found) > limit else None)

    async def kill(self, sandbox_id: str, caller: Principal) -> Rollout | None:
        """Kill it (destroy its sandbox, close its rollout; a failed one too): its record,
        closed; None when there is none (or it is another tenant's)."""
        paused_as = None
        try:
            rollout, _ = await self.alive(sandbox_id, caller)
            paused_as = rollout.paused_as
        except SandboxGone:
            return None
        except InfraError:
            pass  # failed, not gone: its sandbox (what is left of it) goes now
        closed = await self.service.close(sandbox_id, "killed by its E2B client", caller=caller)
        if paused_as is not None:
            await self.service.snapshots.drop(paused_as)
        return closed

    async def metrics(self, sandbox_id: str, caller: Principal) -> list[MetricOut]:
        """``get_metrics``: what it uses now, measured by its host (a paused one: none)."""
        rollout, _ = await self.alive(sandbox_id, caller)
        if rollout.sandbox is None or rollout.state == RolloutState.PAUSED:
            return []
        measured = await self._worker(
            Tasks.MEASURE_SANDBOX, rollout, MeasureSandbox(handle=rollout.sandbox)
        )
        if isinstance(measured.root, InfraFault):
            raise InfraError(
                f"could not measure sandbox {sandbox_id}: {measured.root.error}",
                rollout_id=sandbox_id,
                code=Cause.NOT_RUN,
            )
        usage = measured.root.usage
        return [
            MetricOut(
                timestamp=usage.at,
                timestamp_unix=int(usage.at.timestamp()),
                cpu_count=max(1, round(usage.cpu_count)),
                cpu_used_pct=usage.cpu_used_pct,
                mem_used=usage.mem_used,
                mem_total=usage.mem_total,
                mem_cache=usage.mem_cache,
                disk_used=usage.disk_used,
                disk_total=usage.disk_total,
            )
        ]

    async def set_timeout(self, sandbox_id: str, timeout_s: int, caller: Principal) -> None:
        rollout, state = await self.alive(sandbox_id, caller)
        await self._set_end(rollout, state, timeout_s)

    # -- what the sandbox plane needs -----------------------------------------------------

    async def alive(self, sandbox_id: str, caller: Principal | None) -> tuple[Rollout, E2BState]:
        """The sandbox's record and state while it lives; :class:`SandboxGone` when it does
        not (or ``caller`` may not see it: another tenant's); the rollout's
        :class:`InfraError` when it failed for infrastructure reasons. ``caller`` None: the
        sandbox plane, whose requests carry the sandbox's own access token instead."""
        rollout = await self.store.get(sandbox_id) if sandbox_id.startswith(ID_PREFIX) else None
        if rollout is None or rollout.e2b is None:
            raise SandboxGone(sandbox_id)
        if caller is not None and not caller.sees(rollout.tenant):
            raise SandboxGone(sandbox_id)
        failure = rollout.infra_failure
        if failure is not None or rollout.state == RolloutState.INFRA_FAILED:
            failure = failure or {}
            raise InfraError(
                str(failure.get("message", "infrastructure failure")),
                rollout_id=sandbox_id,
                code=str(failure.get("cause") or Cause.INFRA_ERROR),
            )
        state = E2BState.model_validate(rollout.e2b)
        if rollout.state not in _ALIVE or rollout.closed_at is not None:
            raise SandboxGone(sandbox_id)
        if time.time() > state.end_at and rollout.state != RolloutState.PAUSED:
            raise SandboxGone(sandbox_id)
        return rollout, state

    async def authorized(self, sandbox_id: str, token: str) -> tuple[Rollout, E2BState]:
        """:meth:`alive`, for a request that must carry the sandbox's access token; a
        paused sandbox resumes for it (E2B's resume on traffic)."""
        rollout, state = await self.alive(sandbox_id, None)
        if not secrets.compare_digest(token.encode(), state.access_token.encode()):
            raise ConnectError(Code.UNAUTHENTICATED, "wrong or missing X-Access-Token")
        if rollout.state == RolloutState.PAUSED:
            return await self._resume(sandbox_id, None, None)
        return rollout, state

    async def start_process(
        self, rollout: Rollout, state: E2BState, argv: list[str], *,
        envs: dict[str, str], cwd: str | None, timeout_s: float | None, tag: str | None,
        stdin: bool = False, pty: tuple[int, int] | None = None,
    ) -> Process:  # fmt: skip
        """Number a new command (its pid) and remember it; :meth:`run` runs it (``stdin``:
        with its input a pipe :meth:`send_input` writes; ``pty``: on a terminal of (rows,
        cols))."""
        left = state.end_at - time.time()
        cap = min(left, self.settings.command_timeout_max_s)
        timeout = min(timeout_s, cap) if timeout_s else cap
        if timeout <= 0:
            raise SandboxGone(rollout.rollout_id)
        await self._charge(rollout)
        pid = await self.processes_table.next_pid(rollout.rollout_id)
        process = Process(
            pid=pid,
            call_id=f"e2b_{pid}_{uuid.uuid4().hex[:8]}",
            exec_id=f"e2b-{pid}",
            argv=argv,
            cwd=cwd or "/workspace",
            tag=tag,
            stdin=stdin,
            pty=pty,
        )
        record = {
            **process.__dict__,
            "envs": {**state.env_vars, **envs},
            "timeout_s": timeout,
            "tenant": rollout.tenant,
        }
        await self.processes_table.put(rollout.rollout_id, pid, record)
        return process

    async def run(self, rollout_id: str, pid: int) -> CallReply:
        """Run (or, for a client that reattaches, wait for) command ``pid``: one call of
        the client tool, so a retry or a second waiter never runs it twice."""
        record = await self._process_record(rollout_id, pid)
        arguments = {
            "argv": record["argv"],
            "env": record["envs"],
            "cwd": record["cwd"],
            "timeout_s": record["timeout_s"],
            "exec_id": record["exec_id"],
            "stdin": bool(record.get("stdin")),
            "pty": record.get("pty"),
        }
        try:
            return await self.service.call_tool(
                rollout_id,
                COMMAND_TOOL,
                arguments,
                call_id=record["call_id"],
                source=RolloutSource.E2B,
                stream_key=self.store.keys.output_stream(rollout_id, record["call_id"]),
                # Its tenant's, charged when it was started (:meth:`start_process`); a
                # command numbered by an API from before tenants were kept with it: ours.
                caller=Principal(str(record["tenant"])) if record.get("tenant") else OPERATOR,
            )
        finally:
            await self.processes_table.drop(rollout_id, pid)

    def output(self, rollout_id: str, call_id: str, done: Callable[[], bool]) -> Pieces:
        """The output of the command run as call ``call_id`` as it is printed
        (state/streams.py), from its start, until ``done()``."""
        return follow(self.store.redis, self.store.keys.output_stream(rollout_id, call_id), done)

    async def process(self, rollout_id: str, pid: int) -> Process:
        """Command ``pid`` as it was started (ConnectError NOT_FOUND when it is over)."""
        record = await self._process_record(rollout_id, pid)
        size = record.get("pty")
        return Process(
            pid=int(record["pid"]),
            call_id=str(record["call_id"]),
            exec_id=str(record["exec_id"]),
            argv=list(record["argv"]),
            cwd=str(record["cwd"]),
            tag=record.get("tag"),
            stdin=bool(record.get("stdin")),
            pty=(int(size[0]), int(size[1])) if size else None,
        )

    async def processes(self, rollout_id: str) -> list[dict[str, Any]]:
        """The commands running now, by pid."""
        return await self.processes_table.running(rollout_id)

    async def find_process(self, rollout_id: str, pid: int | None, tag: str | None) -> int:
        for record in await self.processes(rollout_id):
            if (pid is not None and record["pid"] == pid) or (tag and record.get("tag") == tag):
                return int(record["pid"])
        raise ConnectError(Code.NOT_FOUND, f"process {pid if pid is not None else tag} not found")

    async def signal(self, rollout: Rollout, pid: int, *, kill: bool) -> bool:
        """Signal command ``pid``; False when it is not running.

        A command is listed from the moment it is accepted, but its agent knows it only
        once the worker has started it: a signal in between (a busy host: seen under the
        suite's load, ``kill()`` of a command just listed answering False) is sent again
        until the agent has it, or until the command is no longer listed (it ended)."""
        deadline = time.monotonic() + SIGNAL_UNTIL_STARTED_S
        while True:
            record = await self.processes_table.get(rollout.rollout_id, pid)
            if record is None or rollout.sandbox is None:
                return False
            payload = SignalExec(handle=rollout.sandbox, exec_id=record["exec_id"], kill=kill)
            reply = (await self._worker(Tasks.SIGNAL_EXEC, rollout, payload)).root
            if isinstance(reply, InfraFault):
                raise InfraError(reply.error, rollout_id=rollout.rollout_id)
            if reply.found or time.monotonic() > deadline:
                return reply.found
            await asyncio.sleep(0.05)

    async def send_input(
        self,
        rollout: Rollout,
        pid: int,
        data: bytes,
        *,
        close: bool = False,
        resize: tuple[int, int] | None = None,
    ) -> None:
        """Write ``data`` to command ``pid``'s input (and close it, with ``close``), or set
        its terminal's size. ConnectError NOT_FOUND when it is not running;
        FAILED_PRECONDITION when it has no such input. Sent again until the agent has
        started it, as a signal is."""
        deadline = time.monotonic() + SIGNAL_UNTIL_STARTED_S
        while True:
            record = await self.processes_table.get(rollout.rollout_id, pid)
            if record is None or rollout.sandbox is None:
                raise ConnectError(Code.NOT_FOUND, f"process {pid} not found")
            payload = SendInput(
                handle=rollout.sandbox,
                exec_id=record["exec_id"],
                data=data,
                close=close,
                resize=resize,
            )
            sent = (await self._worker(Tasks.SEND_INPUT, rollout, payload)).root
            if isinstance(sent, InfraFault):
                raise InfraError(sent.error, rollout_id=rollout.rollout_id)
            if isinstance(sent, InputNotTaken):
                raise ConnectError(Code.FAILED_PRECONDITION, f"process {pid}: {sent.reason}")
            if sent.found:
                return
            if time.monotonic() > deadline:
                raise ConnectError(Code.NOT_FOUND, f"process {pid} is not running")
            await asyncio.sleep(0.05)

    # -- directory watchers (files.watch_dir) ----------------------------------------------

    async def watch(self, rollout: Rollout, path: str, recursive: bool) -> str:
        """A new watcher of directory ``path``: its tree now, to tell later changes by."""
        tree = await self._tree(rollout, path, recursive)
        record = {"path": path, "recursive": recursive, "tree": tree}
        return await self.watchers.create(rollout.rollout_id, record)

    async def watched(self, rollout: Rollout, watcher_id: str) -> list[dict[str, Any]]:
        """What changed under the watcher's directory since it last looked: a file or
        directory made (create), gone (remove), written (write: its size or time changed)
        or its mode changed (chmod). Told by comparing the tree as listed then and now: a
        file made and removed between two looks is not seen; a rename is a remove and a
        create."""
        record = await self.watchers.get(rollout.rollout_id, watcher_id)
        if record is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher {watcher_id} not found")
        tree = await self._tree(rollout, record["path"], record["recursive"])
        events = watch_events(record["tree"], tree)
        if events:
            await self.watchers.put(rollout.rollout_id, watcher_id, {**record, "tree": tree})
        return events

    async def unwatch(self, rollout: Rollout, watcher_id: str) -> bool:
        return await self.watchers.remove(rollout.rollout_id, watcher_id)

    async def _tree(self, rollout: Rollout, path: str, recursive: bool) -> dict[str, Any]:
        found = await self.file_op(rollout, "list", path, depth=WATCH_DEPTH if recursive else 1)
        top = path.rstrip("/") or "/"
        return {
            posixpath.relpath(entry.path, top): [
                entry.type, entry.size, entry.modified.timestamp(), entry.mode
            ]
            for entry in found.entries
        }  # fmt: skip

    async def file_op(
        self,
        rollout: Rollout,
        action: FileAction,
        path: str,
        *,
        target: str | None = None,
        depth: int = 1,
        data: bytes | None = None,
    ) -> FileOpResult:
        """A filesystem operation on the sandbox's host; a failed sandbox fails its rollout
        (with the probe as evidence) and raises :class:`InfraError`. The path's problems
        raise :class:`FileProblem`."""
        assert rollout.sandbox is not None
        limit = self.settings.e2b_file_max_mb << 20
        if data is not None and len(data) > limit:
            raise FileProblem("too_large", f"{path}: more than {limit} bytes in one write")
        await self._charge(rollout)
        request = FileOpRequest(
            handle=rollout.sandbox,
            action=action,
            path=path,
            target=target,
            depth=depth,
            data=data,
            max_bytes=limit if action == "read" else 0,
        )
        reply = (await self._worker(Tasks.FILE_OP, rollout, request)).root
        if isinstance(reply, InfraFault):
            raise await self.service.fail(
                rollout.rollout_id, reply.cause, reply.error, reply.evidence
            )
        if isinstance(reply, FileRefused):
            raise FileProblem(reply.error, reply.message)
        return reply.result

    # -- helpers -------------------------------------------------------------------------

    def _principal(self, tenant: str) -> Principal:
        """``tenant`` with its quotas as the tenants file says now: what a request with the
        sandbox's own token (the sandbox plane's, or a resume) is charged to."""
        return Principal(tenant, quotas=self.tenants.quotas(tenant))

    async def _charge(self, rollout: Rollout) -> None:
        """A command or a file operation is a tool call of the sandbox's tenant: taken from
        its calls quota (docs/tenancy.md, "Quotas"), or refused as RESOURCE_EXHAUSTED (a
        429) before anything runs."""
        principal = self._principal(rollout.tenant)
        if principal.quotas.calls_per_s is None:
            return
        try:
            await self.service.starter.quotas.call(principal)
        except AtCapacity as exc:
            raise ConnectError(
                Code.RESOURCE_EXHAUSTED, f"{exc.message}; try again in {exc.retry_after_s} s"
            ) from exc

    async def _worker(
        self, task: Task[RequestT, ReplyT], rollout: Rollout, request: RequestT
    ) -> ReplyT:
        assert rollout.sandbox is not None
        try:
            return await self.service.queue.call(
                task,
                request,
                host=rollout.sandbox.host,
                timeout_s=self.settings.queue_wait_s + REPLY_SLACK_S + 2 * READ_FILE_TIMEOUT_S,
            )
        except QueueTimeout as exc:
            # Never run (or its answer lost with its worker): the sandbox may be fine.
            raise InfraError(
                f"no worker answered for sandbox {rollout.rollout_id}: {exc}; retry",
                rollout_id=rollout.rollout_id,
                code=Cause.NOT_RUN,
            ) from exc

    def _template(self, template: str) -> tuple[str, str | None]:
        environments = self.service.environments
        environment, _, codebase = template.partition("/")
        if codebase:
            return environment, codebase
        if template in environments:
            return template, None
        return self.settings.default_environment, template

    async def _resolve(self, environment: str, codebase: str | None) -> ResolvedEnvironment:
        try:
            return await self.service.aresolve({}, environment=environment, codebase=codebase)
        except Rejected as exc:
            raise BadRequest(
                f"template {'/'.join(p for p in (environment, codebase) if p)!r}: {exc.message} "
                "(a template is an environment's name, a codebase's, or environment/codebase)"
            ) from exc

    async def _set_end(self, rollout: Rollout, state: E2BState, timeout_s: int) -> E2BState:
        resolved = self.service.environment_of(rollout)
        lifetime = resolved.environment.effective_lifetime_s(self.settings)
        end_at = time.time() + timeout_s
        if end_at > rollout.created_at + rollout.paused_s + lifetime:
            raise BadRequest(
                f"timeout {timeout_s} s would take sandbox {rollout.rollout_id} past its "
                f"maximum lifetime of {lifetime} s"
            )
        state = state.model_copy(update={"end_at": end_at})
        updated = await self.store.update(rollout.rollout_id, e2b=state.model_dump(mode="json"))
        present(updated, rollout.rollout_id, "its timeout was set")
        return state

    async def _process_record(self, rollout_id: str, pid: int) -> dict[str, Any]:
        found = await self.processes_table.get(rollout_id, pid)
        if found is None:
            raise ConnectError(Code.NOT_FOUND, f"process {pid} not found")
        return found

    def _out(self, sandbox_id: str, state: E2BState) -> SandboxOut:
        return SandboxOut(
            template_id=state.template, sandbox_id=sandbox_id, envd_access_token=state.access_token
        )

    def _detail(self, rollout: Rollout, state: E2BState) -> SandboxDetail:
        resolved = self.service.environment_of(rollout)
        limits = resolved.environment.limits.resolve(self.settings)
        return SandboxDetail(
            template_id=state.template,
            sandbox_id=rollout.rollout_id,
            started_at=epoch_to_datetime(rollout.created_at),
            end_at=epoch_to_datetime(state.end_at),
            cpu_count=max(1, round(limits.cpus)),
            memory_mb=limits.memory_mb,
            disk_size_mb=limits.disk_mb_in(self.settings),
            state="paused" if rollout.state == RolloutState.PAUSED else "running",
            metadata=state.metadata,
        )


WATCH_DEPTH = 32
"""How deep a recursive watcher looks."""


def watch_events(before: dict[str, Any], after: dict[str, Any]) -> list[dict[str, Any]]:
    """The ``FilesystemEvent`` messages between two listings of a watched tree."""
    events = [{"name": n, "type": "EVENT_TYPE_CREATE"} for n in sorted(after.keys() - before)]
    events += [{"name": n, "type": "EVENT_TYPE_REMOVE"} for n in sorted(before.keys() - after)]
    for name in sorted(after.keys() & before.keys()):
        (kind, size, mtime, mode), old = after[name], before[name]
        if kind == "file" and (size, mtime) != (old[1], old[2]):
            events.append({"name": name, "type": "EVENT_TYPE_WRITE"})
        elif mode != old[3]:
            events.append({"name": name, "type": "EVENT_TYPE_CHMOD"})
    return events


class FileProblem(Exception):
    """A file operation failed because of the path: the client's own doing."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def asked_egress(policy: EgressPolicy, body: NewSandbox) -> EgressPolicy | None:
    """The egress ``body`` asks for within the template's ``policy``: None for the
    template's own. A request may narrow the policy, never widen it: what it cannot have is
    a 400, not a sandbox with less or more than it asked for."""
    network = body.network
    if network is not None and (network.rules or network.egress_proxy):
        raise BadRequest(
            "network.rules and network.egressProxy are not supported: this deployment "
            "enforces an allowlist only (docs/egress.md)"
        )
    if body.allow_internet_access is False:
        return NO_EGRESS
    if network is None:
        return None
    if network.allow_out:
        try:
            return policy.narrowed(network.allow_out)
        except EgressRefused as exc:
            raise BadRequest(str(exc)) from None
    if ALL_TRAFFIC in network.deny_out:
        return NO_EGRESS
    for entry in network.deny_out:
        try:
            denied = ipaddress.ip_network(entry.strip(), strict=False)
        except ValueError:
            raise BadRequest(f"denyOut {entry!r} is not an address or CIDR") from None
        overlapping = [str(n) for n in policy.networks if n.overlaps(denied)]
        if overlapping:
            raise BadRequest(
                f"denyOut {entry!r} overlaps what the template allows ({', '.join(overlapping)})"
                ": name what the sandbox may reach in allowOut instead (egress is deny by "
                "default here)"
            )
    return None


def _with_egress(resolved: ResolvedEnvironment, body: NewSandbox) -> ResolvedEnvironment:
    """``resolved``, its egress narrowed as ``body`` asks. A narrowed environment is one of
    its own (pinned with the rollout, so a fork or a resume keeps it), with no pool: a pool
    sandbox sits on the template's network, and is never handed to it nor given back."""
    env = resolved.environment
    asked = asked_egress(env.egress, body)
    if asked is None or asked == env.egress:
        return resolved
    fields = json.loads(env.snapshot) | {
        "egress": asked.model_dump(mode="json"),
        "pool_size": 0,
        "expected_concurrency": 0,
        "pool_autosize": False,
        "pool_codebases": [],
        "reuse": False,
    }
    return dataclasses.replace(resolved, environment=EnvironmentConfig.model_validate(fields))
