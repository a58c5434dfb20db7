"""``orchestrator tools``: the tools of an environment as OpenAI function-tool schemas."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from orchestrator.config import Settings, get_settings
from orchestrator.environments.loader import EnvironmentRegistry, load_environments


def environment_tools(
    settings: Settings, registry: EnvironmentRegistry, name: str, *, strict: bool = False
) -> list[dict[str, Any]]:
    """Environment ``name``'s tools as OpenAI function tools (no daemon asked); LookupError
    naming the known environments when there is none of that name."""
    config = registry.get(name)
    resolved = registry.for_rollout(name, config.image or "", config.codebase)
    return resolved.tool_schemas(settings, strict=strict)


def tools(
    environment: Annotated[
        str, typer.Option(help="Environment name; default: the deployment's default.")
    ] = "",
    strict: Annotated[
        bool, typer.Option(help="Strict-mode schemas (all fields required).")
    ] = False,
) -> None:
    """Print the environment's tools as a JSON list of function tools, for a trainer's
    dataset rows or job config."""
    settings = get_settings()
    registry = load_environments(settings)
    name = environment or settings.default_environment
    try:
        schemas = environment_tools(settings, registry, name, strict=strict)
    except LookupError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(json.dumps(schemas, indent=2))
