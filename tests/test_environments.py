"""Environments: config validation, row resolution, and custom tools run in real sandboxes."""

from __future__ import annotations

import json
import textwrap
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config import Runtime, Settings
from orchestrator.environments import (
    FINQA_CODEBASE,
    CommandTool,
    CustomToolConfig,
    DatasetRowError,
    EnvironmentConfigError,
    EnvironmentRegistry,
    ResolvedEnvironment,
    UnknownEnvironment,
    ensure_finqa_corpus,
    finqa_example_dir,
    load_environments,
    parse_environments,
    render_value,
)
from orchestrator.environments.loader import UnknownRepository
from orchestrator.environments.models import E2BRootUser, EnvironmentConfig
from orchestrator.images.codebases import UnknownCodebase
from orchestrator.outcomes import Outcome
from orchestrator.sandbox.backend import (
    CommitWorkspace,
    ExecResult,
    FileAction,
    FileOpResult,
    ProbeResult,
    ReadFileResult,
    RepoSetup,
    SandboxBackend,
    SandboxHandle,
    SandboxSpec,
)
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.tools.base import ToolResult

MakeSandbox = Callable[..., SandboxHandle]

CORPUS_FILES = sorted(p.name for p in (finqa_example_dir() / "corpus").glob("*.txt"))

# A minimal valid environment; tests splice a variation into it.
MINIMAL = """
environments:
  - name: env-a
    tools: [shell]
    grader: {name: file_f1}
"""


def unit_settings(**overrides: Any) -> Settings:
    """Settings for tests that never reach Docker."""
    return Settings(state_dir=Path("/nonexistent-state"), **overrides)


def parse(text: str, settings: Settings | None = None) -> EnvironmentRegistry:
    return parse_environments(textwrap.dedent(text), settings or unit_settings(), source="t.yaml")


def config_error(text: str, settings: Settings | None = None) -> str:
    with pytest.raises(EnvironmentConfigError) as info:
        parse(text, settings)
    return str(info.value)


def custom_tool(**overrides: Any) -> CommandTool:
    definition: dict[str, Any] = {
        "name": "echo",
        "description": "Print the text.",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        },
        "argv": ["printf", "%s\\n", "{text}"],
    }
    definition.update(overrides)
    return CommandTool(CustomToolConfig.model_validate(definition))


class SpyBackend(SandboxBackend):
    """Counts the calls it forwards; with no inner backend, any call fails the test."""

    name = "spy"

    def __init__(self, inner: SandboxBackend | None = None) -> None:
        self.inner = inner
        self.calls: list[Any] = []

    def _forward(self) -> SandboxBackend:
        if self.inner is None:
            raise AssertionError("the backend must not be called")
        return self.inner

    def create(self, spec: SandboxSpec) -> SandboxHandle:
        return self._forward().create(spec)

    def exec(
        self,
        handle: SandboxHandle,
        command: str | list[str],
        *,
        timeout_s: float,
        output_budget_bytes: int,
        cwd: str = "/workspace",
        env: dict[str, str] | None = None,
        exec_id: str | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
        stdin: bool = False,
        pty: tuple[int, int] | None = None,
    ) -> ExecResult:
        self.calls.append(command)
        return self._forward().exec(
            handle, command, timeout_s=timeout_s, output_budget_bytes=output_budget_bytes, cwd=cwd
        )

    def signal_exec(self, handle: SandboxHandle, exec_id: str, *, kill: bool = True) -> bool:
        raise NotImplementedError  # the E2B surface's: no tool calls it

    def file_op(
        self,
        handle: SandboxHandle,
        action: FileAction,
        path: str,
        *,
        target: str | None = None,
        depth: int = 1,
        data: bytes | None = None,
        max_bytes: int = 0,
    ) -> FileOpResult:
        raise NotImplementedError  # the E2B surface's: no tool calls it

    def read_file(
        self,
        handle: SandboxHandle,
        path: str,
        *,
        start_line: int = 1,
        end_line: int | None = None,
        max_bytes: int,
    ) -> ReadFileResult:
        self.calls.append(path)
        return self._forward().read_file(
            handle, path, start_line=start_line, end_line=end_line, max_bytes=max_bytes
        )

    def probe(self, handle: SandboxHandle) -> ProbeResult:
        return self._forward().probe(handle)

    def destroy(self, handle: SandboxHandle) -> None:
        self._forward().destroy(handle)

    def list_owned(self) -> list[SandboxHandle]:
        return self._forward().list_owned()


