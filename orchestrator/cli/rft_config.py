"""``orchestrator rft-config``: the pieces of an OpenAI Agent RFT job that point at this
deployment (see /work/shared/PROTOCOL.md for the wire format).

- ``tools``: the job-level list, one ``{"name", "server_url", "headers"}`` per tool of the
  environment; every tool shares ``/agent-rft/tools`` (the server dispatches on the body's
  ``name``).
- ``row_tools``: the function schemas each dataset row carries in its ``tools`` field (the
  reinforcement training format: ``{"type": "function", "function": {...}}``).
- ``grader``: the ``endpoint`` grader block for ``/agent-rft/grade``.

With ``--dataset IN --out OUT`` each row of IN is checked the way the server will resolve
it (environment, codebase: an unknown codebase fails every call of its rollouts) and
written to OUT with its environment's ``row_tools``. Any bad row is an error naming its
line, and OUT is then not written at all.
"""

from __future__ import annotations

import json
import os
import tempfile
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import typer
import yaml
from pydantic import BaseModel, Field

from orchestrator.cli.tools import environment_tools
from orchestrator.config import Settings, get_settings
from orchestrator.environments.loader import EnvironmentRegistry, load_environments
from orchestrator.sandbox.backend import BackendUnavailable

TOKEN_PLACEHOLDER = "<API_TOKEN>"  # noqa: S105 - a placeholder to fill in, no secret
TOOLS_PATH = "/agent-rft/tools"
GRADE_PATH = "/agent-rft/grade"


class JobTool(BaseModel):
    """One entry of the job's ``tools`` list."""

    name: str
    server_url: str
    headers: dict[str, str]


class EndpointGrader(BaseModel):
    """The job's ``grader``: Agent RFT's endpoint grader, pointed at this deployment."""

    type: Literal["endpoint"] = "endpoint"
    name: str = "orchestrator"
    url: str
    headers: dict[str, str]
    rate_limit: int | None = Field(None, description="Grade requests per second at most.")
    pass_threshold: float


class RftConfig(BaseModel):
    """What ``orchestrator rft-config`` prints."""

    environment: str
    tools: list[JobTool]
    grader: EndpointGrader
    row_tools: list[dict[str, Any]] = Field(
        description="The dataset rows' ``tools`` field (rft-config --dataset adds it)."
    )


class OutputFormat(StrEnum):
    JSON = "json"
    YAML = "yaml"


class DatasetError(Exception):
    """A dataset row that the server would refuse; the message names its line."""


def row_tool(schema: dict[str, Any]) -> dict[str, Any]:
    """A function tool (``orchestrator tools``' shape) in a training row's shape."""
    fields = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: schema[k] for k in fields if k in schema}}


