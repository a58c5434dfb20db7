"""The shape of an environment: what a rollout's sandbox runs, which tools the model gets,
how it is graded and how long its sandbox may live.

An environment takes its codebase in one of three ways (exactly one applies):

- ``image``: a fixed image reference, run as is (no codebase name);
- ``codebase``: a fixed codebase name, resolved to its image when a rollout starts;
- neither (the default style): the dataset row's ``codebase`` field names the codebase.

Fields left out (``runtime``, ``limits.*``, ``output_budget_bytes``, ``max_lifetime_s``) take
the deployment's settings when a rollout is resolved, so one YAML file serves deployments
with different defaults.

Custom tools run one fixed program with the model's arguments placed into its argv (see
:class:`CustomToolConfig` for the placeholder syntax). No shell ever parses them.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
import string
from collections.abc import Mapping
from enum import StrEnum
from functools import cached_property
from typing import Annotated, Any

from jsonschema import SchemaError
from jsonschema.validators import validator_for
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from orchestrator.config import Runtime, Settings
from orchestrator.images.codebases import validate_name
from orchestrator.sandbox.backend import SandboxLimits, ScratchDirs
from orchestrator.sandbox.egress import EgressPolicy
from orchestrator.secrets import SecretSource
from orchestrator.tools.registry import TOOLS

TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
"""What a tool name may look like (OpenAI's rule for function names)."""

ENVIRONMENT_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"
"""What an environment name may look like (the same alphabet as codebase names)."""

PARAM_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
"""A placeholder's parameter name: an identifier, so ``{a.b}`` or ``{a[0]}`` never parse."""

SPREAD_SUFFIX = "..."
"""``{files...}`` as a whole argv element expands an array argument into one element each."""

MAX_ARGV_ELEMENTS = 256
WORKSPACE = "/workspace"


class Placeholder(BaseModel):
    """One ``{param}`` (or ``{param...}``) found in an argv element."""

    model_config = ConfigDict(frozen=True)

    param: str
    spread: bool = False


def parse_template(element: str) -> list[str | Placeholder]:
    """Split one argv element into literal text and placeholders.

    ``{{`` and ``}}`` are literal braces, as in :meth:`str.format`. A placeholder is
    ``{name}`` with ``name`` an identifier, or ``{name...}`` (spread); conversions
    (``{x!r}``), format specs (``{x:>5}``), attribute and index access are refused so that a
    template can only ever insert the argument's text. Raises ValueError on anything else.
    """
    parts: list[str | Placeholder] = []
    try:
        parsed = list(string.Formatter().parse(element))
    except ValueError as exc:
        raise ValueError(f"bad placeholder syntax in {element!r}: {exc}") from None
    for literal, field, spec, conversion in parsed:
        if literal:
            parts.append(literal)
        if field is None:
            continue
        if spec or conversion:
            raise ValueError(
                f"placeholder {{{field}}} in {element!r}: format specs and conversions "
                "(':...', '!r') are not supported; write {name} only"
            )
        spread = field.endswith(SPREAD_SUFFIX)
        name = field.removesuffix(SPREAD_SUFFIX) if spread else field
        if not PARAM_NAME_RE.fullmatch(name):
            raise ValueError(
                f"placeholder {{{field}}} in {element!r}: a placeholder is {{name}} or "
                "{name...} with name a parameter (letters, digits, '_'); write {{ and }} "
                "for literal braces"
            )
        parts.append(Placeholder(param=name, spread=spread))
    return parts


def check_parameters(value: dict[str, Any]) -> dict[str, Any]:
    """A tool's ``parameters``: a valid JSON Schema of an object whose properties are
    identifiers."""
    validator_cls = validator_for(value)
    try:
        validator_cls.check_schema(value)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise ValueError(f"not a valid JSON Schema at {where}: {exc.message}") from None
    if value.get("type") != "object":
        raise ValueError('must be an object schema ("type": "object"): arguments are a JSON object')
    properties = value.get("properties", {})
    if not isinstance(properties, dict):
        raise ValueError("properties must be a mapping")
    for name in properties:
        if not PARAM_NAME_RE.fullmatch(name):
            raise ValueError(
                f"property {name!r}: parameter names must be identifiers "
                "(letters, digits, '_', not starting with a digit)"
            )
    return value


class ConfiguredTool(BaseModel):
    """What every configured tool has: the name the model calls, what it is told the tool
    does, and the JSON Schema its arguments are validated against."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN, description="Tool name the model calls.")
    description: str = Field(
        min_length=1, max_length=4096, description="What the tool does, shown to the model."
    )
    parameters: dict[str, Any] = Field(
        description="JSON Schema of the arguments: an object schema. Properties without "
        "additionalProperties set refuse unknown arguments."
    )

    @field_validator("name")
    @classmethod
    def _not_a_builtin(cls, value: str) -> str:
        # A configured tool named like a built-in would make `tools: [shell]` ambiguous.
        if value in TOOLS:
            raise ValueError(f"{value!r} is a built-in tool's name; choose another name")
        return value

    @field_validator("parameters")
    @classmethod
    def _valid_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_parameters(value)


class CustomToolConfig(ConfiguredTool):
    """A tool that runs one fixed program, arguments placed into its argv.

    ``argv`` elements are templates: an element that is exactly ``{param}`` becomes the
    argument's value as ONE argv element, whatever it contains (spaces, quotes, ``$(...)``,
    a leading ``-``); ``{param}`` inside a longer element (``--max-count={n}``) is replaced in
    that element only. ``{param...}`` as a whole element expands an array argument into one
    element per item. ``{{``/``}}`` are literal braces. Values are rendered as text: strings
    as is, ``true``/``false``, integers in decimal, floats without a trailing ``.0`` when
    whole, objects and arrays (outside a spread) as compact JSON.

    An element whose placeholder's argument is absent (and has no ``default`` in its
    schema) or null is left out, so optional flags work: ``["--glob={glob}"]`` disappears
    when ``glob`` is not given. The first element must be literal: the model never chooses
    the program. Put ``--`` before free-text arguments so a value like ``-n`` or ``--help``
    is read as data, not as an option.
    """

    argv: list[str] = Field(
        min_length=1,
        max_length=MAX_ARGV_ELEMENTS,
        description="Command to run; each {placeholder} becomes one whole argument.",
    )
    timeout_s: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="None: the deployment's default."
    )
    cwd: str | None = Field(
        None, description="Working directory; relative paths are under /workspace."
    )

    @field_validator("argv")
    @classmethod
    def _argv_parses(cls, value: list[str]) -> list[str]:
        for index, element in enumerate(value):
            if "\x00" in element:
                raise ValueError(f"element {index} contains a NUL character")
            parts = parse_template(element)
            if index == 0 and any(isinstance(p, Placeholder) for p in parts):
                raise ValueError("the program (element 0) must be literal, not a placeholder")
            spreads = [p for p in parts if isinstance(p, Placeholder) and p.spread]
            if spreads and len(parts) != 1:
                raise ValueError(
                    f"element {index} ({element!r}): {{name...}} must be the whole element"
                )
        return value

    @field_validator("cwd")
    @classmethod
    def _cwd_is_a_path(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value or "\x00" in value:
            raise ValueError("must be a non-empty path without NUL characters")
        return posixpath.normpath(posixpath.join(WORKSPACE, value))

    @model_validator(mode="after")
    def _placeholders_are_declared(self) -> CustomToolConfig:
        properties: dict[str, Any] = self.parameters.get("properties", {})
        for element in self.argv:
            for part in parse_template(element):
                if not isinstance(part, Placeholder):
                    continue
                if part.param not in properties:
                    declared = ", ".join(properties) or "none"
                    raise ValueError(
                        f"argv element {element!r} uses {{{part.param}}}, which is not a "
                        f"property of parameters (declared: {declared})"
                    )
                prop = properties[part.param]
                if part.spread and isinstance(prop, dict) and prop.get("type") != "array":
                    raise ValueError(
                        f"argv element {element!r}: {{{part.param}...}} needs an array "
                        f'parameter ("type": "array")'
                    )
        return self

    def placeholders(self) -> set[str]:
        """Names of the parameters the argv uses."""
        return {
            part.param
            for element in self.argv
            for part in parse_template(element)
            if isinstance(part, Placeholder)
        }


ENV_VAR_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
SECRET_REF = re.compile(r"\{secret:([A-Za-z_][A-Za-z0-9_]{0,63})\}")
"""``{secret:NAME}`` in an HTTP tool's header: the environment's secret NAME."""


class HttpToolConfig(ConfiguredTool):
    """A tool that forwards the call to the operator's own HTTP service, outside the
    sandbox (docs/tenancy.md, "HTTP tools"): the validated arguments are POSTed as a JSON
    object to ``url``. A 2xx answer's body is the model's output (cut to
    ``max_response_bytes``, then to the output budget); a 4xx about what the agent asked
    (400, 404, 422, ...) is its mistake, shown to it and scored; any other answer (401,
    403, 429, a 5xx), a timeout or a connection error is ours: the rollout fails (503,
    never scored), with the status and the time taken as evidence."""

    url: str = Field(
        pattern=r"^https?://[^\s]+$", description="Where the call goes: http:// or https://."
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="Request headers; `{secret:NAME}` in a value is the environment's "
        "secret NAME, which no trajectory, log, export or error ever shows.",
    )
    timeout_s: float = Field(
        10.0, gt=0, le=300, allow_inf_nan=False, description="The whole request's bound."
    )
    max_response_bytes: int = Field(
        64 * 1024, ge=256, le=16 << 20, description="Bytes of the answer read at most."
    )

    def secrets_named(self) -> set[str]:
        """The environment secrets its headers use."""
        return {m.group(1) for v in self.headers.values() for m in SECRET_REF.finditer(v)}


def _tool_kind(value: Any) -> str:
    # A plain string names a built-in; a mapping defines a custom tool (argv) or an HTTP
    # tool (url). Tagging by shape gives one clear error per entry instead of one per
    # union member.
    if isinstance(value, str):
        return "builtin"
    if isinstance(value, HttpToolConfig) or (isinstance(value, dict) and "url" in value):
        return "http"
    return "custom"


def _builtin_name(value: str) -> str:
    if value not in TOOLS:
        raise ValueError(
            f"unknown built-in tool {value!r} (built-ins: {', '.join(TOOLS)}); a custom tool "
            "is a mapping with name, description, parameters and argv"
        )
    return value


ToolEntry = Annotated[
    Annotated[str, AfterValidator(_builtin_name), Tag("builtin")]
    | Annotated[CustomToolConfig, Tag("custom")]
    | Annotated[HttpToolConfig, Tag("http")],
    Discriminator(_tool_kind),
]
"""One entry of ``tools``: a built-in tool's name, a custom tool or an HTTP tool."""