FAKE_HANDLE = SandboxHandle(
    sandbox_id="fake",
    backend="spy",
    host="nowhere",
    runtime="runc",
    rollout_id="",
    image="none",
    native_id="none",
    created_at=datetime(2024, 1, 1, tzinfo=UTC),
    expires_at=datetime(2024, 1, 2, tzinfo=UTC),
)


# --- the packaged default ----------------------------------------------------------------------


def test_default_yaml_loads() -> None:
    registry = load_environments(unit_settings())
    assert registry.names() == ["codebase-planning", "finqa-demo", "base", "harbor"]
    # E2B's default template: the bare image, nothing to take from a row.
    base = registry.get("base")
    assert base.image == unit_settings().base_image and not base.codebase_from_row
    planning = registry.get("codebase-planning")
    assert planning.codebase_from_row
    assert planning.tool_names() == ["shell", "read_file"]
    assert planning.grader.name == "file_f1"
    assert planning.tool_call_budget == 50
    finqa = registry.get("finqa-demo")
    assert finqa.codebase == FINQA_CODEBASE
    assert finqa.tool_names() == ["search", "list", "cat"]
    assert finqa.tool_call_budget == 10
    assert finqa.grader.name == "numeric_match"
    assert all(isinstance(t, CommandTool) for t in registry.tools("finqa-demo").values())
    # For Harbor's E2B environment: its fixed directories, user root as the sandbox user.
    harbor = registry.get("harbor")
    assert [d.path for d in harbor.scratch_dirs] == ["/logs", "/tests", "/solution"]
    assert harbor.e2b.root_user == E2BRootUser.ALIAS
    assert base.e2b.root_user == E2BRootUser.REFUSE and base.scratch_dirs == ()


def test_fields_added_later_keep_the_digest_of_an_environment_without_them() -> None:
    """A rollout pinned before ``scratch_dirs`` and ``e2b`` existed still finds its
    environment: left at their defaults, they are not in the snapshot."""
    base = load_environments(unit_settings()).get("base")
    assert "scratch_dirs" not in base.snapshot and "e2b" not in base.snapshot
    harbor = load_environments(unit_settings()).get("harbor")
    pinned = json.loads(harbor.snapshot)
    assert pinned["e2b"] == {"root_user": "alias"} and len(pinned["scratch_dirs"]) == 3
    assert EnvironmentConfig.model_validate(pinned).digest == harbor.digest


def test_scratch_dirs_reach_the_sandbox_spec() -> None:
    resolved = load_environments(unit_settings()).for_rollout("harbor", "img", None)
    spec = resolved.sandbox_spec(unit_settings(), rollout_id="r")
    assert [(d.path, d.size_mb) for d in spec.scratch_dirs] == [
        ("/logs", 64),
        ("/tests", 32),
        ("/solution", 32),
    ]


def test_environments_file_setting_is_read(tmp_path: Path) -> None:
    path = tmp_path / "envs.yaml"
    path.write_text(MINIMAL)
    registry = load_environments(unit_settings(environments_file=path))
    assert registry.names() == ["env-a"]
    assert registry.source == str(path)


def test_errors_name_file_environment_and_field(tmp_path: Path) -> None:
    path = tmp_path / "envs.yaml"
    path.write_text(MINIMAL.replace("tools: [shell]", "tools: [shell]\n    tool_budget: 5"))
    with pytest.raises(EnvironmentConfigError) as info:
        load_environments(unit_settings(environments_file=path))
    message = str(info.value)
    assert str(path) in message
    assert "environment 'env-a', tool_budget: unknown field" in message


def test_unreadable_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(EnvironmentConfigError, match="cannot read"):
        load_environments(unit_settings(environments_file=missing))


