"""What every tool is: a name, an argument model, a JSON Schema and a ``run`` method.

Tools turn one call of the model into one sandbox operation (:class:`ExecOp`,
:class:`ReadOp`: decided by the API, run by the worker of the sandbox's host, which knows no
tools) and what it did back into text for the model. They know nothing of HTTP or of which
backend runs them. Their contract on errors:

- The agent's mistakes (bad arguments, a file that does not exist, a command that hit one
  of the sandbox's limits: time, memory, processes, disk, output) come back as a
  :class:`ToolResult` with outcome ``agent_error`` and an output that says what went wrong,
  so the model can learn from it.
- Infrastructure faults (:class:`~orchestrator.sandbox.backend.SandboxError` and its
  subclasses) are never caught here: they propagate to the caller, which classifies them as
  ``infra_error``. Catching them would risk scoring a broken machine as the agent's fault.
"""

from __future__ import annotations

import copy
import difflib
import json
import time
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import ErrorDetails

from orchestrator.config import Settings
from orchestrator.outcomes import Outcome
from orchestrator.sandbox.backend import (
    ExecOp,
    ExecRan,
    ExecResult,
    OpResult,
    ReadOp,
    SandboxBackend,
    SandboxHandle,
)
from orchestrator.tools.shaping import fit

ArgsT = TypeVar("ArgsT", bound=BaseModel)

# Condensed error lists stay short: the model needs the first few problems, not a dump.
MAX_LISTED_ERRORS = 8
MAX_INPUT_REPR = 60


class ToolResult(BaseModel):
    """What one tool call produced, ready to hand to the model as ``output``."""

    model_config = ConfigDict(frozen=True)

    output: str = Field(description="Text for the model; at most the output budget in bytes.")
    outcome: Outcome
    exit_code: int | None = Field(None, description="The command's exit status (shell only).")
    truncated: bool = Field(False, description="Some of the output was cut to fit the budget.")
    duration_ms: float = Field(0.0, ge=0, description="Wall time of the call in the tool layer.")
    error_kind: str | None = Field(
        None,
        description="Why the call was an agent_error: invalid_arguments, unknown_tool, a "
        "sandbox limit the command hit (timeout, memory_limit, pids_limit, disk_limit, "
        "output_limit), out_of_range, or a read_file error kind (not_found, is_directory, "
        "binary, ..., pids_limit).",
    )


class InvalidArguments(Exception):
    """The call's arguments cannot be used; ``message`` is written for the model."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def agent_error(
    message: str, kind: str, *, started: float | None = None, budget: int | None = None
) -> ToolResult:
    """An ``agent_error`` result whose output is ``message`` (cut to ``budget`` if given)."""
    output = fit(message, budget) if budget is not None else message
    return ToolResult(
        output=output,
        outcome=Outcome.AGENT_ERROR,
        truncated=output != message,
        duration_ms=elapsed_ms(started),
        error_kind=kind,
    )


def within_budget(result: ToolResult, budget: int | None) -> ToolResult:
    """``result`` with its output cut to ``budget`` bytes (head and tail kept, marked
    truncated); as it is when it fits or there is no budget."""
    if budget is None or len(result.output.encode()) <= budget:
        return result
    return result.model_copy(update={"output": fit(result.output, budget), "truncated": True})


def sandbox_killed(cause: str, detail: str, budget: int | None) -> ToolResult:
    """The result of a call during which the agent's own doing took its whole sandbox down
    (gVisor ends the sandbox at its memory limit): the agent's mistake, named ``cause``."""
    message = (
        f"the sandbox was killed ({cause.replace('_', ' ')}: {detail}); "
        "it cannot run commands any more in this rollout"
    )
    return agent_error(message, cause, budget=budget)


def exec_result(ran: OpResult) -> ExecResult:
    """What an :class:`ExecOp` ran, from its result (another is our bug)."""
    if not isinstance(ran, ExecRan):
        raise TypeError(f"an exec operation came back as {ran.kind!r}")
    return ran.result


def elapsed_ms(started: float | None) -> float:
    """Milliseconds since ``started`` (a :func:`time.perf_counter` reading); 0 for None."""
    return 0.0 if started is None else (time.perf_counter() - started) * 1000


