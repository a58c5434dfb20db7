"""Environments: per-task configuration of a rollout's sandbox, tools, budget and grader.

:func:`load_environments` reads them from YAML (``settings.environments_file`` or the
packaged ``default.yaml``); :meth:`EnvironmentRegistry.resolve` turns a dataset row into a
:class:`ResolvedEnvironment`: the image to run, the tools to offer (built-ins and
:class:`CommandTool` custom tools) and the sandbox spec.
"""

from orchestrator.environments.custom_tool import CommandArgs, CommandTool, render_value
from orchestrator.environments.examples import (
    FINQA_CODEBASE,
    ensure_finqa_corpus,
    finqa_example_dir,
)
from orchestrator.environments.loader import (
    DatasetRowError,
    EnvironmentConfigError,
    EnvironmentRegistry,
    ResolvedEnvironment,
    UnknownEnvironment,
    default_environments_text,
    load_environments,
    parse_environments,
)
from orchestrator.environments.models import (
    TOOL_NAME_PATTERN,
    CustomToolConfig,
    EnvironmentConfig,
    EnvironmentLimits,
    EnvironmentsFile,
    GraderConfig,
    parse_template,
)

__all__ = [
    "FINQA_CODEBASE",
    "TOOL_NAME_PATTERN",
    "CommandArgs",
    "CommandTool",
    "CustomToolConfig",
    "DatasetRowError",
    "EnvironmentConfig",
    "EnvironmentConfigError",
    "EnvironmentLimits",
    "EnvironmentRegistry",
    "EnvironmentsFile",
    "GraderConfig",
    "ResolvedEnvironment",
    "UnknownEnvironment",
    "default_environments_text",
    "ensure_finqa_corpus",
    "finqa_example_dir",
    "load_environments",
    "parse_environments",
    "parse_template",
    "render_value",
]
