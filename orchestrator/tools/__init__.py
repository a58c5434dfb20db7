"""The tools a model calls in its sandbox (``shell``, ``read_file``): argument schemas,
execution against any :class:`~orchestrator.sandbox.backend.SandboxBackend`, and output
shaping. Tools never talk HTTP and never catch
:class:`~orchestrator.sandbox.backend.SandboxError` (the caller classifies it)."""

from orchestrator.tools.base import InvalidArguments, Tool, ToolResult
from orchestrator.tools.read_file import ReadFileArgs, ReadFileTool
from orchestrator.tools.registry import (
    TOOLS,
    UnknownToolError,
    function_tool_schema,
    get_tool,
    run_tool,
    tool_names,
    tool_schemas,
)
from orchestrator.tools.shaping import clean_text, shape_capture, shape_text, truncate_middle
from orchestrator.tools.shell import ShellArgs, ShellTool

__all__ = [
    "TOOLS",
    "InvalidArguments",
    "ReadFileArgs",
    "ReadFileTool",
    "ShellArgs",
    "ShellTool",
    "Tool",
    "ToolResult",
    "UnknownToolError",
    "clean_text",
    "function_tool_schema",
    "get_tool",
    "run_tool",
    "shape_capture",
    "shape_text",
    "tool_names",
    "tool_schemas",
    "truncate_middle",
]