class EnvironmentLimits(BaseModel):
    """Sandbox limits; each one left out takes the deployment's setting."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_mb: int | None = Field(None, ge=64, description="Memory limit, in MB.")
    cpus: float | None = Field(None, gt=0, allow_inf_nan=False, description="CPU limit.")
    pids: int | None = Field(None, ge=16, description="Process limit.")
    tmp_mb: int | None = Field(None, ge=1, description="Size of /tmp, in MB.")
    disk_mb: int | None = Field(None, ge=0, description="/workspace writes; 0 = uncapped.")
    output_mb: int | None = Field(None, ge=1, description="A command printing more is killed.")

    def resolve(self, settings: Settings) -> SandboxLimits:
        """The limits to create a sandbox with."""
        return SandboxLimits(
            memory_mb=self.memory_mb if self.memory_mb is not None else settings.sandbox_memory_mb,
            cpus=self.cpus if self.cpus is not None else settings.sandbox_cpus,
            pids=self.pids if self.pids is not None else settings.sandbox_pids,
            tmp_mb=self.tmp_mb if self.tmp_mb is not None else settings.sandbox_tmp_mb,
            disk_mb=self.disk_mb if self.disk_mb is not None else settings.sandbox_disk_mb,
            output_mb=self.output_mb if self.output_mb is not None else settings.sandbox_output_mb,
        )


class PromptTemplate(BaseModel):
    """How a dataset row becomes the conversation an Agent RFT row must carry
    (``messages``, the last one from the user): ``orchestrator rft-config --dataset``
    renders it for rows that have none. ``{field}`` is the row's field of that name (an
    identifier; a list or an object is inserted as compact JSON); ``{{``/``}}`` are literal
    braces."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    developer: str | None = Field(
        None, min_length=1, description="The instructions, as a developer message (optional)."
    )
    user: str = Field(min_length=1, description="The task, as the user message.")

    @field_validator("developer", "user")
    @classmethod
    def _placeholders_are_fields(cls, value: str | None) -> str | None:
        if value is not None:
            prompt_fields(value)
        return value

    def fields(self) -> set[str]:
        """The row fields the template uses."""
        return {f for text in (self.developer, self.user) if text for f in prompt_fields(text)}

    def render(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        """The row's ``messages``. KeyError naming a field the row lacks."""
        values = {name: _as_text(row[name]) for name in sorted(self.fields())}
        messages = []
        if self.developer:
            messages.append({"role": "developer", "content": self.developer.format(**values)})
        messages.append({"role": "user", "content": self.user.format(**values)})
        return messages


def prompt_fields(template: str) -> set[str]:
    """The ``{field}`` names of a prompt template; ValueError on anything but plain names."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"bad placeholder syntax: {exc}") from None
    names = set()
    for _, field, spec, conversion in parsed:
        if field is None:
            continue
        if spec or conversion or not PARAM_NAME_RE.fullmatch(field):
            raise ValueError(
                f"placeholder {{{field}}}: a placeholder is {{name}}, name a field of the row "
                "(letters, digits, '_'); write {{ and }} for literal braces"
            )
        names.add(field)
    return names


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


class GraderConfig(BaseModel):
    """Which grader scores a rollout (a name or path for ``grading.get_grader``) and its
    options. Only the shape is checked here; the grading module checks the rest."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        min_length=1, description="A built-in grader's name, or module:attribute of your own."
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Passed to the grader; each grader checks its own."
    )

    @property
    def digest(self) -> str:
        """A short content hash of the name and options: a stored grade says which grader
        configuration gave it (``orchestrator regrade`` compares two)."""
        canonical = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class E2BRootUser(StrEnum):
    """What a client of the E2B API (docs/e2b.md) gets when it asks for user ``root``."""

    REFUSE = "refuse"
    """``permission_denied``: every command and file is the sandbox user's."""
    ALIAS = "alias"
    """Run as the sandbox's own unprivileged user, exactly as if no user were named: a name
    only, never a privilege (what needs real root fails as it does for that user)."""