BAD_CONFIGS: list[tuple[str, str, str]] = [
    (
        "bad tool name",
        """
        environments:
          - name: e
            grader: {name: g}
            tools:
              - name: "bad name!"
                description: d
                parameters: {type: object}
                argv: [true]
        """,
        "environment 'e', tools[0] (bad name!).name: String should match pattern",
    ),
    (
        "duplicate built-in tool",
        MINIMAL.replace("[shell]", "[shell, read_file, shell]"),
        "tool 'shell' is listed twice",
    ),
    (
        "duplicate custom tool",
        """
        environments:
          - name: e
            grader: {name: g}
            tools:
              - {name: t, description: d, parameters: {type: object}, argv: [ls]}
              - {name: t, description: d2, parameters: {type: object}, argv: [ls]}
        """,
        "tool 't' is listed twice",
    ),
    ("unknown built-in", MINIMAL.replace("[shell]", "[bash]"), "unknown built-in tool 'bash'"),
    (
        "custom tool with an invalid schema",
        """
        environments:
          - name: e
            grader: {name: g}
            tools:
              - name: t
                description: d
                parameters: {type: object, properties: {q: {type: nope}}}
                argv: [ls]
        """,
        "tools[0] (t).parameters: not a valid JSON Schema at properties/q/type",
    ),
    (
        "schema with a bad regex",
        """
        environments:
          - name: e
            grader: {name: g}
            tools:
              - name: t
                description: d
                parameters: {type: object, properties: {q: {type: string, pattern: "("}}}
                argv: [ls]
        """,
        "not a valid JSON Schema at properties/q/pattern",
    ),
    (
        "schema that is not an object",
        """
        environments:
          - name: e
            grader: {name: g}
            tools:
              - {name: t, description: d, parameters: {type: string}, argv: [ls]}
        """,
        'must be an object schema ("type": "object")',
    ),
    (
        "image and codebase both set",
        MINIMAL.replace("tools:", "image: some/image:1\n    codebase: corpus\n    tools:"),
        "environment 'env-a': set at most one of image and codebase",
    ),
    (
        "unknown field",
        MINIMAL.replace("tools:", "colour: blue\n    tools:"),
        "colour: unknown field",
    ),
    ("missing grader", MINIMAL.replace("    grader: {name: file_f1}\n", ""), "grader: required"),
    (
        "grader options not a mapping",
        MINIMAL.replace("{name: file_f1}", "{name: file_f1, options: [1]}"),
        "grader.options: Input should be a valid dictionary",
    ),
    (
        "undeclared placeholder",
        """
        environments:
          - name: e
            grader: {name: g}
            tools:
              - {name: t, description: d, parameters: {type: object}, argv: [cat, "{path}"]}
        """,
        "uses {path}, which is not a property of parameters",
    ),
    (
        "placeholder as the program",
        """
        environments:
          - name: e
            grader: {name: g}
            tools:
              - name: t
                description: d
                parameters: {type: object, properties: {p: {type: string}}}
                argv: ["{p}"]
        """,
        "the program (element 0) must be literal",
    ),
    (
        "format spec in a placeholder",
        """
        environments:
          - name: e
            grader: {name: g}
            tools:
              - name: t
                description: d
                parameters: {type: object, properties: {p: {type: string}}}
                argv: [ls, "{p!r}"]
        """,
        "format specs and conversions",
    ),
    (
        "attribute access in a placeholder",
        """
        environments:
          - name: e
            grader: {name: g}
            tools:
              - name: t
                description: d
                parameters: {type: object, properties: {p: {type: string}}}
                argv: [ls, "{p.__class__}"]
        """,
        "a placeholder is {name} or {name...}",
    ),
    (
        "spread of a non-array",
        """
        environments:
          - name: e
            grader: {name: g}
            tools:
              - name: t
                description: d
                parameters: {type: object, properties: {p: {type: string}}}
                argv: [ls, "{p...}"]
        """,
        "needs an array parameter",
    ),
    (
        "custom tool named like a built-in",
        """
        environments:
          - name: e
            grader: {name: g}
            tools:
              - {name: shell, description: d, parameters: {type: object}, argv: [ls]}
        """,
        "'shell' is a built-in tool's name",
    ),
    ("duplicate YAML key", MINIMAL + "    grader: {name: other}\n", "found duplicate key 'grader'"),
    (
        "duplicate environment",
        MINIMAL + MINIMAL.replace("environments:\n", ""),
        "environment 'env-a' is defined twice",
    ),
    ("YAML syntax", "environments: [\n  {name: e", "invalid YAML at line"),
    ("not a mapping", "- just\n- a list\n", "must be a mapping with an 'environments' list"),
    ("bad codebase name", MINIMAL.replace("tools:", "codebase: Bad/Name\n    tools:"), "codebase"),
    (
        "bad runtime",
        MINIMAL.replace("tools:", "runtime: firecracker\n    tools:"),
        "runtime: Input",
    ),
    (
        "kata on docker",
        MINIMAL.replace("tools:", "runtime: kata\n    tools:"),
        "kata (a VM per sandbox) needs ORCH_SANDBOX_BACKEND=kubernetes",
    ),
    (
        "scratch dir over a system directory",
        MINIMAL.replace("tools:", "scratch_dirs: [{path: /etc}]\n    tools:"),
        "/etc is the system's or the sandbox's own",
    ),
    (
        "scratch dir over the workspace",
        MINIMAL.replace("tools:", "scratch_dirs: [{path: /workspace}]\n    tools:"),
        "/workspace is the system's or the sandbox's own",
    ),
    (
        "nested scratch dir",
        MINIMAL.replace("tools:", "scratch_dirs: [{path: /logs/agent}]\n    tools:"),
        "scratch_dirs[0].path: String should match pattern",
    ),
    (
        "scratch dir twice",
        MINIMAL.replace("tools:", "scratch_dirs: [{path: /logs}, {path: /logs}]\n    tools:"),
        "a scratch directory is listed twice",
    ),
    (
        "unknown root user mode",
        MINIMAL.replace("tools:", "e2b: {root_user: grant}\n    tools:"),
        "e2b.root_user: Input should be 'refuse' or 'alias'",
    ),
    (
        "an HTTP tool's secret the environment does not name",
        MINIMAL.replace(
            "tools: [shell]",
            "tools: [{name: s, description: d, url: 'http://x/s', "
            "parameters: {type: object}, headers: {k: '{secret:missing}'}}]",
        ),
        "tool 's' uses secrets the environment does not name: missing",
    ),
    (
        "a secret read from two places",
        MINIMAL.replace("tools:", "secrets: {k: {file: /f, env: K}}\n    tools:"),
        "a secret is read from exactly one of: file, env",
    ),
    (
        "a sandbox secret the environment does not name",
        MINIMAL.replace("tools:", "sandbox_secrets: {TOKEN: missing}\n    tools:"),
        "sandbox_secrets.TOKEN: no secret 'missing'",
    ),
    (
        "an HTTP tool with a URL that is not http",
        MINIMAL.replace(
            "tools: [shell]",
            "tools: [{name: s, description: d, url: 'file:///etc/passwd', "
            "parameters: {type: object}}]",
        ),
        "url: String should match pattern",
    ),
    (
        "limit below minimum",
        MINIMAL.replace("tools:", "limits: {memory_mb: 8}\n    tools:"),
        "limits.memory_mb: Input should be greater than or equal to 64",
    ),
]


