"""``orchestrator config docs``: docs/configuration.md, generated from the models themselves
(``Settings``, the environment models and the tenants file's), so the page cannot drift
from the code.
tests/test_config_docs.py fails when the committed page differs from what this prints."""

from __future__ import annotations

import json
import types
import typing
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from orchestrator.config import Settings
from orchestrator.environments.models import (
    CustomToolConfig,
    E2BOptions,
    EnvironmentConfig,
    EnvironmentLimits,
    GraderConfig,
    HttpToolConfig,
    PromptTemplate,
    SetupStep,
)
from orchestrator.sandbox.backend import ScratchDir
from orchestrator.sandbox.egress import EgressPolicy
from orchestrator.secrets import SecretSource
from orchestrator.tenants import Quotas, TenantConfig

app = typer.Typer(help="The deployment's configuration.", no_args_is_help=True)

DOC_PATH = Path("docs/configuration.md")
REGENERATE = "orchestrator config docs --out docs/configuration.md"

_BOUNDS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))

_INTRO = f"""# Configuration

Generated from the code by `{REGENERATE}`; do not edit by hand
(`tests/test_config_docs.py` fails when this page and the code differ).

Two places configure a deployment: **settings**, one per deployment, read from `ORCH_*`
environment variables (`orchestrator/config.py`), and **environments**, the YAML file
`ORCH_ENVIRONMENTS_FILE` names (default: `orchestrator/environments/default.yaml`), which
says what each kind of rollout runs (`orchestrator/environments/models.py`).
"""