class E2BOptions(BaseModel):
    """How the E2B-compatible API serves this environment's sandboxes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    root_user: E2BRootUser = Field(
        E2BRootUser.REFUSE,
        description="refuse: a command or file as user root is refused; alias: it runs as "
        "the sandbox user (for clients such as Harbor that name root for every transfer).",
    )


# Fields added after environments were first pinned by rollouts: left out of the snapshot
# while at their defaults, so an environment that does not use them keeps its digest (a
# rollout pinned before they existed still finds its environment).
_LATER_FIELDS = (
    "egress",
    "setup",
    "scratch_dirs",
    "e2b",
    "expected_concurrency",
    "pool_autosize",
    "reuse",
    "max_reuses",
)


class SetupStep(BaseModel):
    """A step run once per group of rollouts (the rollouts of one dataset item: a GRPO
    group, at its codebase or commit) in a sandbox of its own, whose filesystem the group's
    sandboxes then start from (docs/snapshots.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    command: str = Field(
        min_length=1,
        description="A bash command line, run as the sandbox's user in /workspace; what it "
        "writes under /workspace, /tmp, its home and the scratch directories is kept. A "
        "non-zero exit fails the group's rollouts' start (422 setup_failed).",
    )
    timeout_s: float = Field(
        600.0, gt=0, description="Past this it is killed, and the set-up failed."
    )
    keep_s: int = Field(
        900,
        ge=10,
        description="How long the group's snapshot serves its rollouts (later samples, "
        "retries); a rollout of the group after that sets it up again.",
    )


class EnvironmentConfig(BaseModel):
    """One environment, as written in the environments YAML file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        pattern=ENVIRONMENT_NAME_PATTERN, description="What dataset rows and requests name."
    )
    description: str = Field("", description="Free text for people.")
    image: str | None = Field(None, min_length=1, description="A fixed image reference.")
    codebase: str | None = Field(None, min_length=1, description="A fixed codebase name.")
    runtime: Runtime | None = Field(None, description="None: settings.sandbox_runtime.")
    limits: EnvironmentLimits = Field(
        default_factory=EnvironmentLimits, description="Sandbox limits; see below."
    )
    tools: list[ToolEntry] = Field(
        min_length=1, description="Built-in tool names, or tool definitions (see below)."
    )
    secrets: dict[str, SecretSource] = Field(
        default_factory=dict,
        description="Named secrets its HTTP tools' headers use ({secret:NAME}), read from a "
        "file (a mounted Kubernetes Secret) or the API's environment each time they are "
        "used; never in a trajectory, log, export or error (docs/tenancy.md).",
    )
    sandbox_secrets: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variables of the sandbox's tool commands, each an entry of "
        "secrets by name ({VAR: NAME}). The worker reads the value when a command runs and "
        "takes it out of the command's output ([secret VAR]); never in a trajectory, log, "
        "export or error (docs/tenancy.md).",
    )
    tool_call_budget: int | None = Field(
        None, ge=1, description="Tool calls allowed per rollout; None: unlimited."
    )
    output_budget_bytes: int | None = Field(
        None, ge=256, description="Bytes of one tool output; None: the deployment's."
    )
    grader: GraderConfig = Field(description="Which grader scores a rollout; see below.")
    prompt: PromptTemplate | None = Field(
        None,
        description="How a dataset row becomes its Agent RFT conversation (messages); "
        "rft-config renders it for rows without messages. See below.",
    )
    idle_timeout_s: int = Field(
        1200,
        ge=1,
        description="End the rollout after this long without a call; a call or grade after "
        "that is a 503 (idle_reaped): discarded, never scored. The default outlasts a "
        "reasoning model's think time between two calls on a loaded trainer "
        "(docs/failure-model.md).",
    )
    max_lifetime_s: int | None = Field(
        None, ge=10, description="Hard expiry of the sandbox; None: settings.sandbox_lifetime_s."
    )
    grace_after_grade_s: int = Field(
        0,
        ge=0,
        description="Keep the rollout open and its sandbox this long after its grade (to look "
        "into it); 0: the grade closes the rollout and recycles or destroys its sandbox at "
        "once. A retried grade returns the score stored either way.",
    )
    pool_size: int = Field(
        0,
        ge=0,
        description="Warm sandboxes to keep ready per codebase at least (state/pool_sizing.py); "
        "a demand-sized pool grows above it.",
    )
    reuse: bool | None = Field(
        None,
        description="Recycle this environment's sandboxes after clean rollouts (reset, audited, "
        "back to the pool); None: settings.sandbox_reuse.",
    )
    max_reuses: int = Field(
        20, ge=0, description="Rollouts a sandbox may serve after its first, at most."
    )
    expected_concurrency: int = Field(
        0,
        ge=0,
        description="Rollouts expected at once (a training step's batch): a demand-sized "
        "pool holds this many before any demand is seen, so the first burst finds a warm pool.",
    )
    pool_autosize: bool = Field(
        True,
        description="Size this environment's pools by demand (with settings.pool_autosize); "
        "false: exactly pool_size.",
    )
    pool_codebases: list[str] = Field(
        default_factory=list,
        description="With the codebase from the dataset row: the codebases to keep pools of.",
    )
    setup: SetupStep | None = Field(
        None,
        description="A set-up step run once per group of rollouts, whose sandboxes start from "
        "its result (the Docker backend; see below).",
    )
    scratch_dirs: ScratchDirs = Field(
        (),
        description="Extra writable top-level directories (tmpfs of the sandbox user, in "
        "memory, each size_mb at most): the root filesystem is read-only.",
    )
    e2b: E2BOptions = Field(
        default_factory=E2BOptions, description="How the E2B API serves it (docs/e2b.md)."
    )
    egress: EgressPolicy = Field(
        default_factory=EgressPolicy,
        description="Where its sandboxes may connect: allowed domains (with their "
        "subdomains) and IPv4 CIDRs, enforced outside the sandbox, DNS included; anything "
        "else is refused as the agent's own failed connection. Empty (the default): no "
        "network at all (docs/egress.md).",
    )

    @field_validator("codebase")
    @classmethod
    def _codebase_name_valid(cls, value: str | None) -> str | None:
        # InvalidCodebaseName is a ValueError: pydantic reports it against this field.
        return validate_name(value) if value is not None else None

    @field_validator("image")
    @classmethod
    def _image_has_no_spaces(cls, value: str | None) -> str | None:
        if value is not None and (value != value.strip() or any(c.isspace() for c in value)):
            raise ValueError("an image reference has no whitespace")
        return value

    @field_validator("tools", mode="after")
    @classmethod
    def _names_unique(cls, value: list[str | CustomToolConfig]) -> list[str | CustomToolConfig]:
        seen: set[str] = set()
        for entry in value:
            name = entry if isinstance(entry, str) else entry.name
            if name in seen:
                raise ValueError(f"tool {name!r} is listed twice; tool names must be unique")
            seen.add(name)
        return value

    @model_validator(mode="after")
    def _one_source_of_code(self) -> EnvironmentConfig:
        if self.image is not None and self.codebase is not None:
            raise ValueError(
                "set at most one of image and codebase (neither: the dataset row's codebase "
                "field chooses it)"
            )
        # Only when both are given: a short lifetime under the default idle timeout is
        # fine (the lifetime ends the rollout first).
        explicit = "idle_timeout_s" in self.model_fields_set
        if (
            explicit
            and self.max_lifetime_s is not None
            and self.idle_timeout_s > self.max_lifetime_s
        ):
            raise ValueError("idle_timeout_s must not exceed max_lifetime_s")
        if self.setup is not None and (self.pool_size or self.expected_concurrency):
            raise ValueError(
                "an environment with a setup step keeps no pool (pool_size, "
                "expected_concurrency): its sandboxes are made from each group's snapshot"
            )
        for var, name in self.sandbox_secrets.items():
            if not ENV_VAR_RE.fullmatch(var):
                raise ValueError(f"sandbox_secrets: {var!r} is not an environment variable name")
            if name not in self.secrets:
                raise ValueError(
                    f"sandbox_secrets.{var}: no secret {name!r} (add it under secrets:)"
                )
        for entry in self.tools:
            if isinstance(entry, HttpToolConfig):
                missing = entry.secrets_named() - set(self.secrets)
                if missing:
                    raise ValueError(
                        f"tool {entry.name!r} uses secrets the environment does not name: "
                        f"{', '.join(sorted(missing))} (add them under secrets:)"
                    )
        return self

    @property
    def codebase_from_row(self) -> bool:
        """True when the dataset row's ``codebase`` field chooses the codebase."""
        return self.image is None and self.codebase is None

    def tool_names(self) -> list[str]:
        """The tools' names, in the order they are offered."""
        return [entry if isinstance(entry, str) else entry.name for entry in self.tools]

    def effective_runtime(self, settings: Settings) -> Runtime:
        """The runtime sandboxes of this environment use."""
        return self.runtime or settings.sandbox_runtime

    def effective_output_budget(self, settings: Settings) -> int:
        """The per-tool-output byte budget of this environment."""
        return (
            self.output_budget_bytes
            if self.output_budget_bytes is not None
            else settings.output_budget_bytes
        )

    def tool_settings(self, settings: Settings) -> Settings:
        """``settings`` as the tools of this environment see them (its output budget)."""
        budget = self.effective_output_budget(settings)
        if budget == settings.output_budget_bytes:
            return settings
        return settings.model_copy(update={"output_budget_bytes": budget})

    def effective_lifetime_s(self, settings: Settings) -> int:
        """The hard lifetime stamped on this environment's sandboxes."""
        return (
            self.max_lifetime_s if self.max_lifetime_s is not None else settings.sandbox_lifetime_s
        )

    @cached_property
    def snapshot(self) -> str:
        """This environment as canonical JSON: what a rollout pins when it starts, so an
        edited or removed configuration never changes a rollout already running."""
        data = self.model_dump(mode="json")
        defaults = EnvironmentConfig.model_fields
        for name in _LATER_FIELDS:
            default = defaults[name].get_default(call_default_factory=True)
            if getattr(self, name) == default:
                del data[name]
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @cached_property
    def digest(self) -> str:
        """A short content hash of :attr:`snapshot`: equal digests, equal environments."""
        return hashlib.sha256(self.snapshot.encode()).hexdigest()[:16]


class EnvironmentsFile(BaseModel):
    """The whole environments YAML file: ``environments:``, a list of environments."""

    model_config = ConfigDict(extra="forbid")

    environments: list[EnvironmentConfig] = Field(min_length=1)

    @field_validator("environments", mode="after")
    @classmethod
    def _names_unique(cls, value: list[EnvironmentConfig]) -> list[EnvironmentConfig]:
        seen: set[str] = set()
        for env in value:
            if env.name in seen:
                raise ValueError(f"environment {env.name!r} is defined twice")
            seen.add(env.name)
        return value
