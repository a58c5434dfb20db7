"""The queue's wire: every task a worker runs, what the API sends and what comes back,
paired in one table (:class:`Tasks`). JSON on the wire; the same models on both ends: the
API asks through state/replies.WorkerClient, typed by the pair, and the worker's handler
(queue/handlers.py, registered by ``handles``) takes the request model and returns the reply
model, as SWE-ReX shares its request and response models."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, RootModel

from orchestrator.outcomes import Cause
from orchestrator.sandbox.backend import (
    CommitWorkspace,
    ExecRan,
    FileAction,
    FileOpResult,
    FileRead,
    FileRefused,
    ProbeResult,
    SandboxHandle,
    SandboxOp,
    SandboxSpec,
    SandboxUsage,
    SnapshotTaken,
)
from orchestrator.sandbox.testrun import TestRun, TestRunResult


class TaskName(StrEnum):
    """Every task a worker runs (queue/handlers.py)."""

    CREATE_SANDBOX = "orchestrator.create_sandbox"
    RUN_OP = "orchestrator.run_op"
    EARLIER_TOOL_CALL = "orchestrator.run_tool"
    """A tool call as an API of an earlier release sends it (the tool, not its operation):
    refused unrun (queue/handlers.refuse_tool_call)."""
    PROBE_SANDBOX = "orchestrator.probe_sandbox"
    RUN_TESTS = "orchestrator.run_tests"
    FILE_OP = "orchestrator.file_op"
    SIGNAL_EXEC = "orchestrator.signal_exec"
    SEND_INPUT = "orchestrator.send_input"
    DESTROY_SANDBOX = "orchestrator.destroy_sandbox"
    RECYCLE_SANDBOX = "orchestrator.recycle_sandbox"
    SWEEP_HOST = "orchestrator.sweep_host"
    REFILL_POOLS = "orchestrator.refill_pools"
    CHECK_COMMIT = "orchestrator.check_commit"
    SNAPSHOT_SANDBOX = "orchestrator.snapshot_sandbox"
    MEASURE_SANDBOX = "orchestrator.measure_sandbox"
    DROP_SNAPSHOT = "orchestrator.drop_snapshot"


WIRE_VERSION = 3
"""This release's wire, in every heartbeat (state/heartbeat.Heartbeat.wire): a call is sent
only to a worker that speaks it (an earlier one's heartbeat has none), so an upgrade that
mixes releases answers a call never run (a 503 to retry) rather than losing it. Raise it
when a task's request changes so that a worker of the earlier release cannot run it.
3: an operation may name secrets its worker reads (an earlier worker would run the command
without them, and the agent would be scored on our omission)."""


class Request(BaseModel):
    """What the API sends a worker: a task's one argument."""

    reply_to: str | None = Field(
        None,
        description="The Redis list the worker pushes its reply to (state/replies.py), set "
        "by WorkerClient.call; None: nobody waits (a tool call's reply goes with its "
        "ticket, state/calls.py).",
    )


class Nothing(Request):
    """The request of a task that takes no argument, or the reply of one that sends none."""


class Accepted(BaseModel):
    """The reply of a task handed to a lane: its outcome comes later, or never to the
    caller (a recycling)."""

    accepted: bool = True


class InfraFault(BaseModel):
    """The sandbox, its backend or its host failed us: the one infrastructure variant of
    every reply that can have one (never scored; a rollout fails with ``cause``)."""

    kind: Literal["infra"] = "infra"
    error: str
    cause: Cause = Cause.TOOL_CALL_FAILED
    evidence: dict[str, Any] = Field(default_factory=dict)


class CreateSandbox(Request):
    rollout_id: str
    trace_id: str | None = Field(
        None, description="The rollout's trace id for logs (Agent RFT's; None: the rollout id)."
    )
    spec: SandboxSpec
    group: str | None = Field(
        None,
        description="The rollout's group (a digest of its dataset item: a GRPO group), "
        "seated together by the creation lane (queue/lane.py); None: on its own.",
    )


class SnapshotSandbox(Request):
    """Keep a sandbox's filesystem state on its host (sandbox/docker/snapshots.py)."""

    handle: SandboxHandle
    snapshot_id: str


class Snapshotted(BaseModel):
    kind: Literal["taken"] = "taken"
    taken: SnapshotTaken


class SnapshotNotTaken(BaseModel):
    """The caller's doing (e.g. too many generations): not ours."""

    kind: Literal["refused"] = "refused"
    reason: str


class SnapshotMade(
    RootModel[Annotated[Snapshotted | SnapshotNotTaken | InfraFault, Field(discriminator="kind")]]
):
    """A :class:`SnapshotSandbox`'s reply: the snapshot, or why not."""


class MeasureSandbox(Request):
    """What a sandbox uses now (E2B's ``get_metrics``)."""

    handle: SandboxHandle


class Measured(BaseModel):
    kind: Literal["measured"] = "measured"
    usage: SandboxUsage


class SandboxMeasured(RootModel[Annotated[Measured | InfraFault, Field(discriminator="kind")]]):
    """A :class:`MeasureSandbox`'s reply: what the sandbox uses now, or why it could not
    be told."""


class DropSnapshot(Request):
    """Remove a snapshot's files from its host, now unless something is made over it."""

    snapshot_id: str


class SnapshotDropped(BaseModel):
    """A :class:`DropSnapshot`'s reply: ``removed`` False when something is made over it
    (the sweep removes it once free) or, with ``error``, the host failed to."""

    removed: bool = False
    error: str | None = None


class CheckCommit(Request):
    """Is this commit in this repository? Asked of any host (the shared queue), which
    fetches the repository when its store lacks the commit (sandbox/repos.py)."""

    workspace: CommitWorkspace
    materialise: bool = Field(
        False, description="Also build the commit's layer on that host (dataset prepare)."
    )


class CommitChecked(BaseModel):
    found: bool = False
    built: bool = Field(False, description="This call built the commit's layer on the host.")
    setup_image: str = Field("", description="The commit's set-up image ('' no set-up).")
    committed_at: float = Field(0.0, description="The commit's committer time (Unix).")
    setup_error: str | None = Field(
        None, description="The repository's set-up does not build for this commit: its fault."
    )
    host: str = ""
    error: str | None = Field(None, description="The host could not tell: an infra fault.")


class Created(BaseModel):
    kind: Literal["created"] = "created"
    handle: SandboxHandle


class SandboxCreated(RootModel[Annotated[Created | InfraFault, Field(discriminator="kind")]]):
    """A :class:`CreateSandbox`'s reply: the sandbox, or why it could not be made (ours)."""


class RunOp(Request):
    """A tool call's work on its sandbox's host: one sandbox operation, decided by the API
    from the tool and its arguments (tools/), so the worker needs no tool, environment or
    setting to run it, and run at most once under the call's run ticket (state/calls.py)."""

    rollout_id: str
    trace_id: str | None = Field(
        None, description="The rollout's trace id for logs (Agent RFT's; None: the rollout id)."
    )
    call_id: str
    ticket: str = Field(description="The call's run ticket key (state/calls.py).")
    attempt: str = Field(description="The attempt the ticket must name for this to run.")
    handle: SandboxHandle
    op: SandboxOp
    stream_key: str | None = Field(
        None,
        description="Append the command's output to this list as it is printed (a client's "
        "command: state/streams.py); None: only its result.",
    )
    enqueued_at: float = Field(description="time.time() when the API enqueued it.")


class EarlierToolCall(Request):
    """A tool call as an API of an earlier release sends it: only what refusing it reads."""

    rollout_id: str
    call_id: str
    ticket: str
    attempt: str


class SandboxKilled(BaseModel):
    """The agent's own doing took its whole sandbox down while the operation ran (gVisor
    ends the sandbox at its memory limit): scored as the agent's mistake."""

    kind: Literal["killed"] = "killed"
    cause: str = Field(description="The limit it hit, as an error kind (memory_limit, ...).")
    detail: str


class OpDone(BaseModel):
    """A :class:`RunOp`'s reply, kept on its ticket: what the operation did (ok, or the
    agent's doing) or the infrastructure's fault, and where the time went."""

    outcome: Annotated[
        ExecRan | FileRead | FileRefused | SandboxKilled | InfraFault,
        Field(discriminator="kind"),
    ]
    queue_ms: float = 0.0
    exec_ms: float = 0.0


class DestroySandbox(Request):
    handle: SandboxHandle
    reason: str


class SandboxDestroyed(BaseModel):
    """A :class:`DestroySandbox`'s reply: ``error`` when the backend failed to (the host's
    sweep destroys it later: its rollout is over)."""

    destroyed: bool = False
    error: str | None = None


class RecycleSandbox(Request):
    """A sandbox whose rollout ended cleanly, to reset and return to ``pool`` (or destroy,
    when its audit or its pool says no). Its slot is counted in transit (``transit``, a
    member of state/keys.Keys.transit) until it is in the pool or gone."""

    handle: SandboxHandle
    spec: SandboxSpec = Field(description="What it was made from: its audit's reference.")
    pool: str
    transit: str
    reason: str


class ProbeSandbox(Request):
    handle: SandboxHandle


class RunTests(Request):
    """A grader's tests, run in a rollout's sandbox against the agent's work
    (sandbox/testrun.py)."""

    handle: SandboxHandle
    run: TestRun


class TestsRan(BaseModel):
    kind: Literal["ran"] = "ran"
    result: TestRunResult


class RunTestsReply(RootModel[Annotated[TestsRan | InfraFault, Field(discriminator="kind")]]):
    """The run's result; or the sandbox or the backend failed, and there is none."""


class FileOpRequest(Request):
    """A filesystem operation in a sandbox, for a client that drives it (the E2B API)."""

    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    handle: SandboxHandle
    action: FileAction
    path: str
    target: str | None = None
    depth: int = Field(1, ge=1, le=64)
    data: bytes | None = Field(None, description="write: the bytes (base64 on the wire).")
    max_bytes: int = Field(0, ge=0)


class FileOpDone(BaseModel):
    kind: Literal["done"] = "done"
    result: FileOpResult


class FileOpReply(
    RootModel[Annotated[FileOpDone | FileRefused | InfraFault, Field(discriminator="kind")]]
):
    """Its result; or the path's problem (the client's); or an infrastructure fault."""


class SignalExec(Request):
    """Signal a running command of a sandbox by its exec id (the E2B API's kill)."""

    handle: SandboxHandle
    exec_id: str
    kill: bool = True


class Signalled(BaseModel):
    kind: Literal["signalled"] = "signalled"
    found: bool = Field(description="False: no such command runs (yet).")


class SignalReply(RootModel[Annotated[Signalled | InfraFault, Field(discriminator="kind")]]):
    """A :class:`SignalExec`'s reply."""


class SendInput(Request):
    """Write to a running command's standard input by its exec id, and close it after with
    ``close`` (the E2B API's ``send_stdin``, ``close_stdin``)."""

    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    handle: SandboxHandle
    exec_id: str
    data: bytes = b""
    close: bool = False
    resize: tuple[int, int] | None = Field(None, description="A terminal's new (rows, cols).")


class InputWritten(BaseModel):
    kind: Literal["written"] = "written"
    found: bool = Field(description="False: no such command runs (yet); nothing written.")


class InputNotTaken(BaseModel):
    """The command has no input to write to (started without, or closed): the caller's."""

    kind: Literal["closed"] = "closed"
    reason: str


class InputSent(
    RootModel[Annotated[InputWritten | InputNotTaken | InfraFault, Field(discriminator="kind")]]
):
    """A :class:`SendInput`'s reply."""


RequestT = TypeVar("RequestT", bound=Request)
ReplyT = TypeVar("ReplyT", bound=BaseModel)


@dataclass(frozen=True)
class Task(Generic[RequestT, ReplyT]):
    """One task of the wire: its name, what the API sends, what the worker replies."""

    name: TaskName
    request: type[RequestT]
    reply: type[ReplyT]


class Tasks:
    """Every task, request and reply paired: the one table both ends are built from. A
    task is sent to one host's queue, or (CHECK_COMMIT, REFILL_POOLS) to the shared
    queue, which any host takes from."""

    CREATE_SANDBOX = Task(TaskName.CREATE_SANDBOX, CreateSandbox, SandboxCreated)
    RUN_OP = Task(TaskName.RUN_OP, RunOp, OpDone)
    EARLIER_TOOL_CALL = Task(TaskName.EARLIER_TOOL_CALL, EarlierToolCall, Nothing)
    PROBE_SANDBOX = Task(TaskName.PROBE_SANDBOX, ProbeSandbox, ProbeResult)
    RUN_TESTS = Task(TaskName.RUN_TESTS, RunTests, RunTestsReply)
    FILE_OP = Task(TaskName.FILE_OP, FileOpRequest, FileOpReply)
    SIGNAL_EXEC = Task(TaskName.SIGNAL_EXEC, SignalExec, SignalReply)
    SEND_INPUT = Task(TaskName.SEND_INPUT, SendInput, InputSent)
    DESTROY_SANDBOX = Task(TaskName.DESTROY_SANDBOX, DestroySandbox, SandboxDestroyed)
    RECYCLE_SANDBOX = Task(TaskName.RECYCLE_SANDBOX, RecycleSandbox, Accepted)
    SWEEP_HOST = Task(TaskName.SWEEP_HOST, Nothing, Nothing)
    REFILL_POOLS = Task(TaskName.REFILL_POOLS, Nothing, Nothing)
    CHECK_COMMIT = Task(TaskName.CHECK_COMMIT, CheckCommit, CommitChecked)
    SNAPSHOT_SANDBOX = Task(TaskName.SNAPSHOT_SANDBOX, SnapshotSandbox, SnapshotMade)
    MEASURE_SANDBOX = Task(TaskName.MEASURE_SANDBOX, MeasureSandbox, SandboxMeasured)
    DROP_SNAPSHOT = Task(TaskName.DROP_SNAPSHOT, DropSnapshot, SnapshotDropped)
