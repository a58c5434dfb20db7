"""``orchestrator rft-config``: the Agent RFT job body and dataset rows in the platform's
shapes (docs/agent-rft.md), checked against the real environments and a real codebase image
(a bad row is an error naming its line, and no output is written)."""

from __future__ import annotations

import importlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


def reinforcement(result: Result) -> dict[str, Any]:
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["method"]["type"] == "reinforcement"
    found: dict[str, Any] = body["method"]["reinforcement"]
    return found


def test_job_body_has_the_platforms_shape() -> None:
    """The body ``fine_tuning.jobs.create`` takes (docs/agent-rft.md): model, training file,
    and method.reinforcement with tools, grader, max_episode_steps, hyperparameters."""
    result = run()
    body = json.loads(result.stdout)
    assert set(body) == {"model", "training_file", "method"}
    assert (body["model"], body["training_file"]) == ("<MODEL>", "<TRAINING_FILE_ID>")
    job = reinforcement(result)
    assert set(job) == {"tools", "grader", "max_episode_steps", "hyperparameters"}
    assert [t["name"] for t in job["tools"]] == ["shell", "read_file"]
    for tool in job["tools"]:
        # Each tool is {"name", "server_url", "headers"}; one URL serves all.
        assert set(tool) == {"name", "server_url", "headers"}
        assert tool["server_url"] == f"{BASE}/agent-rft/tools"
        assert tool["headers"] == {"Authorization": "Bearer <API_TOKEN>"}
    grader = job["grader"]
    assert set(grader) <= {"type", "name", "url", "headers", "rate_limit", "pass_threshold"}
    assert grader["type"] == "endpoint"
    assert grader["url"] == f"{BASE}/agent-rft/grade"
    assert grader["headers"] == {"Authorization": "Bearer <API_TOKEN>"}
    assert grader["pass_threshold"] == 0.5
    # Agreeing with codebase-planning's tool_call_budget.
    assert job["max_episode_steps"] == 50
    assert job["hyperparameters"] == {}


def test_token_rate_limit_steps_hyperparameters_and_yaml() -> None:
    result = run(
        "--environment",
        "finqa-demo",
        "--token-env",
        "MY_TOKEN",
        "--rate-limit",
        "20",
        "--pass-threshold",
        "0.8",
        "--max-episode-steps",
        "8",
        "--model",
        "o4-mini-2025-04-16",
        "--training-file",
        "file-abc",
        "--validation-file",
        "file-def",
        "--reasoning-effort",
        "medium",
        "--eval-interval",
        "3",
        "--format",
        "yaml",
        MY_TOKEN="s3cret",
    )
    assert result.exit_code == 0, result.output
    body = yaml.safe_load(result.stdout)
    assert (body["model"], body["training_file"], body["validation_file"]) == (
        "o4-mini-2025-04-16",
        "file-abc",
        "file-def",
    )
    job = body["method"]["reinforcement"]
    assert {t["name"] for t in job["tools"]} == {"search", "list", "cat"}
    assert all(t["headers"] == {"Authorization": "Bearer s3cret"} for t in job["tools"])
    assert job["grader"]["rate_limit"] == 20 and job["grader"]["pass_threshold"] == 0.8
    assert job["max_episode_steps"] == 8
    assert job["hyperparameters"] == {"reasoning_effort": "medium", "eval_interval": 3}


def test_max_episode_steps_may_not_exceed_the_budget() -> None:
    result = run("--environment", "finqa-demo", "--max-episode-steps", "11")
    assert result.exit_code == 2
    assert "exceeds environment 'finqa-demo''s tool_call_budget of 10" in result.output


