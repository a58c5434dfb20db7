"""Custom tools: one fixed program per tool, the model's arguments placed into its argv.

A :class:`CommandTool` is built from a :class:`~orchestrator.environments.models.CustomToolConfig`.
Each call:

1. decodes the arguments (a JSON string or an object) and validates them with jsonschema
   against the tool's ``parameters``; a bad call is an ``agent_error`` whose message names
   each bad field, and the backend is never called;
2. renders the argv (see :class:`~orchestrator.environments.models.CustomToolConfig` for the
   placeholder rules) - a list handed to the backend, which runs it with no shell parsing,
   so ``$(id)``, ``; rm -rf /`` or a newline in an argument are only ever data;
3. runs it in the sandbox (an :class:`~orchestrator.sandbox.backend.ExecOp`) and formats
   the result exactly like ``shell`` does
   (:func:`~orchestrator.tools.shell.format_exec_result`), except that a timeout's status
   line does not suggest a ``timeout_s`` argument the tool does not have.
"""

from __future__ import annotations

import copy
import difflib
import json
from collections.abc import Sequence
from typing import Any

from jsonschema import ValidationError
from jsonschema.protocols import Validator
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict

from orchestrator.config import Settings
from orchestrator.environments.models import (
    WORKSPACE,
    CustomToolConfig,
    HttpToolConfig,
    Placeholder,
    parse_template,
)
from orchestrator.sandbox.backend import ExecOp, OpResult
from orchestrator.tools.base import (
    JSON_TYPE_NAMES,
    MAX_LISTED_ERRORS,
    ArgsT,
    InvalidArguments,
    Tool,
    ToolResult,
    clean_schema,
    decode_arguments,
    exec_result,
)
from orchestrator.tools.shell import format_exec_result

MAX_ELEMENT_BYTES = 64 * 1024
"""Longest single argv element (Linux refuses more than 128 KiB per argument)."""
MAX_ARGV_BYTES = 512 * 1024
"""Longest argv in total, well under the kernel's limit with the environment."""
MAX_SHOWN_VALUE = 60
MAX_ERROR_CHARS = 200


class CommandArgs(BaseModel):
    """A validated call: the arguments as given and the argv they render to."""

    model_config = ConfigDict(frozen=True)

    values: dict[str, Any]
    argv: list[str]


