"""``orchestrator tools`` prints the environments' tools as function-tool schemas."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from orchestrator.cli import app


def test_tools_of_the_default_environment() -> None:
    result = CliRunner().invoke(app, ["tools"])
    assert result.exit_code == 0, result.output
    tools = json.loads(result.stdout)
    assert [t["name"] for t in tools] == ["shell", "read_file"]
    for tool in tools:
        assert tool["type"] == "function"
        assert tool["parameters"]["type"] == "object"
        assert tool["parameters"]["additionalProperties"] is False


def test_tools_of_a_configured_environment_in_strict_mode() -> None:
    result = CliRunner().invoke(app, ["tools", "--environment", "finqa-demo", "--strict"])
    assert result.exit_code == 0, result.output
    tools = {t["name"]: t for t in json.loads(result.stdout)}
    assert set(tools) == {"search", "list", "cat"}
    assert all(t["strict"] is True for t in tools.values())
    for tool in tools.values():
        params = tool["parameters"]
        assert sorted(params["required"]) == sorted(params["properties"])


def test_unknown_environment_is_an_error_naming_it() -> None:
    result = CliRunner().invoke(app, ["tools", "--environment", "nope"])
    assert result.exit_code == 2
    assert "nope" in result.output and "codebase-planning" in result.output