def test_the_grader_by_secret_path_has_no_header(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "s" * 40
    # The package re-exports the command under the module's name: patch the module.
    module = importlib.import_module("orchestrator.cli.rft_config")
    monkeypatch.setattr(
        module,
        "get_settings",
        lambda: get_settings().model_copy(update={"grader_url_secret": secret}),
    )
    result = run("--grader-auth", "path")
    grader = reinforcement(result)["grader"]
    assert grader["url"] == f"{BASE}/agent-rft/grade/{secret}"
    assert grader.get("headers", {}) == {}
    monkeypatch.undo()
    refused = run("--grader-auth", "path")
    assert refused.exit_code == 2 and "ORCH_GRADER_URL_SECRET" in refused.output


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


def test_dataset_rows_are_made_as_the_platform_takes_them(codebase: str, tmp_path: Path) -> None:
    """Each row gets messages (its own, or its environment's prompt rendered from its
    fields) and its tools' schemas; every other field is kept as the item."""
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
    assert list(written[0])[:2] == ["messages", "tools"]
    assert {k: v for k, v in written[0].items() if k != "tools"} == rows[0]
    finqa = written[1]
    assert [m["role"] for m in finqa["messages"]] == ["developer", "user"]
    assert finqa["messages"][-1]["content"] == "what?"
    assert {k: finqa[k] for k in ("environment", "question", "answer")} == rows[1]
    assert [t["function"]["name"] for t in written[0]["tools"]] == ["shell", "read_file"]
    assert {t["function"]["name"] for t in finqa["tools"]} == {"search", "list", "cat"}
    assert all(t["type"] == "function" for row in written for t in row["tools"])
    # The schema says Agent RFT's cap on a command (its 10-minute bound, less the rest).
    shell = written[0]["tools"][0]["function"]
    assert shell["parameters"]["properties"]["timeout_s"]["maximum"] == 465
    assert "warning: 2 rows" in result.output


def test_the_example_datasets_become_platform_rows(tmp_path: Path, base: BaseBuildResult) -> None:
    from orchestrator.environments.examples import (
        ensure_finqa_corpus,
        ensure_requests_codebase,
        finqa_example_dir,
        planning_example_dir,
    )

    ensure_finqa_corpus(get_settings())
    ensure_requests_codebase(get_settings())
    for source in (
        planning_example_dir() / "dataset.jsonl",
        finqa_example_dir() / "dataset.jsonl",
    ):
        out = tmp_path / f"{source.parent.name}.jsonl"
        result = run("--dataset", str(source), "--out", str(out))
        assert result.exit_code == 0, result.output
        raw = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
        for before, row in zip(
            raw, (json.loads(x) for x in out.read_text().splitlines()), strict=True
        ):
            assert row["messages"][-1]["role"] == "user" and row["messages"][-1]["content"]
            assert {k: v for k, v in row.items() if k not in ("messages", "tools")} == before


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
        ("CODEBASE", "environment 'codebase-planning''s prompt uses {request}, which the row"),
        (
            json.dumps({"environment": "finqa-demo", "answer": 1}),
            "prompt uses {question}, which the row lacks",
        ),
        ("MESSAGES", "the last message must be the user's, not the assistant's"),
        ("TOOLS", "`tools` is reserved"),
        ("HUGE", "the platform sends it with every tool call"),
    ],
)
def test_bad_row_names_its_line_and_writes_nothing(
    codebase: str, tmp_path: Path, bad_line: str, message: str
) -> None:
    source = tmp_path / "in.jsonl"
    user = [{"role": "user", "content": "q"}]
    good = json.dumps({"codebase": codebase, "messages": user})
    bad_line = {
        "CODEBASE": json.dumps({"codebase": codebase}),
        "MESSAGES": json.dumps(
            {"codebase": codebase, "messages": [*user, {"role": "assistant", "content": "a"}]}
        ),
        "TOOLS": json.dumps({"codebase": codebase, "messages": user, "tools": []}),
        "HUGE": json.dumps({"codebase": codebase, "messages": user, "blob": "x" * (1 << 20)}),
    }.get(bad_line, bad_line)
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


def test_a_batch_size_above_the_expected_concurrency_says_how_to_warm_the_first_step() -> None:
    result = CliRunner().invoke(
        app, ["rft-config", "--base-url", BASE, "--batch-size", "16", "--environment", "finqa-demo"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["method"]["reinforcement"]["hyperparameters"] == {
        "batch_size": 16
    }
    assert "expected_concurrency 0" in result.stderr
    assert "`expected_concurrency: 16`" in result.stderr
    quiet = run("--environment", "finqa-demo")
    assert "expected_concurrency" not in quiet.stderr
