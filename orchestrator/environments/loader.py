"""Loading environments from YAML, and resolving a dataset row to what its rollout runs.

The file is ``settings.environments_file`` or, when that is None, the packaged
``orchestrator/environments/default.yaml``. Its format::

    environments:
      - name: codebase-planning
        tools: [shell, read_file]
        grader: {name: file_f1}
      - name: finqa-demo
        codebase: finqa-corpus
        tools:
          - name: search
            description: ...
            parameters: {type: object, properties: {query: {type: string}}, required: [query]}
            argv: [rg, --ignore-case, --, "{query}", .]
        ...

Every problem in the file is reported at once, each line naming the file, the environment
and the field (:class:`EnvironmentConfigError`). Duplicate keys in a YAML mapping are errors
too (plain YAML keeps the last one silently).

Resolving a row (:meth:`EnvironmentRegistry.resolve`) never falls back to some default
codebase: a row that does not say which codebase it needs, or names one that is not
registered, is an error.
"""

from __future__ import annotations

import importlib.resources
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from orchestrator.config import Settings, get_settings
from orchestrator.environments.custom_tool import CommandTool
from orchestrator.environments.http_tool import HttpTool
from orchestrator.environments.models import EnvironmentConfig, EnvironmentsFile, HttpToolConfig
from orchestrator.images.codebases import (
    InvalidCodebaseName,
    UnknownCodebase,
    codebase_image,
    validate_name,
)
from orchestrator.sandbox.backend import (
    CommitWorkspace,
    SandboxBackend,
    SandboxHandle,
    SandboxSpec,
)
from orchestrator.sandbox.repos import REPO_NAME_RE, check_commit
from orchestrator.tools.base import Tool, ToolResult, agent_error
from orchestrator.tools.command import CLIENT_TOOLS
from orchestrator.tools.registry import function_tool_schema, get_tool

DEFAULT_FILE = "default.yaml"
# pydantic tags of the tools union; they say nothing to a person reading an error.
_UNION_TAGS = {"builtin", "custom"}


class EnvironmentConfigError(ValueError):
    """The environments file is unreadable or invalid; ``problems`` lists every issue,
    each naming the file, the environment and the field."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = list(problems)
        lines = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"invalid environments file {source}:\n{lines}")


class UnknownEnvironment(LookupError):
    """No environment has this name; the message lists the known ones."""

    def __init__(self, name: str, known: Sequence[str], *, origin: str = "") -> None:
        self.name = name
        self.known = list(known)
        where = f" ({origin})" if origin else ""
        self.message = (
            f"unknown environment {name!r}{where}; known environments: "
            f"{', '.join(self.known) or 'none'}"
        )
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message


class UnknownRepository(LookupError):
    """The row names a repository that is not registered, or a commit it does not have
    (the caller looks both up: state/repos.py)."""


class DatasetRowError(ValueError):
    """A dataset row lacks a field its environment needs, or a field has a bad value;
    ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(message)


# --- YAML --------------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (plain YAML silently keeps the last one)."""


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:
            continue  # unhashable: construct_mapping below reports it
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping",
                node.start_mark,
                f"found duplicate key {key!r}",
                key_node.start_mark,
            )
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _mapping_without_duplicates,
)


