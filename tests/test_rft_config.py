"""``orchestrator rft-config``: the Agent RFT job's pieces in PROTOCOL.md's shapes, and a
dataset rewritten with its tool schemas, checked against the real environments and a real
codebase image (a bad row is an error naming its line, and no output is written)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner, Result

from orchestrator.cli import app
from orchestrator.config import get_settings
from orchestrator.images.base import BaseBuildResult
from orchestrator.images.codebases import add_codebase, remove_codebase

BASE = "https://rft.example.com/orch"


@pytest.fixture(scope="module")
def codebase(base: BaseBuildResult, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A small codebase image, registered where the CLI's settings (the process's) look."""
    tree = tmp_path_factory.mktemp("tree")
    (tree / "README.md").write_text("hello\n")
    name = f"rft-config-{uuid.uuid4().hex[:8]}"
    add_codebase(get_settings(), name, tree)
    try:
        yield name
    finally:
        remove_codebase(get_settings(), name)


def run(*args: str, **env: str) -> Result:
    """``orchestrator rft-config --base-url BASE ARGS`` with ``env`` set."""
    return CliRunner().invoke(app, ["rft-config", "--base-url", BASE, *args], env=env or None)


def test_job_config_has_protocol_shapes() -> None:
    result = run()
    assert result.exit_code == 0, result.output
    config = json.loads(result.stdout)
    assert config["environment"] == get_settings().default_environment
    assert [t["name"] for t in config["tools"]] == ["shell", "read_file"]
    for tool in config["tools"]:
        # PROTOCOL.md: each tool is {"name", "server_url", "headers"}; one URL serves all.
        assert set(tool) == {"name", "server_url", "headers"}
        assert tool["server_url"] == f"{BASE}/agent-rft/tools"
        assert tool["headers"] == {"Authorization": "Bearer <API_TOKEN>"}
    grader = config["grader"]
    assert set(grader) <= {"type", "name", "url", "headers", "rate_limit", "pass_threshold"}
    assert grader["type"] == "endpoint"
    assert grader["url"] == f"{BASE}/agent-rft/grade"
    assert grader["headers"] == {"Authorization": "Bearer <API_TOKEN>"}
    assert grader["pass_threshold"] == 0.5
    # The rows' schemas are `orchestrator tools`' schemas, in the training format's shape.
    flat = json.loads(CliRunner().invoke(app, ["tools"]).stdout)
    assert config["row_tools"] == [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in flat
    ]


def test_token_from_environment_rate_limit_and_yaml() -> None:
    result = run(
        "--environment",
        "finqa-demo",
        "--token-env",
        "MY_TOKEN",
        "--rate-limit",
        "20",
        "--pass-threshold",
        "0.8",
        "--format",
        "yaml",
        MY_TOKEN="s3cret",
    )
    assert result.exit_code == 0, result.output
    config = yaml.safe_load(result.stdout)
    assert config["environment"] == "finqa-demo"
    assert {t["name"] for t in config["tools"]} == {"search", "list", "cat"}
    assert all(t["headers"] == {"Authorization": "Bearer s3cret"} for t in config["tools"])
    assert config["grader"]["rate_limit"] == 20 and config["grader"]["pass_threshold"] == 0.8
    assert {t["function"]["name"] for t in config["row_tools"]} == {"search", "list", "cat"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--environment", "nope"], "unknown environment 'nope'"),
        (["--token-env", "ORCH_TEST_UNSET_TOKEN"], "ORCH_TEST_UNSET_TOKEN is not set"),
    ],
)
def test_bad_options_are_errors(args: list[str], message: str) -> None:
    result = run(*args)
    assert result.exit_code == 2
    assert message in result.output


def test_base_url_must_be_http() -> None:
    result = CliRunner().invoke(app, ["rft-config", "--base-url", "rft.example.com"])
    assert result.exit_code == 2 and "http(s) URL" in result.output


def test_dataset_rows_get_their_tool_schemas(codebase: str, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    rows = [
        {
            "codebase": codebase,
            "gold_files": ["README.md"],
            "messages": [{"role": "user", "content": "q"}],
        },
        {"environment": "finqa-demo", "question": "what?", "answer": "1"},
    ]
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    out = tmp_path / "sub" / "out.jsonl"
    result = run("--dataset", str(source), "--out", str(out))
    assert result.exit_code == 0, result.output
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(written) == 2
    for before, after in zip(rows, written, strict=True):
        assert {k: v for k, v in after.items() if k != "tools"} == before
    assert [t["function"]["name"] for t in written[0]["tools"]] == ["shell", "read_file"]
    assert {t["function"]["name"] for t in written[1]["tools"]} == {"search", "list", "cat"}
    assert all(t["type"] == "function" for row in written for t in row["tools"])
    assert json.loads(result.stdout)["tools"][0]["name"] == "shell"


def test_environment_option_is_written_into_rows_that_name_none(
    codebase: str, tmp_path: Path
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"question": "q"}) + "\n")
    out = tmp_path / "out.jsonl"
    result = run("--environment", "finqa-demo", "--dataset", str(source), "--out", str(out))
    assert result.exit_code == 0, result.output
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["environment"] == "finqa-demo"
    assert {t["function"]["name"] for t in row["tools"]} == {"search", "list", "cat"}


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({"gold_files": []}), "no codebase field"),
        (
            json.dumps({"codebase": "no-such-codebase-here"}),
            "unknown codebase 'no-such-codebase-here'",
        ),
        (json.dumps({"environment": "nope", "codebase": "x"}), "unknown environment 'nope'"),
    ],
)
def test_bad_row_names_its_line_and_writes_nothing(
    codebase: str, tmp_path: Path, bad_line: str, message: str
) -> None:
    source = tmp_path / "in.jsonl"
    good = json.dumps({"codebase": codebase})
    source.write_text(f"{good}\n{good}\n{bad_line}\n{good}\n")
    out = tmp_path / "out.jsonl"
    result = run("--dataset", str(source), "--out", str(out))
    assert result.exit_code == 1
    assert f"{source}:3: " in result.output and message in result.output
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [source]  # no temporary file left either


def test_dataset_needs_out(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text("{}\n")
    result = run("--dataset", str(source))
    assert result.exit_code == 2 and "--dataset and --out go together" in result.output