def _short_repr(value: object) -> str:
    text = json.dumps(value, default=repr) if not isinstance(value, str) else json.dumps(value)
    if len(text) > MAX_INPUT_REPR:
        text = text[: MAX_INPUT_REPR - 3] + "..."
    return text


JSON_TYPE_NAMES = {
    # Python type of a parsed JSON value -> its JSON Schema name, for error messages.
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
    type(None): "null",
}


def _describe_error(error: ErrorDetails, allowed: list[str]) -> str:
    loc = ".".join(str(part) for part in error["loc"]) or "arguments"
    kind = error["type"]
    if kind == "missing":
        return f"{loc}: required argument is missing"
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(str(error["loc"][-1]), allowed, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"{loc}: unknown argument (allowed: {', '.join(allowed)}){hint}"
    msg = error["msg"]
    # pydantic's own wording ("Value error, ...") is noise for a model.
    msg = msg.removeprefix("Value error, ")
    value = error.get("input")
    if kind.endswith("_type"):
        got = JSON_TYPE_NAMES.get(type(value), type(value).__name__)
        return f"{loc}: {msg[:1].lower()}{msg[1:]}, got {got} {_short_repr(value)}"
    return f"{loc}: {msg[:1].lower()}{msg[1:]}"


def condense_errors(tool: str, usage: str, exc: ValidationError, allowed: list[str]) -> str:
    """One model-readable message from a pydantic error: one line per problem, then usage."""
    errors = exc.errors(include_url=False)
    lines = [f"invalid arguments for {tool}:"]
    lines += [f"- {_describe_error(e, allowed)}" for e in errors[:MAX_LISTED_ERRORS]]
    if len(errors) > MAX_LISTED_ERRORS:
        lines.append(f"- ... and {len(errors) - MAX_LISTED_ERRORS} more")
    lines.append(f"usage: {usage}")
    return "\n".join(lines)


def decode_arguments(arguments: dict[str, Any] | str | None) -> dict[str, Any]:
    """The arguments as a dict: they arrive as a JSON-encoded string or as an object.

    An empty string or None means no arguments (some clients send that for tools without
    any), so the model then hears which arguments are missing rather than "invalid JSON".
    """
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise InvalidArguments(
                f"arguments are not valid JSON ({exc.msg} at line {exc.lineno} column "
                f'{exc.colno}); send a JSON object such as {{"command": "ls"}}'
            ) from None
        except RecursionError:
            raise InvalidArguments("arguments are not valid JSON (nested too deeply)") from None
    if not isinstance(arguments, dict):
        got = JSON_TYPE_NAMES.get(type(arguments), type(arguments).__name__)
        raise InvalidArguments(f"arguments must be a JSON object, got {got}")
    return arguments


class Tool(ABC, Generic[ArgsT]):
    """One tool the model can call.

    Subclasses set :attr:`name`, :attr:`description`, :attr:`args_model` and :attr:`usage`
    and implement :meth:`operation` and :meth:`shape`; :meth:`parse` checks the arguments,
    :meth:`result` keeps the error contract and the output budget.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    args_model: ClassVar[type[BaseModel]]
    usage: ClassVar[str]
    """A one-line signature shown to the model with argument errors."""

    def parse(self, arguments: dict[str, Any] | str | None, settings: Settings) -> ArgsT:
        """Validate the arguments; raises :class:`InvalidArguments` with a readable message.

        ``settings`` reaches validators as the validation context (limits such as the
        maximum timeout are deployment settings, not constants).
        """
        try:
            data = decode_arguments(arguments)
        except InvalidArguments as exc:
            raise InvalidArguments(f"{exc.message}\nusage: {self.usage}") from None
        try:
            parsed = self.args_model.model_validate(data, context={"settings": settings})
        except ValidationError as exc:
            allowed = list(self.args_model.model_fields)
            raise InvalidArguments(condense_errors(self.name, self.usage, exc, allowed)) from None
        return parsed  # type: ignore[return-value]

    def run(
        self,
        backend: SandboxBackend,
        handle: SandboxHandle,
        arguments: dict[str, Any] | str | None,
        settings: Settings,
    ) -> ToolResult:
        """Run one call here, with ``backend`` (the CLI's smoke test; a rollout's call is
        split: its API decides and shapes, its host's worker runs :meth:`operation`).
        Agent mistakes come back as ``agent_error`` results, and then the backend is never
        called for bad arguments; :class:`SandboxError` propagates."""
        started = time.perf_counter()
        try:
            args = self.parse(arguments, settings)
        except InvalidArguments as exc:
            return agent_error(
                exc.message,
                "invalid_arguments",
                started=started,
                budget=self.fitted_budget(settings),
            )
        ran = backend.run_op(handle, self.operation(args, settings))
        return self.result(args, settings, ran, duration_ms=elapsed_ms(started))

    def fitted_budget(self, settings: Settings) -> int | None:
        """The bytes a result's output is cut to: the model's output budget (None: not cut,
        a client's tool whose operation bounds it)."""
        return settings.output_budget_bytes

    def result(
        self, args: ArgsT, settings: Settings, ran: OpResult, *, duration_ms: float = 0.0
    ) -> ToolResult:
        """What the model is given for what :meth:`operation` did: :meth:`shape`'s result,
        whatever it made, within the output budget, lasting ``duration_ms``."""
        fitted = within_budget(self.shape(args, settings, ran), self.fitted_budget(settings))
        return fitted.model_copy(update={"duration_ms": duration_ms})

    @abstractmethod
    def operation(self, args: ArgsT, settings: Settings) -> ExecOp | ReadOp:
        """What validated arguments ask of the sandbox: one operation, with its limits."""

    @abstractmethod
    def shape(self, args: ArgsT, settings: Settings, ran: OpResult) -> ToolResult:
        """The call's result, from what its :meth:`operation` did."""

    def command_timeout_s(self, args: ArgsT, settings: Settings) -> float:
        """The longest the work of a call with ``args`` may take in the sandbox: what the
        call's time bound is made of (rollouts/bounds.py)."""
        return settings.command_timeout_s

    def parameters_schema(self, settings: Settings, *, strict: bool = False) -> dict[str, Any]:
        """The JSON Schema of the arguments, clean for a model to read.

        No pydantic titles, optional fields shown as their plain type (``null`` is accepted
        but not advertised), ``additionalProperties: false``. With ``strict``, the shape
        OpenAI's strict function calling requires: every property listed as required,
        optional ones nullable, and only the keywords strict mode supports (the server
        still enforces every constraint).
        """
        schema = self.args_model.model_json_schema()
        return clean_schema(schema, strict=strict)


# Keywords kept in strict mode: what OpenAI's strict structured outputs accept.
_STRICT_KEYWORDS = {
    "type",
    "description",
    "properties",
    "required",
    "additionalProperties",
    "enum",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
}


def clean_schema(schema: dict[str, Any], *, strict: bool = False) -> dict[str, Any]:
    """Strip pydantic's noise from a flat object schema (see :meth:`Tool.parameters_schema`)."""
    # The model class's docstring is not copied: the function's description says it all.
    out: dict[str, Any] = {"type": "object"}
    required = set(schema.get("required", []))
    props: dict[str, Any] = {}
    for name, prop in schema.get("properties", {}).items():
        prop = copy.deepcopy(prop)
        nullable = False
        if "anyOf" in prop:
            variants = [v for v in prop.pop("anyOf") if v.get("type") != "null"]
            nullable = len(variants) < 2 and name not in required
            if len(variants) == 1:
                prop.update(variants[0])
            else:
                prop["anyOf"] = variants
        prop.pop("title", None)
        if prop.get("default", ...) is None:
            prop.pop("default")
        if strict:
            prop = {k: v for k, v in prop.items() if k in _STRICT_KEYWORDS}
            if nullable and "type" in prop:
                prop["type"] = [prop["type"], "null"]
        props[name] = prop
    out["properties"] = props
    out["required"] = list(props) if strict else [n for n in props if n in required]
    out["additionalProperties"] = False
    return out
