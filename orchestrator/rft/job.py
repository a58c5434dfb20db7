"""The body of an Agent RFT fine-tuning job (``POST /v1/fine_tuning/jobs``), pointed at this
deployment: ``method.reinforcement`` with the job-level ``tools`` (one entry per tool, all
on ``/agent-rft/tools``), the ``endpoint`` grader, ``max_episode_steps`` agreeing with the
environment's tool-call budget, and the hyperparameters given. Pure: no I/O.

The shapes are the platform's, as docs/agent-rft.md sources them.
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field

from orchestrator.environments.models import EnvironmentConfig

TOOLS_PATH = "/agent-rft/tools"
GRADE_PATH = "/agent-rft/grade"


class JobTool(BaseModel):
    """One entry of ``method.reinforcement.tools``: where the platform posts its calls."""

    name: str
    server_url: str
    headers: dict[str, str]


class EndpointGrader(BaseModel):
    """``method.reinforcement.grader``: the endpoint grader, pointed at this deployment."""

    type: Literal["endpoint"] = "endpoint"
    name: str = "orchestrator"
    url: str
    headers: dict[str, str] = Field(default_factory=dict)
    rate_limit: int | None = Field(None, description="Grade requests per second at most.")
    pass_threshold: float


class Hyperparameters(BaseModel):
    """``method.reinforcement.hyperparameters``: only what is given is sent."""

    model_config = ConfigDict(extra="forbid")

    reasoning_effort: Literal["low", "medium", "high"] | None = None
    compute_multiplier: float | None = Field(None, gt=0)
    eval_interval: int | None = Field(None, ge=1)
    eval_samples: int | None = Field(None, ge=1)
    n_epochs: int | None = Field(None, ge=1)
    batch_size: int | None = Field(None, ge=1)
    learning_rate_multiplier: float | None = Field(None, gt=0)


class Reinforcement(BaseModel):
    tools: list[JobTool]
    grader: EndpointGrader
    max_episode_steps: int = Field(ge=1)
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)
    response_format: dict[str, Any] | None = None


class Method(BaseModel):
    type: Literal["reinforcement"] = "reinforcement"
    reinforcement: Reinforcement


class JobBody(BaseModel):
    """What ``client.fine_tuning.jobs.create(**body)`` takes."""

    model: str
    training_file: str
    validation_file: str | None = None
    suffix: str | None = None
    method: Method


def check_base_url(base_url: str) -> str:
    """The public base URL without a trailing slash; ValueError if it is no http(s) URL."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--base-url must be an http(s) URL, got {base_url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"--base-url must not carry a query or fragment: {base_url!r}")
    return base_url.rstrip("/")


def episode_steps(environment: EnvironmentConfig, wanted: int | None) -> int:
    """``max_episode_steps`` for ``environment``: its tool-call budget unless ``wanted``.
    ValueError when they disagree: steps past the budget would be spent on calls the
    orchestrator refuses (budget_exhausted), and with no budget the job must say."""
    budget = environment.tool_call_budget
    if wanted is None:
        if budget is None:
            raise ValueError(
                f"environment {environment.name!r} has no tool_call_budget: give "
                "--max-episode-steps (or set the budget)"
            )
        return budget
    if budget is not None and wanted > budget:
        raise ValueError(
            f"--max-episode-steps {wanted} exceeds environment {environment.name!r}'s "
            f"tool_call_budget of {budget}: calls past the budget are refused, so the steps "
            "past it are wasted; lower it or raise the budget"
        )
    return wanted


def build_job(
    environment: EnvironmentConfig,
    tool_names: list[str],
    *,
    base_url: str,
    token: str,
    grader_secret: str | None,
    pass_threshold: float,
    rate_limit: int | None,
    max_episode_steps: int | None,
    model: str,
    training_file: str,
    validation_file: str | None = None,
    suffix: str | None = None,
    hyperparameters: Hyperparameters | None = None,
) -> JobBody:
    """The job body for ``environment``'s tools at ``base_url``. ``grader_secret``: reach
    the grader through the deployment's secret path, without a header (Azure's endpoint
    grader sends none); None: the bearer token in its headers."""
    base = check_base_url(base_url)
    headers = {"Authorization": f"Bearer {token}"}
    if grader_secret is None:
        grader = EndpointGrader(
            url=base + GRADE_PATH,
            headers=headers,
            rate_limit=rate_limit,
            pass_threshold=pass_threshold,
        )
    else:
        grader = EndpointGrader(
            url=f"{base}{GRADE_PATH}/{grader_secret}",
            rate_limit=rate_limit,
            pass_threshold=pass_threshold,
        )
    return JobBody(
        model=model,
        training_file=training_file,
        validation_file=validation_file,
        suffix=suffix,
        method=Method(
            reinforcement=Reinforcement(
                tools=[
                    JobTool(name=name, server_url=base + TOOLS_PATH, headers=headers)
                    for name in tool_names
                ],
                grader=grader,
                max_episode_steps=episode_steps(environment, max_episode_steps),
                hyperparameters=hyperparameters or Hyperparameters(),
            )
        ),
    )
