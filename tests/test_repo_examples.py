"""examples/repo_tasks (built from six's real history by its build.py): the bundle holds
every row's commit, each row resolves in the examples' environments, and each SWE row is
whole. That they pass their preflight in sandboxes: tests/e2e/test_repos.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.config import Settings
from orchestrator.environments.loader import parse_environments, row_commit
from orchestrator.sandbox.backend import CommitWorkspace
from orchestrator.sandbox.repos import HostRepos

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "repo_tasks"


def _rows(name: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in (EXAMPLES / name).read_text().splitlines()]


@pytest.mark.parametrize("name", ["planning.jsonl", "swe.jsonl"])
def test_every_row_resolves_and_its_commit_is_in_the_bundle(name: str, tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path)
    registry = parse_environments((EXAMPLES / "environments.yaml").read_text(), settings)
    repos = HostRepos(tmp_path / "repos", budget_bytes=1 << 30, allowed_urls=[])
    bundle = str(EXAMPLES / "six.bundle")
    head, commits = repos.fetch("six", bundle)
    assert commits == 506 and head
    rows = _rows(name)
    assert len(rows) >= 10
    for row in rows:
        wanted = row_commit(row)
        assert wanted is not None and wanted[0] == "six"
        assert repos.has_commit("six", bundle, wanted[1])
        workspace = CommitWorkspace(repo="six", commit=wanted[1], source=bundle)
        resolved = registry.resolve(row, workspace=workspace)
        assert resolved.environment.name == row["environment"]
        assert resolved.codebase == f"six@{wanted[1]}"
        if name == "swe.jsonl":
            assert row["FAIL_TO_PASS"] and row["PASS_TO_PASS"]
            assert str(row["gold_patch"]).startswith("diff --git a/six.py")
            assert str(row["test_patch"]).startswith("diff --git a/test_six.py")
