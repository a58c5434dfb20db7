"""The tools the model can call, by name, and their schemas for trainer configs."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from orchestrator.config import Settings, get_settings
from orchestrator.sandbox.backend import SandboxBackend, SandboxHandle
from orchestrator.tools.base import Tool, ToolResult, agent_error
from orchestrator.tools.read_file import ReadFileTool
from orchestrator.tools.shell import ShellTool

TOOLS: Mapping[str, Tool[Any]] = MappingProxyType(
    {tool.name: tool for tool in (ShellTool(), ReadFileTool())}
)
"""Every tool, by name, in the order they are offered to the model."""


class UnknownToolError(KeyError):
    """No tool has this name."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name
        self.message = f"unknown tool {name!r}; available tools: {', '.join(TOOLS)}"

    def __str__(self) -> str:
        return self.message


def get_tool(name: str) -> Tool[Any]:
    """The tool called ``name``; raises :class:`UnknownToolError` (a KeyError)."""
    try:
        return TOOLS[name]
    except KeyError:
        raise UnknownToolError(name) from None


def tool_names() -> list[str]:
    """Names of every tool."""
    return list(TOOLS)


def run_tool(
    name: str,
    backend: SandboxBackend,
    handle: SandboxHandle,
    arguments: dict[str, Any] | str | None,
    settings: Settings,
) -> ToolResult:
    """Run tool ``name``; an unknown name is the agent's mistake (``unknown_tool``).

    :class:`~orchestrator.sandbox.backend.SandboxError` propagates, as from
    :meth:`Tool.run`.
    """
    try:
        tool = get_tool(name)
    except UnknownToolError as exc:
        return agent_error(exc.message, "unknown_tool", budget=settings.output_budget_bytes)
    return tool.run(backend, handle, arguments, settings)


def function_tool_schema(
    tool: Tool[Any], settings: Settings, *, strict: bool = False
) -> dict[str, Any]:
    """One tool as an OpenAI Responses-API function tool:
    ``{"type": "function", "name", "description", "parameters", "strict"}``.

    With ``strict=False`` (the default) the parameters carry every constraint (lengths,
    bounds) for the model to read; with ``strict=True`` they take the shape strict mode
    demands (see :meth:`Tool.parameters_schema`).
    """
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters_schema(settings, strict=strict),
        "strict": strict,
    }


def tool_schemas(settings: Settings | None = None, *, strict: bool = False) -> list[dict[str, Any]]:
    """Every tool as a function tool, for a trainer's config; ``settings`` default to the
    process's (they set the timeout's default and maximum)."""
    settings = settings if settings is not None else get_settings()
    return [function_tool_schema(tool, settings, strict=strict) for tool in TOOLS.values()]
