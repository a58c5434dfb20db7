"""``orchestrator rft-config``: an Agent RFT job that points at this deployment
(docs/agent-rft.md), as the job body the platform takes (``orchestrator.rft.job``), and
with ``--dataset IN --out OUT`` the dataset rows it takes (``orchestrator.rft.dataset``):
each row checked the way the server will resolve it, given ``messages`` from its
environment's prompt when it has none and its tools' schemas as ``tools``. Any bad row is
an error naming its ``file:line``, and OUT is then not written at all.
"""

from __future__ import annotations

import json
import os
from enum import StrEnum
from pathlib import Path
from typing import Annotated, NoReturn

import typer
import yaml

from orchestrator.cli.tools import environment_tools
from orchestrator.config import get_settings
from orchestrator.environments.loader import load_environments
from orchestrator.environments.models import EnvironmentConfig
from orchestrator.rft.dataset import MIN_ROWS, DatasetError, rewrite_dataset, write_jsonl
from orchestrator.rft.job import Hyperparameters, build_job
from orchestrator.rollouts.bounds import agent_rft_settings

TOKEN_PLACEHOLDER = "<API_TOKEN>"  # noqa: S105 - a placeholder to fill in, no secret
MODEL_PLACEHOLDER = "<MODEL>"
TRAINING_FILE_PLACEHOLDER = "<TRAINING_FILE_ID>"


class OutputFormat(StrEnum):
    JSON = "json"
    YAML = "yaml"


class GraderAuth(StrEnum):
    HEADER = "header"
    """The bearer token in the grader's headers (the default)."""
    PATH = "path"
    """The deployment's secret path segment, no header (ORCH_GRADER_URL_SECRET)."""


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
    grader_auth: Annotated[
        GraderAuth,
        typer.Option(
            help="header: the token in the grader's headers; path: the deployment's secret "
            "path (ORCH_GRADER_URL_SECRET), for a platform whose grader sends no header."
        ),
    ] = GraderAuth.HEADER,
    pass_threshold: Annotated[float, typer.Option(help="The grader's pass threshold.")] = 0.5,
    rate_limit: Annotated[
        int | None, typer.Option(min=1, help="The grader's rate limit (requests per second).")
    ] = None,
    max_episode_steps: Annotated[
        int | None,
        typer.Option(min=1, help="Default: the environment's tool_call_budget (never above)."),
    ] = None,
    model: Annotated[str, typer.Option(help="The model to fine-tune.")] = MODEL_PLACEHOLDER,
    training_file: Annotated[
        str, typer.Option(help="The uploaded training file's id.")
    ] = TRAINING_FILE_PLACEHOLDER,
    validation_file: Annotated[
        str | None, typer.Option(help="The uploaded validation file's id.")
    ] = None,
    suffix: Annotated[str | None, typer.Option(help="The fine-tuned model's suffix.")] = None,
    reasoning_effort: Annotated[str | None, typer.Option(help="low, medium or high.")] = None,
    n_epochs: Annotated[int | None, typer.Option(min=1)] = None,
    batch_size: Annotated[int | None, typer.Option(min=1)] = None,
    compute_multiplier: Annotated[float | None, typer.Option(min=0)] = None,
    eval_interval: Annotated[int | None, typer.Option(min=1)] = None,
    eval_samples: Annotated[int | None, typer.Option(min=1)] = None,
    dataset: Annotated[
        Path | None, typer.Option(exists=True, dir_okay=False, help="A JSONL dataset to extend.")
    ] = None,
    out: Annotated[
        Path | None, typer.Option(dir_okay=False, help="Where --dataset's rows are written.")
    ] = None,
    output_format: Annotated[
        OutputFormat, typer.Option("--format", help="How to print the job body.")
    ] = OutputFormat.JSON,
) -> None:
    """Print the body of an Agent RFT job for this deployment (method.reinforcement: tools,
    grader, max_episode_steps, hyperparameters); with --dataset/--out, write the dataset's
    rows as the platform takes them (messages, tools, and the item)."""
    settings = get_settings()
    registry = load_environments(settings)
    # The schemas the model sees say what Agent RFT's calls may do: capped command timeouts.
    rft_settings = agent_rft_settings(settings)
    if (dataset is None) != (out is None):
        _fail("--dataset and --out go together")
    token = TOKEN_PLACEHOLDER
    if token_env:
        token = os.environ.get(token_env, "")
        if not token:
            _fail(f"environment variable {token_env} is not set or empty")
    secret = None
    if grader_auth == GraderAuth.PATH:
        secret = settings.grader_url_secret
        if not secret:
            _fail("--grader-auth path needs the deployment's ORCH_GRADER_URL_SECRET")
    name = environment or settings.default_environment
    try:
        tools = environment_tools(rft_settings, registry, name)
        job = build_job(
            registry.get(name),
            [t["name"] for t in tools],
            base_url=base_url,
            token=token,
            grader_secret=secret,
            pass_threshold=pass_threshold,
            rate_limit=rate_limit,
            max_episode_steps=max_episode_steps,
            model=model,
            training_file=training_file,
            validation_file=validation_file,
            suffix=suffix,
            hyperparameters=Hyperparameters.model_validate(
                {
                    "reasoning_effort": reasoning_effort,
                    "n_epochs": n_epochs,
                    "batch_size": batch_size,
                    "compute_multiplier": compute_multiplier,
                    "eval_interval": eval_interval,
                    "eval_samples": eval_samples,
                }
            ),
        )
    except (LookupError, ValueError) as exc:
        _fail(str(exc))
    if dataset is not None and out is not None:
        try:
            rows = rewrite_dataset(
                registry,
                dataset,
                environment=environment or None,
                tools_of=lambda env: environment_tools(rft_settings, registry, env),
            )
        except DatasetError as exc:
            typer.echo(f"error: {exc}; {out} not written", err=True)
            raise typer.Exit(1) from exc
        write_jsonl(rows, out)
        typer.echo(f"wrote {len(rows)} rows to {out}", err=True)
        if len(rows) < MIN_ROWS:
            typer.echo(
                f"warning: {len(rows)} rows; the platform's samples ask for at least "
                f"{MIN_ROWS} per file",
                err=True,
            )
    _concurrency_hint(registry.get(name), batch_size)
    data = job.model_dump(mode="json", exclude_none=True)
    if output_format == OutputFormat.YAML:
        typer.echo(yaml.safe_dump(data, sort_keys=False), nl=False)
    else:
        typer.echo(json.dumps(data, indent=2))


def _concurrency_hint(env: EnvironmentConfig, batch_size: int | None) -> None:
    """A job's batch size is the least number of rollouts each training step starts at
    once (the platform samples one or more per prompt): a pool sized below it leaves the
    first step's burst to cold starts (docs/operations.md, Scale)."""
    if batch_size is None or env.expected_concurrency >= batch_size:
        return
    typer.echo(
        f"note: a batch of {batch_size} starts at least {batch_size} rollouts at each step; "
        f"environment {env.name!r} declares expected_concurrency {env.expected_concurrency}, "
        f"so the first step's rollouts start cold: set `expected_concurrency: "
        f"{batch_size}` (times the samples per prompt, if known) to have them ready",
        err=True,
    )


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)