@pytest.mark.parametrize(
    ("text", "expected"), [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS]
)
def test_bad_config_is_reported(text: str, expected: str) -> None:
    message = config_error(text)
    assert message.startswith("invalid environments file t.yaml:")
    assert expected in message


def test_kata_is_accepted_on_kubernetes() -> None:
    text = MINIMAL.replace("tools:", "runtime: kata\n    tools:")
    registry = parse(text, unit_settings(sandbox_backend="kubernetes"))
    assert registry.get("env-a").runtime == "kata"


def test_every_problem_is_reported_at_once() -> None:
    text = MINIMAL.replace("[shell]", "[bash]").replace("tools:", "colour: blue\n    tools:")
    message = config_error(text)
    assert "unknown built-in tool 'bash'" in message
    assert "colour: unknown field" in message


def test_tool_timeout_above_the_deployment_maximum() -> None:
    text = """
    environments:
      - name: e
        grader: {name: g}
        tools:
          - {name: t, description: d, parameters: {type: object}, argv: [ls], timeout_s: 900}
    """
    message = config_error(text, unit_settings(command_timeout_max_s=600))
    assert "tools[0] (t).timeout_s: 900 exceeds settings.command_timeout_max_s" in message


# --- resolving rows (no Docker needed) ---------------------------------------------------------

FIXED_IMAGE = """
environments:
  - name: planning
    tools: [shell, read_file]
    grader: {name: file_f1}
  - name: imaged
    image: orchestrator/sandbox-base:latest
    runtime: runsc
    limits: {memory_mb: 512, pids: 64}
    output_budget_bytes: 1024
    max_lifetime_s: 900
    tools:
      - shell
      - {name: echo, description: d, parameters: {type: object}, argv: [echo, hi]}
    grader: {name: numeric_match, options: {rel_tol: 0.01}}
"""


def test_unknown_environment_lists_known_ones() -> None:
    registry = parse(FIXED_IMAGE)
    with pytest.raises(UnknownEnvironment) as info:
        registry.get("nope")
    assert str(info.value) == "unknown environment 'nope'; known environments: planning, imaged"
    with pytest.raises(UnknownEnvironment, match=r"'nope' \(the row's environment field\)"):
        registry.resolve({"environment": "nope", "codebase": "x"})


def test_missing_default_environment_is_named() -> None:
    registry = parse(FIXED_IMAGE)
    with pytest.raises(UnknownEnvironment, match=r"settings\.default_environment"):
        registry.resolve({"codebase": "x"})