def check_base_url(base_url: str) -> str:
    """The public base URL without a trailing slash; ValueError if it is no http(s) URL."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--base-url must be an http(s) URL, got {base_url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"--base-url must not carry a query or fragment: {base_url!r}")
    return base_url.rstrip("/")


def build_config(
    settings: Settings,
    registry: EnvironmentRegistry,
    *,
    base_url: str,
    environment: str,
    token: str,
    pass_threshold: float,
    rate_limit: int | None,
) -> RftConfig:
    """The job's pieces for ``environment``'s tools. LookupError: no such environment."""
    headers = {"Authorization": f"Bearer {token}"}
    schemas = environment_tools(settings, registry, environment)
    return RftConfig(
        environment=environment,
        tools=[
            JobTool(name=s["name"], server_url=base_url + TOOLS_PATH, headers=headers)
            for s in schemas
        ],
        grader=EndpointGrader(
            url=base_url + GRADE_PATH,
            headers=headers,
            rate_limit=rate_limit,
            pass_threshold=pass_threshold,
        ),
        row_tools=[row_tool(s) for s in schemas],
    )


def rewrite_dataset(
    settings: Settings,
    registry: EnvironmentRegistry,
    source: Path,
    *,
    environment: str | None,
) -> list[dict[str, Any]]:
    """The rows of ``source`` (JSONL), each with its environment's tool schemas as
    ``tools``; rows naming no environment get ``environment`` when it is given. Raises
    :class:`DatasetError` on the first bad row."""
    rows: list[dict[str, Any]] = []
    schemas: dict[str, list[dict[str, Any]]] = {}
    with source.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{source}:{number}"
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise DatasetError(f"{where}: not JSON: {exc}") from None
            if not isinstance(row, dict):
                raise DatasetError(
                    f"{where}: a row must be a JSON object, got {type(row).__name__}"
                )
            if environment is not None and row.get("environment") is None:
                row["environment"] = environment
            try:
                resolved = registry.resolve(row)
            except BackendUnavailable as exc:
                raise DatasetError(
                    f"{where}: cannot check the row's codebase, the Docker daemon is "
                    f"unreachable: {exc}"
                ) from None
            except (LookupError, ValueError) as exc:
                raise DatasetError(f"{where}: {exc}") from None
            name = resolved.environment.name
            if name not in schemas:
                schemas[name] = [row_tool(s) for s in environment_tools(settings, registry, name)]
            rows.append({**row, "tools": schemas[name]})
    if not rows:
        raise DatasetError(f"{source}: no rows")
    return rows


def write_jsonl(rows: list[dict[str, Any]], out: Path) -> None:
    """Write ``rows`` to ``out`` whole or not at all (a temporary file, then a rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        Path(tmp).replace(out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def rft_config(
    base_url: Annotated[
        str, typer.Option(help="The public base URL the trainer reaches this API at.")
    ],
    environment: Annotated[
        str, typer.Option(help="Environment whose tools to offer; default: the deployment's.")
    ] = "",
    token_env: Annotated[
        str,
        typer.Option(
            help="Put the token from this environment variable in the headers (default: a "
            f"{TOKEN_PLACEHOLDER} placeholder to fill in)."
        ),
    ] = "",
    pass_threshold: Annotated[float, typer.Option(help="The grader's pass threshold.")] = 0.5,
    rate_limit: Annotated[
        int | None, typer.Option(min=1, help="The grader's rate limit (requests per second).")
    ] = None,
    dataset: Annotated[
        Path | None, typer.Option(exists=True, dir_okay=False, help="A JSONL dataset to extend.")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(dir_okay=False, help="Where --dataset's rows are written.")
    ] = None,
    output_format: Annotated[
        OutputFormat, typer.Option("--format", help="How to print the job config.")
    ] = OutputFormat.JSON,
) -> None:
    """Print an Agent RFT job's tools list, the dataset rows' tool schemas and the endpoint
    grader for this deployment; with --dataset/--out, add the tool schemas to every row."""
    settings = get_settings()
    registry = load_environments(settings)
    if (dataset is None) != (out is None):
        typer.echo("error: --dataset and --out go together", err=True)
        raise typer.Exit(2)
    token = TOKEN_PLACEHOLDER
    if token_env:
        token = os.environ.get(token_env, "")
        if not token:
            typer.echo(f"error: environment variable {token_env} is not set or empty", err=True)
            raise typer.Exit(2)
    try:
        config = build_config(
            settings,
            registry,
            base_url=check_base_url(base_url),
            environment=environment or settings.default_environment,
            token=token,
            pass_threshold=pass_threshold,
            rate_limit=rate_limit,
        )
    except (LookupError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if dataset is not None and out is not None:
        try:
            rows = rewrite_dataset(settings, registry, dataset, environment=environment or None)
        except DatasetError as exc:
            typer.echo(f"error: {exc}; {out} not written", err=True)
            raise typer.Exit(1) from exc
        write_jsonl(rows, out)
        typer.echo(f"wrote {len(rows)} rows to {out}", err=True)
    data = config.model_dump(mode="json", exclude_none=True)
    if output_format == OutputFormat.YAML:
        typer.echo(yaml.safe_dump(data, sort_keys=False), nl=False)
    else:
        typer.echo(json.dumps(data, indent=2))