def type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: ``int``, ``str | None``, ``list[str]``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join(type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if annotation is type(None):
        return "None"
    if annotation is Ellipsis:  # tuple[X, ...]
        return "..."
    return str(getattr(annotation, "__name__", annotation))


def default_text(field: FieldInfo) -> str:
    """The field's default as a reader needs it (never a value of this machine)."""
    if field.default_factory is not None:
        factory = field.default_factory
        name = getattr(factory, "__name__", "")
        # A named function computes a value of the machine (gethostname); a class or a
        # lambda builds a constant.
        if not isinstance(factory, type) and name != "<lambda>":
            return f"computed: `{name}()`"
        value = factory()  # type: ignore[call-arg]
        return "(see below)" if isinstance(value, BaseModel) else _value(value)
    if field.default is PydanticUndefined:
        return "required"
    if field.default is None:
        return "unset"
    return _value(field.default)


def _value(value: Any) -> str:
    if value == "":
        return "empty"
    if isinstance(value, dict | list):
        return f"`{json.dumps(value)}`"
    return f"`{value}`"


def constraints(field: FieldInfo) -> str:
    """Bounds and patterns pydantic enforces on the field."""
    found: list[str] = []
    for meta in field.metadata:
        for attr, sign in _BOUNDS:
            value = getattr(meta, attr, None)
            if value is not None:
                found.append(f"{sign} {value}")
        for attr, word in (("min_length", "min length"), ("max_length", "max length")):
            value = getattr(meta, attr, None)
            if value is not None:
                found.append(f"{word} {value}")
        pattern = getattr(meta, "pattern", None)
        if pattern is not None:
            found.append(f"matches `{pattern}`")
    return ", ".join(found)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _row(first: str, field: FieldInfo) -> str:
    kind = type_name(field.annotation)
    limits = constraints(field)
    description = (field.description or "").strip()
    return (
        f"| {first} | {_cell(kind)} | {_cell(default_text(field))} | "
        f"{_cell(limits)} | {_cell(description)} |"
    )


_HEADER = "| {} | type | default | constraints | description |\n|---|---|---|---|---|"


def settings_section() -> str:
    prefix = str(Settings.model_config.get("env_prefix", ""))
    lines = [
        "## Settings",
        "",
        "Each field is the environment variable of its name, upper case, with the "
        f"`{prefix}` prefix (case-insensitive).",
        "",
        _HEADER.format("variable"),
    ]
    for name, field in Settings.model_fields.items():
        lines.append(_row(f"`{prefix}{name.upper()}`", field))
    return "\n".join(lines) + "\n"


def model_section(title: str, intro: str, model: type[BaseModel], key_prefix: str) -> str:
    lines = [f"## {title}", "", intro, "", _HEADER.format("key")]
    for name, field in model.model_fields.items():
        lines.append(_row(f"`{key_prefix}{name}`", field))
    return "\n".join(lines) + "\n"


def configuration_markdown() -> str:
    """The whole of docs/configuration.md."""
    sections = [
        _INTRO,
        settings_section(),
        model_section(
            "Environments",
            "The environments file is `environments:`, a list of these. Fields left out take "
            "the deployment's settings when a rollout is resolved.",
            EnvironmentConfig,
            "",
        ),
        model_section(
            "Environment limits",
            "`limits:` of an environment; each one left out takes the deployment's "
            "`ORCH_SANDBOX_*` setting.",
            EnvironmentLimits,
            "limits.",
        ),
        model_section(
            "Grader",
            "`grader:` of an environment: a grader's name (or dotted path) and its options.",
            GraderConfig,
            "grader.",
        ),
        model_section(
            "Prompt",
            "`prompt:` of an environment: how `orchestrator rft-config --dataset` makes an "
            "Agent RFT row's `messages` from its fields ({field}; see docs/agent-rft.md).",
            PromptTemplate,
            "prompt.",
        ),
        model_section(
            "Set-up step",
            "`setup:` of an environment: run once per group of rollouts in a sandbox of its "
            "own, snapshotted, and the group's sandboxes made from the snapshot "
            "(docs/snapshots.md).",
            SetupStep,
            "setup.",
        ),
        model_section(
            "Scratch directories",
            "An entry of `scratch_dirs:` of an environment: an empty writable directory at a "
            "fixed path, the sandbox user's, in memory, gone with the sandbox.",
            ScratchDir,
            "scratch_dirs[].",
        ),
        model_section(
            "E2B",
            "`e2b:` of an environment: how the E2B-compatible API serves its sandboxes "
            "(docs/e2b.md).",
            E2BOptions,
            "e2b.",
        ),
        model_section(
            "Egress",
            "`egress:` of an environment: where its sandboxes may connect, nowhere by "
            "default (docs/egress.md).",
            EgressPolicy,
            "egress.",
        ),
        model_section(
            "Custom tools",
            "An entry of `tools:` is a built-in tool's name (`shell`, `read_file`) or a custom "
            "tool: one fixed program whose argv placeholders take the model's arguments.",
            CustomToolConfig,
            "tools[].",
        ),
        model_section(
            "HTTP tools",
            "An entry of `tools:` with a `url` is an HTTP tool: its call goes to the "
            "operator's own service, outside the sandbox (docs/tenancy.md).",
            HttpToolConfig,
            "tools[].",
        ),
        model_section(
            "Secrets",
            "An entry of `secrets:` of an environment (`secrets.<NAME>`): where the secret "
            "is read, each time a tool uses it.",
            SecretSource,
            "secrets.<NAME>.",
        ),
        model_section(
            "Tenants",
            "The tenants file (`ORCH_TENANTS_FILE`) is `tenants:`, a map of a tenant's name "
            "([a-z0-9-]) to these (docs/tenancy.md).",
            TenantConfig,
            "tenants.<name>.",
        ),
        model_section(
            "Tenant quotas",
            "`quotas:` of a tenant: its share of the deployment; each left out: no bound of "
            "its own.",
            Quotas,
            "tenants.<name>.quotas.",
        ),
    ]
    return "\n".join(sections)


@app.command("docs")
def docs(
    out: Annotated[
        Path | None, typer.Option(dir_okay=False, help="Write here instead of printing.")
    ] = None,
    check: Annotated[
        bool, typer.Option("--check", help="Exit 1 if --out differs from what would be written.")
    ] = False,
) -> None:
    """Print (or write) the configuration reference: every setting and environment field
    with its environment variable or key, type, default, constraints and description."""
    text = configuration_markdown()
    if out is None:
        typer.echo(text, nl=False)
        return
    if check:
        current = out.read_text(encoding="utf-8") if out.exists() else ""
        if current != text:
            typer.echo(f"{out} is out of date: run `{REGENERATE}`", err=True)
            raise typer.Exit(1)
        return
    out.write_text(text, encoding="utf-8")