def test_row_without_codebase() -> None:
    registry = parse(FIXED_IMAGE, unit_settings(default_environment="planning"))
    with pytest.raises(DatasetRowError) as info:
        registry.resolve({"question": "which files?"})
    assert info.value.field == "codebase"
    assert "no codebase field" in str(info.value)
    assert "'planning'" in str(info.value)


@pytest.mark.parametrize("value", [5, "", "Bad Name", ["a"]])
def test_row_with_malformed_codebase(value: Any) -> None:
    registry = parse(FIXED_IMAGE)
    with pytest.raises(DatasetRowError) as info:
        registry.resolve({"environment": "planning", "codebase": value})
    assert info.value.field == "codebase"


def test_row_with_malformed_environment() -> None:
    with pytest.raises(DatasetRowError) as info:
        parse(FIXED_IMAGE).resolve({"environment": 3})
    assert info.value.field == "environment"


def test_fixed_image_environment() -> None:
    settings = unit_settings()
    resolved = parse(FIXED_IMAGE, settings).resolve({"environment": "imaged"})
    assert resolved.image == "orchestrator/sandbox-base:latest"
    assert resolved.codebase is None
    assert list(resolved.tools) == ["shell", "echo"]
    spec = resolved.sandbox_spec(settings, "trace_1")
    assert spec.image == resolved.image
    assert spec.runtime == "runsc"
    assert spec.rollout_id == "trace_1"
    assert spec.lifetime_s == 900
    assert spec.limits.memory_mb == 512
    assert spec.limits.pids == 64
    assert spec.limits.cpus == settings.sandbox_cpus
    assert spec.limits.tmp_mb == settings.sandbox_tmp_mb
    assert resolved.tool_settings(settings).output_budget_bytes == 1024
    assert resolved.environment.grader.options == {"rel_tol": 0.01}


def test_fixed_image_environment_refuses_a_row_codebase() -> None:
    with pytest.raises(DatasetRowError, match="must not name a codebase"):
        parse(FIXED_IMAGE).resolve({"environment": "imaged", "codebase": "other"})


def test_fixed_codebase_refuses_another_row_codebase() -> None:
    registry = load_environments(unit_settings())
    with pytest.raises(DatasetRowError, match="always runs codebase 'finqa-corpus'"):
        registry.resolve({"environment": "finqa-demo", "codebase": "something-else"})


def test_tool_schemas_are_function_tools() -> None:
    settings = unit_settings()
    resolved = parse(FIXED_IMAGE, settings).resolve({"environment": "imaged"})
    schemas = resolved.tool_schemas(settings)
    assert [s["name"] for s in schemas] == ["shell", "echo"]
    for schema in schemas:
        assert set(schema) == {"type", "name", "description", "parameters", "strict"}
        assert schema["type"] == "function"
        assert schema["parameters"]["type"] == "object"
        assert schema["parameters"]["additionalProperties"] is False


def test_strict_schema_of_a_custom_tool() -> None:
    tool = custom_tool(
        parameters={
            "type": "object",
            "properties": {
                "text": {"type": "string", "description": "what", "maxLength": 9},
                "files": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["text"],
        },
        argv=["echo", "{text}", "{files...}"],
    )
    schema = tool.parameters_schema(unit_settings(), strict=True)
    assert schema["required"] == ["text", "files"]
    assert schema["properties"]["text"] == {"type": "string", "description": "what"}
    assert schema["properties"]["files"] == {"type": ["array", "null"], "items": {"type": "string"}}
    loose = tool.parameters_schema(unit_settings())
    assert loose["properties"]["text"]["maxLength"] == 9
    assert loose["required"] == ["text"]


def test_unknown_tool_of_an_environment() -> None:
    settings = unit_settings()
    resolved = parse(FIXED_IMAGE, settings).resolve({"environment": "imaged"})
    result = resolved.run_tool("read_file", SpyBackend(), FAKE_HANDLE, {"path": "x"}, settings)
    assert result.outcome == Outcome.AGENT_ERROR
    assert result.error_kind == "unknown_tool"
    assert "available tools: shell, echo" in result.output


# --- custom tools without a sandbox ------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "text"),
    [("a b", "a b"), (True, "true"), (False, "false"), (5, "5"), (5.0, "5"), (2.5, "2.5"),
     ({"a": [1]}, '{"a":[1]}'), ([1, "x"], '[1,"x"]')],
)  # fmt: skip
def test_render_value(value: Any, text: str) -> None:
    assert render_value(value) == text