def render_value(value: Any) -> str:
    """One argument as argv text: strings as is, ``true``/``false``, whole floats without
    ``.0`` (so ``5.0`` works where a program wants an integer), objects/arrays as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 2**53:
            return str(int(value))
        return repr(value)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _json_type(value: Any) -> str:
    return JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= MAX_SHOWN_VALUE else text[: MAX_SHOWN_VALUE - 3] + "..."


def _type_phrase(schema: Any) -> str:
    """``string``, ``integer or null``, ``one of "a", "b"``: a property's type for people."""
    if not isinstance(schema, dict):
        return "value"
    if "enum" in schema and isinstance(schema["enum"], list):
        return "one of " + ", ".join(_short(v) for v in schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return " or ".join(str(k) for k in kind)
    if kind == "array":
        return f"array of {_type_phrase(schema.get('items'))}"
    return str(kind) if kind else "value"


class SchemaTool(Tool[ArgsT]):
    """A configured tool whose arguments a JSON Schema (its ``parameters``) validates: a
    custom tool (:class:`CommandTool`) or an HTTP tool (environments/http_tool.py)."""

    def __init__(self, config: CustomToolConfig | HttpToolConfig) -> None:
        """Build the tool from a validated definition (its schema was checked then)."""
        self.config = config
        # The base class declares name/description/usage as class variables because the
        # built-in tools are one class each; here one class serves every custom tool, so the
        # values live on the instance, where attribute lookup finds them first.
        setattr(self, "name", config.name)  # noqa: B010
        setattr(self, "description", config.description)  # noqa: B010
        setattr(self, "usage", self._usage())  # noqa: B010
        self._schema = self._enforced_schema(config.parameters)
        self._validator: Validator = validator_for(self._schema)(self._schema)
        props = self._schema.get("properties", {})
        self._properties: dict[str, Any] = props if isinstance(props, dict) else {}
        required = self._schema.get("required", [])
        self._required: set[str] = set(required) if isinstance(required, list) else set()

    @staticmethod
    def _enforced_schema(parameters: dict[str, Any]) -> dict[str, Any]:
        # Unknown arguments are refused unless the author allowed them on purpose: a typo in
        # an optional argument's name would otherwise be silently ignored.
        schema = copy.deepcopy(parameters)
        schema.setdefault("additionalProperties", False)
        return schema

    def _usage(self) -> str:
        props: dict[str, Any] = self.config.parameters.get("properties", {})
        required = set(self.config.parameters.get("required", []))
        fields = [
            f'"{name}"{"" if name in required else "?"}: {_type_phrase(prop)}'
            for name, prop in props.items()
        ]
        return f"{self.config.name} {{{', '.join(fields)}}}"

    # -- parsing ------------------------------------------------------------------------------

    def validated(self, arguments: dict[str, Any] | str | None) -> dict[str, Any]:
        """The arguments, validated against the tool's schema.

        Raises :class:`InvalidArguments` with one line per problem, naming the field. A null
        for an optional argument means "not given" (strict function calling sends null for
        every optional argument left out).
        """
        try:
            data = decode_arguments(arguments)
        except InvalidArguments as exc:
            # The generic hint shows shell's arguments; this tool's usage line says it better.
            message = exc.message.split("; send a JSON object such as")[0]
            raise InvalidArguments(f"{message}\nusage: {self.usage}") from None
        data = {k: v for k, v in data.items() if v is not None or k in self._required}
        errors = sorted(
            self._validator.iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path]
        )
        if errors:
            lines = [line for error in errors for line in self._describe(error)]
            shown = lines[:MAX_LISTED_ERRORS]
            if len(lines) > MAX_LISTED_ERRORS:
                shown.append(f"... and {len(lines) - MAX_LISTED_ERRORS} more")
            raise InvalidArguments(self._condense(shown))
        return data

    def _condense(self, problems: Sequence[str]) -> str:
        body = "\n".join(f"- {p}" for p in problems)
        return f"invalid arguments for {self.name}:\n{body}\nusage: {self.usage}"

    def _describe(self, error: ValidationError) -> list[str]:
        path = ".".join(str(p) for p in error.absolute_path)
        prefix = f"{path}." if path else ""
        loc = path or "arguments"
        instance = error.instance
        required = error.validator_value
        if error.validator == "required" and isinstance(instance, dict):
            names = required if isinstance(required, list) else []
            missing = [n for n in names if n not in instance]
            return [f"{prefix}{n}: required argument is missing" for n in missing]
        if error.validator == "additionalProperties" and isinstance(instance, dict):
            allowed = (
                list(error.schema.get("properties", {})) if isinstance(error.schema, dict) else []
            )
            lines = []
            for extra in (k for k in instance if k not in allowed):
                close = difflib.get_close_matches(extra, allowed, n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
                listed = ", ".join(allowed) or "none"
                lines.append(f"{prefix}{extra}: unknown argument (allowed: {listed}){hint}")
            if lines:
                return lines
        if error.validator == "type":
            return [
                f"{loc}: expected {_type_phrase(error.schema)}, "
                f"got {_json_type(instance)} {_short(instance)}"
            ]
        if error.validator == "enum":
            return [f"{loc}: expected {_type_phrase(error.schema)}, got {_short(instance)}"]
        message = error.message
        if len(message) > MAX_ERROR_CHARS:
            message = message[: MAX_ERROR_CHARS - 3] + "..."
        return [f"{loc}: {message}"]

    # -- schema ---------------------------------------------------------------------------------

    def parameters_schema(self, settings: Settings, *, strict: bool = False) -> dict[str, Any]:
        """The arguments' JSON Schema as configured (unknown arguments refused unless the
        author allowed them). With ``strict``, OpenAI's strict shape for a flat object:
        every property required, optional ones nullable (null means "not given")."""
        if not strict:
            return copy.deepcopy(self._schema)
        wrapped: dict[str, Any] = {"properties": {}, "required": sorted(self._required)}
        for name, prop in self._properties.items():
            prop = copy.deepcopy(prop) if isinstance(prop, dict) else {}
            if name not in self._required:
                # clean_schema reads pydantic's shape for optional fields: anyOf [T, null].
                description = prop.pop("description", None)
                prop = {"anyOf": [prop, {"type": "null"}]}
                if description is not None:
                    prop["description"] = description
            wrapped["properties"][name] = prop
        schema = clean_schema(wrapped, strict=True)
        for name, prop in self._properties.items():
            # Strict mode keeps array item schemas; clean_schema's keyword list predates arrays.
            if isinstance(prop, dict) and "items" in prop:
                schema["properties"][name]["items"] = copy.deepcopy(prop["items"])
        return schema


class CommandTool(SchemaTool[CommandArgs]):
    """A custom tool: runs its configured argv with the call's arguments filled in."""

    args_model = CommandArgs
    config: CustomToolConfig

    def __init__(self, config: CustomToolConfig) -> None:
        super().__init__(config)
        self._templates = [parse_template(element) for element in config.argv]

    def parse(self, arguments: dict[str, Any] | str | None, settings: Settings) -> CommandArgs:
        """Validate the arguments (:meth:`validated`) and render the argv."""
        data = self.validated(arguments)
        return CommandArgs(values=data, argv=self.render_argv(data))

    def _value(self, values: dict[str, Any], param: str) -> Any:
        if param in values:
            return values[param]
        prop = self._properties.get(param)
        return prop.get("default") if isinstance(prop, dict) else None

    def render_argv(self, values: dict[str, Any]) -> list[str]:
        """The argv for validated ``values``. Raises :class:`InvalidArguments` for values no
        argv can carry (NUL characters, oversized arguments)."""
        argv: list[str] = []
        problems: list[str] = []
        for parts in self._templates:
            rendered = self._render_element(parts, values, problems)
            argv.extend(rendered)
        total = sum(len(element.encode()) + 1 for element in argv)
        if not problems and total > MAX_ARGV_BYTES:
            problems.append(
                f"arguments: too long in total ({total:,} bytes; at most {MAX_ARGV_BYTES:,})"
            )
        if problems:
            raise InvalidArguments(self._condense(problems))
        return argv

    def _render_element(
        self, parts: list[str | Placeholder], values: dict[str, Any], problems: list[str]
    ) -> list[str]:
        if len(parts) == 1 and isinstance(parts[0], Placeholder) and parts[0].spread:
            param = parts[0].param
            value = self._value(values, param)
            if value is None:
                return []
            items = value if isinstance(value, list) else [value]
            texts = [render_value(item) for item in items if item is not None]
            return [t for t in texts if self._fits(param, t, problems)]
        pieces: list[str] = []
        for part in parts:
            if isinstance(part, str):
                pieces.append(part)
                continue
            value = self._value(values, part.param)
            if value is None:
                # An absent optional argument drops its whole element (e.g. "--glob={glob}").
                return []
            text = render_value(value)
            if not self._fits(part.param, text, problems):
                return []
            pieces.append(text)
        return ["".join(pieces)]

    @staticmethod
    def _fits(param: str, text: str, problems: list[str]) -> bool:
        # A NUL cannot be passed in argv: the sandbox's exec would fail and the failure
        # would look like ours rather than the agent's.
        if "\x00" in text:
            problems.append(f"{param}: must not contain NUL characters")
            return False
        size = len(text.encode())
        if size > MAX_ELEMENT_BYTES:
            problems.append(f"{param}: too long ({size:,} bytes; at most {MAX_ELEMENT_BYTES:,})")
            return False
        return True

    # -- running ------------------------------------------------------------------------------

    def timeout_s(self, settings: Settings) -> float:
        """The tool's timeout: its own, or the deployment's default, never above the maximum."""
        timeout = (
            self.config.timeout_s
            if self.config.timeout_s is not None
            else settings.command_timeout_s
        )
        return min(timeout, settings.command_timeout_max_s)

    def command_timeout_s(self, args: CommandArgs, settings: Settings) -> float:
        return self.timeout_s(settings)

    def operation(self, args: CommandArgs, settings: Settings) -> ExecOp:
        """Its rendered argv, run in the sandbox."""
        return ExecOp(
            command=args.argv,
            timeout_s=self.timeout_s(settings),
            output_budget_bytes=settings.output_budget_bytes,
            cwd=self.config.cwd or WORKSPACE,
        )

    def shape(self, args: CommandArgs, settings: Settings, ran: OpResult) -> ToolResult:
        """Shaped like ``shell``'s output."""
        # shell's advice is to raise timeout_s, which this tool does not take.
        return format_exec_result(
            exec_result(ran),
            self.timeout_s(settings),
            settings,
            timeout=(self.name, "Try narrower arguments."),
        )
