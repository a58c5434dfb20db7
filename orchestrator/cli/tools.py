"""``orchestrator tools``: the tools of an environment as OpenAI function-tool schemas."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from orchestrator.config import get_settings
from orchestrator.environments.loader import load_environments


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
        config = registry.get(name)
    except LookupError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    resolved = registry.for_rollout(name, config.image or "", config.codebase)
    typer.echo(json.dumps(resolved.tool_schemas(settings, strict=strict), indent=2))