def test_argv_rendering_rules() -> None:
    tool = custom_tool(
        parameters={
            "type": "object",
            "properties": {
                "pattern": {"type": "string"},
                "max": {"type": "integer", "default": 3},
                "glob": {"type": "string"},
                "files": {"type": "array", "items": {"type": "string"}},
                "literal": {"type": "boolean"},
            },
            "required": ["pattern"],
        },
        argv=["rg", "--max-count={max}", "--glob={glob}", "{{x}}", "--", "{pattern}", "{files...}"],
    )
    settings = unit_settings()
    args = tool.parse({"pattern": "a b; c", "files": ["x", "-y"]}, settings)
    assert args.argv == ["rg", "--max-count=3", "{x}", "--", "a b; c", "x", "-y"]
    args = tool.parse({"pattern": "p", "glob": "*.py", "max": 7, "glob_unused": None}, settings)
    assert args.argv == ["rg", "--max-count=7", "--glob=*.py", "{x}", "--", "p"]


INVALID_CALLS: list[tuple[str, Any, list[str]]] = [
    ("missing", {}, ["text: required argument is missing"]),
    ("wrong type", {"text": 5}, ["text: expected string, got integer 5"]),
    ("extra", {"text": "a", "txt": 1}, ["txt: unknown argument (allowed: text)"]),
    ("null required", {"text": None}, ["text: expected string, got null"]),
    ("not an object", "[1]", ["arguments must be a JSON object"]),
    ("bad JSON", '{"text": ', ["arguments are not valid JSON"]),
    ("NUL", {"text": "a\x00b"}, ["text: must not contain NUL characters"]),
    ("huge", {"text": "x" * 70_000}, ["text: too long (70,000 bytes"]),
]


@pytest.mark.parametrize(
    ("arguments", "expected"), [c[1:] for c in INVALID_CALLS], ids=[c[0] for c in INVALID_CALLS]
)
def test_invalid_arguments_never_reach_the_backend(arguments: Any, expected: list[str]) -> None:
    backend = SpyBackend()  # fails the test if called
    result = custom_tool().run(backend, FAKE_HANDLE, arguments, unit_settings())
    assert result.outcome == Outcome.AGENT_ERROR
    assert result.error_kind == "invalid_arguments"
    for line in expected:
        assert line in result.output
    assert result.output.endswith('usage: echo {"text": string}')
    assert backend.calls == []


def test_pattern_keeps_finqa_cat_to_the_corpus() -> None:
    cat = load_environments(unit_settings()).tools("finqa-demo")["cat"]
    for name in ("../../../etc/passwd", "/etc/passwd", "-n", "--help", ".hidden", "a/b.txt"):
        result = cat.run(SpyBackend(), FAKE_HANDLE, {"name": name}, unit_settings())
        assert result.outcome == Outcome.AGENT_ERROR, name
        assert "name: " in result.output


# --- against real sandboxes --------------------------------------------------------------------


@pytest.fixture(scope="session")
def finqa_image(settings: Settings, base_image: str) -> str:
    """The finqa-corpus codebase, built once (or reused); left in place as a cached artifact."""
    return ensure_finqa_corpus(settings)


@pytest.fixture(scope="session")
def registry(settings: Settings) -> EnvironmentRegistry:
    return load_environments(settings)


@pytest.fixture()
def finqa(registry: EnvironmentRegistry, finqa_image: str) -> ResolvedEnvironment:
    return registry.resolve({"environment": "finqa-demo", "question": "q", "answer": 1})


def call(
    resolved: ResolvedEnvironment,
    backend: SandboxBackend,
    handle: SandboxHandle,
    settings: Settings,
    name: str,
    arguments: Any,
) -> ToolResult:
    return resolved.run_tool(name, backend, handle, arguments, settings)


def test_resolve_finqa_row(finqa: ResolvedEnvironment, finqa_image: str) -> None:
    assert finqa.image == finqa_image
    assert finqa.codebase == FINQA_CODEBASE
    assert list(finqa.tools) == ["search", "list", "cat"]


def test_codebase_from_the_row(registry: EnvironmentRegistry, finqa_image: str) -> None:
    resolved = registry.resolve({"codebase": FINQA_CODEBASE})  # the default environment
    assert resolved.environment.name == "codebase-planning"
    assert resolved.image == finqa_image
    assert list(resolved.tools) == ["shell", "read_file"]


def test_unknown_codebase_is_named(registry: EnvironmentRegistry) -> None:
    name = f"missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(UnknownCodebase) as info:
        registry.resolve({"environment": "codebase-planning", "codebase": name})
    assert f"unknown codebase {name!r}" in str(info.value)
    assert "codebase field" in str(info.value)