def _read_yaml(source: str, text: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise EnvironmentConfigError(source, [f"invalid YAML{where}: {exc.problem}"]) from None
    except yaml.YAMLError as exc:
        raise EnvironmentConfigError(source, [f"invalid YAML: {exc}"]) from None


# --- error messages --------------------------------------------------------------------------


def _child(node: Any, part: int | str) -> Any:
    if isinstance(node, dict) and isinstance(part, str):
        return node.get(part)
    if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        return node[part]
    return None


def _describe_location(loc: tuple[int | str, ...], raw: Any) -> tuple[str, str]:
    """(environment label, field path) for a pydantic error location, using the raw data to
    name list entries: ``environment 'finqa-demo'`` and ``tools[2] (search).parameters``."""
    items = [
        part
        for i, part in enumerate(loc)
        if not (part in _UNION_TAGS and i and isinstance(loc[i - 1], int))
    ]
    env_label = ""
    node: Any = raw
    if len(items) >= 2 and items[0] == "environments" and isinstance(items[1], int):
        node = _child(_child(raw, "environments"), items[1])
        name = _child(node, "name")
        env_label = (
            f"environment {name!r}" if isinstance(name, str) else f"environment #{items[1] + 1}"
        )
        items = items[2:]
    path = ""
    for part in items:
        node = _child(node, part)
        if isinstance(part, int):
            path += f"[{part}]"
            name = node if isinstance(node, str) else _child(node, "name")
            if isinstance(name, str):
                path += f" ({name})"
        else:
            path += ("." if path else "") + part
    return env_label, path


def _error_line(error: ErrorDetails, raw: Any) -> str:
    env_label, path = _describe_location(tuple(error["loc"]), raw)
    kind = error["type"]
    message = error["msg"].removeprefix("Value error, ")
    if kind == "extra_forbidden":
        message = "unknown field"
    elif kind == "missing":
        message = "required field is missing"
    subject = ", ".join(s for s in (env_label, path) if s) or "(top level)"
    return f"{subject}: {message}"


# --- resolved environments -------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedEnvironment:
    """What one rollout runs: its environment, image, codebase and tools."""

    environment: EnvironmentConfig
    image: str
    codebase: str | None
    """The codebase's name (``<repo>@<commit>`` for a repository at a commit); None for
    an environment with a fixed image."""
    tools: Mapping[str, Tool[Any]] = field(repr=False)
    """Tool objects by name, in the order they are offered."""
    settings: Settings | None = field(default=None, repr=False, compare=False)
    """The settings the registry was loaded with: the default for :meth:`tool_schemas`."""
    workspace: CommitWorkspace | None = None
    """/workspace from a repository at a commit (the row's ``repo`` and ``commit``)."""

    def sandbox_spec(self, settings: Settings, rollout_id: str) -> SandboxSpec:
        """The spec of this rollout's sandbox: the environment's image, runtime, limits and
        lifetime (the deployment's settings for whatever the environment leaves out)."""
        env = self.environment
        return SandboxSpec(
            image=self.image,
            runtime=env.effective_runtime(settings),
            limits=env.limits.resolve(settings),
            rollout_id=rollout_id,
            lifetime_s=env.effective_lifetime_s(settings),
            scratch_dirs=env.scratch_dirs,
            workspace=self.workspace,
            egress=env.egress,
        )

    def tool_settings(self, settings: Settings) -> Settings:
        """``settings`` as the tools of this environment see them (its output budget)."""
        return self.environment.tool_settings(settings)

    def tool(self, name: str, *, clients: bool = False) -> Tool[Any] | None:
        """The tool called ``name``: one of the environment's, or with ``clients`` one of
        the tools clients that drive the sandbox themselves use (tools/command.py)."""
        found = self.tools.get(name)
        if found is None and clients:
            found = CLIENT_TOOLS.get(name)
        return found

    def tool_schemas(
        self, settings: Settings | None = None, *, strict: bool = False
    ) -> list[dict[str, Any]]:
        """The environment's tools as OpenAI function tools (``{"type": "function", "name",
        "description", "parameters", "strict"}``), for a trainer's job config."""
        base = settings or self.settings or get_settings()
        tool_settings = self.tool_settings(base)
        return [function_tool_schema(t, tool_settings, strict=strict) for t in self.tools.values()]

    def run_tool(
        self,
        name: str,
        backend: SandboxBackend,
        handle: SandboxHandle,
        arguments: dict[str, Any] | str | None,
        settings: Settings,
    ) -> ToolResult:
        """Run one of this environment's tools with the environment's output budget. A name
        it does not offer is the agent's mistake (``unknown_tool``). The tool-call budget is
        the rollout's to count, not this method's.
        :class:`~orchestrator.sandbox.backend.SandboxError` propagates."""
        tool_settings = self.tool_settings(settings)
        tool = self.tools.get(name)
        if tool is None:
            return agent_error(
                f"unknown tool {name!r}; available tools: {', '.join(self.tools)}",
                "unknown_tool",
                budget=tool_settings.output_budget_bytes,
            )
        return tool.run(backend, handle, arguments, tool_settings)


# --- the registry ----------------------------------------------------------------------------


CODEBASE_CACHE_S = 30.0
"""How long a codebase found registered is trusted without asking the daemon again."""
PINNED_CACHE_MAX = 256
"""Environment snapshots kept parsed beside the configured ones (oldest dropped first)."""

Pinned = tuple[EnvironmentConfig, Mapping[str, Tool[Any]]]
"""An environment and its tools, built once."""


class EnvironmentRegistry:
    """The environments of a deployment, by name, with their tools built once."""

    def __init__(
        self, settings: Settings, environments: Sequence[EnvironmentConfig], source: str
    ) -> None:
        """Index validated environments; ``source`` names where they came from (for errors)."""
        self.settings = settings
        self.source = source
        self._environments = {env.name: env for env in environments}
        self._tools = {env.name: _build_tools(env) for env in environments}
        self._known_codebases: dict[str, tuple[str, float]] = {}
        # Pinned environments by digest: the configured ones, and snapshots of other
        # configurations that rollouts still run on (bounded; oldest dropped first).
        self._configured: dict[str, Pinned] = {
            env.digest: (env, self._tools[env.name]) for env in environments
        }
        self._snapshots: dict[str, Pinned] = {}

    def names(self) -> list[str]:
        """Environment names, in file order."""
        return list(self._environments)

    def __contains__(self, name: object) -> bool:
        return name in self._environments

    def __len__(self) -> int:
        return len(self._environments)

    def get(self, name: str) -> EnvironmentConfig:
        """The environment called ``name``; :class:`UnknownEnvironment` if none."""
        try:
            return self._environments[name]
        except KeyError:
            raise UnknownEnvironment(name, self.names()) from None

    def tools(self, name: str) -> Mapping[str, Tool[Any]]:
        """The tools of environment ``name``, by name."""
        self.get(name)
        return self._tools[name]

    def resolve(
        self, item: Mapping[str, Any], *, workspace: CommitWorkspace | None = None
    ) -> ResolvedEnvironment:
        """What a rollout on dataset row ``item`` runs.

        The environment is ``item["environment"]``, else ``settings.default_environment``.
        A row naming a repository and a commit (:func:`row_commit`) runs on ``workspace``,
        which the caller found registered: its /workspace is that commit, its image the
        environment's ``image`` or else the base image; an environment with a fixed
        ``codebase`` refuses such a row. Otherwise, the codebase:

        - environment with a fixed ``image``: the row must not name a codebase;
        - environment with a fixed ``codebase``: the row may name it too, but only the same
          one (a row meant for another corpus must not be scored against this one);
        - otherwise ``item["codebase"]`` must name a registered codebase.

        Raises :class:`UnknownEnvironment`, :class:`DatasetRowError` (missing or malformed
        field, or a codebase that contradicts the environment) or
        :class:`~orchestrator.images.codebases.UnknownCodebase`. Looking a codebase up asks
        the Docker daemon; :class:`~orchestrator.sandbox.backend.BackendUnavailable`
        propagates as the infrastructure fault it is.
        """
        raw_env = item.get("environment")
        if raw_env is not None and not isinstance(raw_env, str):
            raise DatasetRowError(
                "environment",
                f"the row's environment field must be a string, got {type(raw_env).__name__}",
            )
        if raw_env:
            name, origin = raw_env, "the row's environment field"
        else:
            name, origin = self.settings.default_environment, "settings.default_environment"
        if name not in self._environments:
            raise UnknownEnvironment(name, self.names(), origin=origin)
        env = self._environments[name]
        row_codebase = _row_codebase(item)
        wanted = row_commit(item)
        if wanted is not None:
            return self._at_commit(env, item, wanted, row_codebase, workspace)
        if workspace is not None:
            raise DatasetRowError("repo", "the row names no repository and commit")

        if env.image is not None:
            if row_codebase is not None:
                raise DatasetRowError(
                    "codebase",
                    f"environment {env.name!r} runs the fixed image {env.image}; the row must "
                    f"not name a codebase (it names {row_codebase!r})",
                )
            return ResolvedEnvironment(env, env.image, None, self._tools[name], self.settings)

        if env.codebase is not None:
            if row_codebase is not None and row_codebase != env.codebase:
                raise DatasetRowError(
                    "codebase",
                    f"the row names codebase {row_codebase!r}, but environment {env.name!r} "
                    f"always runs codebase {env.codebase!r}",
                )
            codebase = env.codebase
            how = f"environment {env.name!r} runs codebase {codebase!r}"
        else:
            if row_codebase is None:
                raise DatasetRowError(
                    "codebase",
                    f"the row has no codebase field; environment {env.name!r} takes its "
                    "codebase from the row",
                )
            codebase = row_codebase
            how = f"the row's codebase field names {codebase!r} (environment {env.name!r})"
        try:
            image = self._codebase_image(codebase)
        except UnknownCodebase as exc:
            catalogue = self.settings.codebases_file
            fix = (
                f"publish it with `orchestrator codebase publish {codebase}` and add the "
                f"printed entry to {catalogue}"
                if catalogue is not None
                else f"add it with `orchestrator codebase add {codebase} <source>`"
            )
            raise UnknownCodebase(
                f"unknown codebase {codebase!r}: {how}, but no such codebase is registered ({fix})"
            ) from exc
        return ResolvedEnvironment(env, image, codebase, self._tools[name], self.settings)

    def _at_commit(
        self,
        env: EnvironmentConfig,
        item: Mapping[str, Any],
        wanted: tuple[str, str],
        row_codebase: str | None,
        workspace: CommitWorkspace | None,
    ) -> ResolvedEnvironment:
        repo, commit = wanted
        if self.settings.sandbox_backend != "docker":
            # A pod cannot mount the commit's overlay, and no per-node cache of commits
            # exists yet for one to copy from (docs/datasets.md, "Not yet").
            raise DatasetRowError(
                "repo",
                "rows at a repository's commit need the Docker backend; this deployment "
                f"runs {self.settings.sandbox_backend} (docs/datasets.md)",
            )
        if row_codebase is not None:
            raise DatasetRowError(
                "codebase", "the row names a codebase and a repository; name one of them"
            )
        if env.codebase is not None:
            raise DatasetRowError(
                "repo",
                f"environment {env.name!r} always runs codebase {env.codebase!r}; the row "
                f"must not name a repository (it names {repo!r})",
            )
        if workspace is None or (workspace.repo, workspace.commit) != (repo, commit):
            raise UnknownRepository(f"repository {repo!r} at {commit} was not looked up")
        if workspace.setup is not None and env.image is not None:
            raise DatasetRowError(
                "repo",
                f"environment {env.name!r} runs the fixed image {env.image}, and repository "
                f"{repo!r} brings its own set-up image: name an environment without an image",
            )
        image = workspace.setup_image or env.image or self.settings.base_image
        return ResolvedEnvironment(
            env, image, workspace.label, self._tools[env.name], self.settings, workspace
        )

    def _codebase_image(self, codebase: str) -> str:
        """``codebase_image`` with positive answers remembered for a short while: the
        lookup asks the Docker daemon, and a burst of new rollouts must not ask it once
        each. Unknown names are never remembered, so a codebase added a moment ago works."""
        now = time.monotonic()
        known = self._known_codebases.get(codebase)
        if known is not None and now - known[1] < CODEBASE_CACHE_S:
            return known[0]
        image = codebase_image(self.settings, codebase)
        self._known_codebases[codebase] = (image, now)
        return image

    def for_rollout(
        self,
        name: str,
        image: str,
        codebase: str | None,
        workspace: CommitWorkspace | None = None,
    ) -> ResolvedEnvironment:
        """Environment ``name`` as configured now, on ``image``: no lookups at all."""
        if name not in self._environments:
            raise UnknownEnvironment(name, self.names(), origin="the rollout's record")
        return ResolvedEnvironment(
            self._environments[name], image, codebase, self._tools[name], self.settings, workspace
        )

    def pinned(
        self,
        digest: str,
        snapshot: Callable[[], str],
        *,
        image: str,
        codebase: str | None,
        workspace: CommitWorkspace | None = None,
    ) -> ResolvedEnvironment:
        """A rollout's environment as it was when the rollout started (its
        :attr:`~EnvironmentConfig.digest`, and ``snapshot`` giving its
        :attr:`~EnvironmentConfig.snapshot`, both kept with the rollout), whatever the
        configuration says now. ``snapshot`` is called only for a digest no configured
        environment has and none seen before, so the usual call does no I/O."""
        found = self._configured.get(digest) or self._snapshots.get(digest)
        if found is None:
            config = EnvironmentConfig.model_validate_json(snapshot())
            if config.digest != digest:
                raise ValueError(f"the snapshot of environment {config.name!r} is not {digest}")
            found = (config, _build_tools(config))
            if len(self._snapshots) >= PINNED_CACHE_MAX:
                self._snapshots.pop(next(iter(self._snapshots)))
            self._snapshots[digest] = found
        config, tools = found
        return ResolvedEnvironment(config, image, codebase, tools, self.settings, workspace)


def row_commit(item: Mapping[str, Any]) -> tuple[str, str] | None:
    """The repository and commit a row names (``"repo"`` and ``"commit"``), checked for
    form only; None when it names neither. :class:`DatasetRowError` when it names one
    without the other, or either is malformed."""
    repo, commit = item.get("repo"), item.get("commit")
    if repo is None and commit is None:
        return None
    if repo is None or commit is None:
        missing = "repo" if repo is None else "commit"
        raise DatasetRowError(missing, "a row naming a repository names its commit too")
    if not isinstance(repo, str) or not REPO_NAME_RE.fullmatch(repo):
        raise DatasetRowError(
            "repo",
            f"the row's repo field must be a registered repository's name, got {repo!r}",
        )
    try:
        return repo, check_commit(commit)
    except ValueError as exc:
        raise DatasetRowError("commit", f"the row's commit field: {exc}") from None


def _row_codebase(item: Mapping[str, Any]) -> str | None:
    value = item.get("codebase")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise DatasetRowError(
            "codebase", f"the row's codebase field must be a non-empty string, got {value!r}"
        )
    try:
        return validate_name(value)
    except InvalidCodebaseName as exc:
        raise DatasetRowError("codebase", f"the row's codebase field: {exc}") from None


def _build_tools(env: EnvironmentConfig) -> Mapping[str, Tool[Any]]:
    tools: dict[str, Tool[Any]] = {}
    for entry in env.tools:
        tool: Tool[Any]
        if isinstance(entry, str):
            tool = get_tool(entry)
        elif isinstance(entry, HttpToolConfig):
            tool = HttpTool(entry, env.secrets)
        else:
            tool = CommandTool(entry)
        tools[tool.name] = tool
    # Read-only: every rollout of the environment shares these objects.
    return MappingProxyType(tools)


# --- loading ---------------------------------------------------------------------------------


def default_environments_text() -> str:
    """The packaged default.yaml's text."""
    return (
        importlib.resources.files("orchestrator.environments")
        .joinpath(DEFAULT_FILE)
        .read_text(encoding="utf-8")
    )


def parse_environments(
    text: str, settings: Settings, *, source: str = "<string>"
) -> EnvironmentRegistry:
    """Validate environments YAML ``text``; ``source`` names it in errors.

    Raises :class:`EnvironmentConfigError` listing every problem found.
    """
    raw = _read_yaml(source, text)
    if not isinstance(raw, dict):
        raise EnvironmentConfigError(
            source, ["the file must be a mapping with an 'environments' list"]
        )
    try:
        parsed = EnvironmentsFile.model_validate(raw)
    except ValidationError as exc:
        problems = [_error_line(e, raw) for e in exc.errors(include_url=False)]
        raise EnvironmentConfigError(source, problems) from None
    problems = []
    # Limits that belong to the deployment, not to the file's schema.
    for env in parsed.environments:
        runtime = env.runtime or settings.sandbox_runtime
        if runtime == "kata" and settings.sandbox_backend != "kubernetes":
            problems.append(
                f"environment {env.name!r}.runtime: kata (a VM per sandbox) needs "
                f"ORCH_SANDBOX_BACKEND=kubernetes; this deployment runs {settings.sandbox_backend}"
            )
        if not env.egress.allows_nothing:
            if settings.sandbox_backend != "docker":
                problems.append(
                    f"environment {env.name!r}.egress: enforced by the Docker backend only; "
                    f"this deployment runs {settings.sandbox_backend} (docs/egress.md)"
                )
            elif runtime == "runsc":
                problems.append(
                    f"environment {env.name!r}.egress: needs runtime runc (gVisor sandboxes "
                    "run with no network on these hosts; docs/egress.md)"
                )
        for index, entry in enumerate(env.tools):
            if isinstance(entry, str) or entry.timeout_s is None:
                continue
            if entry.timeout_s > settings.command_timeout_max_s:
                problems.append(
                    f"environment {env.name!r}, tools[{index}] ({entry.name}).timeout_s: "
                    f"{entry.timeout_s:g} exceeds settings.command_timeout_max_s "
                    f"({settings.command_timeout_max_s:g})"
                )
    if problems:
        raise EnvironmentConfigError(source, problems)
    return EnvironmentRegistry(settings, parsed.environments, source)


def load_environments(settings: Settings) -> EnvironmentRegistry:
    """The deployment's environments: ``settings.environments_file``, or the packaged
    default.yaml when that is None. Raises :class:`EnvironmentConfigError`."""
    path: Path | None = settings.environments_file
    if path is None:
        source = f"<packaged {DEFAULT_FILE}>"
        return parse_environments(default_environments_text(), settings, source=source)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise EnvironmentConfigError(str(path), [f"cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise EnvironmentConfigError(str(path), [f"not UTF-8 text: {exc.reason}"]) from None
    return parse_environments(text, settings, source=str(path))