def test_dataset_answers_are_in_the_corpus() -> None:
    rows = [json.loads(line) for line in (finqa_example_dir() / "dataset.jsonl").open()]
    assert len(rows) >= 8
    for row in rows:
        assert row["environment"] == "finqa-demo"
        assert isinstance(row["answer"], int | float)
        assert row["question"].endswith("?") or "Answer in" in row["question"]


def test_search_list_cat(
    finqa: ResolvedEnvironment,
    backend: DockerBackend,
    make_sandbox: MakeSandbox,
    settings: Settings,
    runtime: Runtime,
) -> None:
    handle = make_sandbox(**finqa.sandbox_spec(settings, "t").model_dump() | {"runtime": runtime})
    result = call(finqa, backend, handle, settings, "search", {"query": "net income"})
    assert result.outcome == Outcome.OK, result.output
    assert "./halvard_fy2023.txt:" in result.output
    assert "$41.3 million" in result.output

    result = call(finqa, backend, handle, settings, "list", "{}")
    assert result.outcome == Outcome.OK
    assert result.output.splitlines() == CORPUS_FILES

    result = call(finqa, backend, handle, settings, "list", {"filter": "MARROW"})
    assert result.output.splitlines() == [
        "marrow_bay_energy_fy2022.txt",
        "marrow_bay_energy_fy2023.txt",
    ]

    result = call(
        finqa, backend, handle, settings, "cat", json.dumps({"name": "halvard_fy2023.txt"})
    )
    assert result.outcome == Outcome.OK
    expected = (finqa_example_dir() / "corpus" / "halvard_fy2023.txt").read_text()
    assert result.output == expected.removesuffix("\n")


def test_search_arguments_are_data(
    finqa: ResolvedEnvironment,
    backend: DockerBackend,
    make_sandbox: MakeSandbox,
    settings: Settings,
) -> None:
    handle = make_sandbox(image=finqa.image)
    for query in ("$(id)", "`id`", "; rm -rf /", "-e", "--help", "--files", "x'; id; echo '"):
        result = call(finqa, backend, handle, settings, "search", {"query": query})
        # No match (exit 1) in a corpus that holds none of these, and never rg's usage text
        # or a command's output: the query reached rg as one pattern.
        assert result.outcome == Outcome.OK, (query, result.output)
        assert result.exit_code == 1, (query, result.output)
        assert result.output == "(no output)\n[exit code 1]", query
    # A newline is passed to rg as is; rg itself refuses it in a pattern.
    result = call(finqa, backend, handle, settings, "search", {"query": "net\nincome"})
    assert result.exit_code == 2
    assert "literal" in result.output and "uid=" not in result.output
    # Nothing was deleted by "; rm -rf /".
    listing = call(finqa, backend, handle, settings, "list", {})
    assert listing.output.splitlines() == CORPUS_FILES


def test_argv_elements_arrive_verbatim(
    backend: DockerBackend, make_sandbox: MakeSandbox, settings: Settings, finqa_image: str
) -> None:
    handle = make_sandbox(image=finqa_image)
    echo = custom_tool()
    for text in ("$(id)", "`id`", "; rm -rf / ;", "a\nb", "--help", "'\"quoted\"'", "*", "~"):
        result = echo.run(backend, handle, {"text": text}, settings)
        assert result.outcome == Outcome.OK
        assert result.output == text, text


def test_cat_without_pattern_reads_only_what_the_sandbox_user_can(
    backend: DockerBackend, make_sandbox: MakeSandbox, settings: Settings, finqa_image: str
) -> None:
    # The same argv as finqa-demo's cat but with no name pattern: `--` and the sandbox are
    # then the only guards.
    rawcat = custom_tool(
        name="rawcat",
        parameters={
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
        },
        argv=["cat", "--", "{name}"],
    )
    handle = make_sandbox(image=finqa_image)
    # Traversal reads the sandbox's own /etc/passwd, which its user may read anyway.
    result = rawcat.run(backend, handle, {"name": "../../../etc/passwd"}, settings)
    assert "agent:x:1000:1000" in result.output
    for option in ("--help", "-n", "-A"):
        result = rawcat.run(backend, handle, {"name": option}, settings)
        assert result.exit_code == 1
        assert f"cat: {option}: No such file or directory" in result.output
    result = rawcat.run(backend, handle, {"name": "/run/orchestrator/agent.sock"}, settings)
    assert result.exit_code == 1
    assert "Permission denied" in result.output


def test_invalid_arguments_do_not_touch_the_sandbox(
    finqa: ResolvedEnvironment,
    backend: DockerBackend,
    make_sandbox: MakeSandbox,
    settings: Settings,
) -> None:
    handle = make_sandbox(image=finqa.image)
    spy = SpyBackend(backend)
    bad_calls: list[tuple[str, Any]] = [
        ("search", {"query": 5}),
        ("search", {}),
        ("search", {"query": "x", "path": "/"}),
        ("search", {"query": ""}),
        ("list", {"filter": ["a"]}),
        ("cat", {"name": "../../../etc/passwd"}),
        ("cat", {"name": "--help"}),
        ("cat", "not json"),
    ]
    for name, arguments in bad_calls:
        result = call(finqa, spy, handle, settings, name, arguments)
        assert result.outcome == Outcome.AGENT_ERROR, (name, arguments)
        assert result.error_kind == "invalid_arguments"
    assert spy.calls == []
    result = call(finqa, spy, handle, settings, "cat", {"name": "halvard_q1_2024.txt"})
    assert result.outcome == Outcome.OK
    assert len(spy.calls) == 1


def test_timeout_and_cwd(
    backend: DockerBackend, make_sandbox: MakeSandbox, settings: Settings, finqa_image: str
) -> None:
    handle = make_sandbox(image=finqa_image)
    sleeper = custom_tool(
        name="sleeper", parameters={"type": "object"}, argv=["sleep", "30"], timeout_s=1
    )
    result = sleeper.run(backend, handle, {}, settings)
    assert result.outcome == Outcome.AGENT_ERROR
    assert result.error_kind == "timeout"
    assert "[sleeper timed out after 1 s" in result.output
    assert "timeout_s" not in result.output
    where = custom_tool(name="where", parameters={"type": "object"}, argv=["pwd"], cwd="/tmp")
    assert where.run(backend, handle, None, settings).output == "/tmp"


SHA = "a" * 40


def _at(repo: str = "requests", commit: str = SHA, **fields: Any) -> CommitWorkspace:
    return CommitWorkspace(repo=repo, commit=commit, source="/srv/requests", **fields)


def test_a_row_at_a_commit_runs_its_workspace_on_the_base_or_set_up_image() -> None:
    settings = unit_settings()
    registry = parse(FIXED_IMAGE, settings)
    row = {"environment": "planning", "repo": "requests", "commit": SHA}
    resolved = registry.resolve(row, workspace=_at())
    assert resolved.codebase == f"requests@{SHA}" and resolved.image == settings.base_image
    spec = resolved.sandbox_spec(settings, "ro-1")
    assert spec.workspace == _at() and spec.image == settings.base_image
    setup = RepoSetup(commands=["true"])
    on_setup = registry.resolve(row, workspace=_at(setup=setup, setup_image="img:1"))
    assert on_setup.image == "img:1"
    # An environment's fixed image, for a repository without a set-up only.
    imaged = {**row, "environment": "imaged"}
    assert registry.resolve(imaged, workspace=_at()).image == "orchestrator/sandbox-base:latest"
    with pytest.raises(DatasetRowError, match="brings its own set-up image"):
        registry.resolve(imaged, workspace=_at(setup=setup, setup_image="img:1"))


@pytest.mark.parametrize(
    ("row", "field", "message"),
    [
        ({"repo": "requests"}, "commit", "names its commit too"),
        ({"commit": SHA}, "repo", "names its commit too"),
        ({"repo": "requests", "commit": "HEAD"}, "commit", "40-character"),
        ({"repo": "requests", "commit": SHA[:12]}, "commit", "40-character"),
        ({"repo": "Not A Name", "commit": SHA}, "repo", "registered repository's name"),
        ({"repo": "requests", "commit": SHA, "codebase": "x"}, "codebase", "name one of them"),
    ],
)
def test_a_malformed_row_at_a_commit_names_its_field(
    row: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(DatasetRowError, match=message) as info:
        parse(FIXED_IMAGE).resolve({"environment": "planning", **row}, workspace=_at())
    assert info.value.field == field


def test_a_row_at_a_commit_is_refused_where_it_cannot_run() -> None:
    row = {"environment": "planning", "repo": "requests", "commit": SHA}
    with pytest.raises(UnknownRepository, match="not looked up"):
        parse(FIXED_IMAGE).resolve(row)
    kube = unit_settings(sandbox_backend="kubernetes")
    with pytest.raises(DatasetRowError, match="need the Docker backend"):
        parse(FIXED_IMAGE, kube).resolve(row, workspace=_at())
