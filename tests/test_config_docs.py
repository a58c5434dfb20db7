"""docs/configuration.md is what `orchestrator config docs` generates from the models: every
setting and every environment field, so the page cannot drift from the code."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.cli.config_docs import DOC_PATH, REGENERATE, configuration_markdown
from orchestrator.config import Settings
from orchestrator.environments.models import (
    CustomToolConfig,
    E2BOptions,
    EnvironmentConfig,
    EnvironmentLimits,
    GraderConfig,
)
from orchestrator.sandbox.backend import ScratchDir

ROOT = Path(__file__).resolve().parent.parent


def test_committed_page_is_up_to_date() -> None:
    committed = (ROOT / DOC_PATH).read_text(encoding="utf-8")
    assert committed == configuration_markdown(), (
        f"{DOC_PATH} is out of date with the settings or environment models: run `{REGENERATE}`"
    )


def test_every_field_is_documented_with_its_default() -> None:
    page = configuration_markdown()
    for name in Settings.model_fields:
        assert f"| `ORCH_{name.upper()}` |" in page
    assert "| `ORCH_API_PORT` | int | `8000` | ≥ 1, ≤ 65535 |" in page
    # A default computed on this machine is named, never its value.
    assert "| `ORCH_HOST_ID` | str | computed: `gethostname()` |" in page
    for model, prefix in (
        (EnvironmentConfig, ""),
        (EnvironmentLimits, "limits."),
        (GraderConfig, "grader."),
        (CustomToolConfig, "tools[]."),
        (ScratchDir, "scratch_dirs[]."),
        (E2BOptions, "e2b."),
    ):
        for name in model.model_fields:
            assert f"| `{prefix}{name}` |" in page
    assert "| `tool_call_budget` | int \\| None | unset | ≥ 1 |" in page


def test_cli_writes_and_checks(tmp_path: Path) -> None:
    out = tmp_path / "configuration.md"
    stale = CliRunner().invoke(app, ["config", "docs", "--out", str(out), "--check"])
    assert stale.exit_code == 1 and REGENERATE in stale.output
    written = CliRunner().invoke(app, ["config", "docs", "--out", str(out)])
    assert written.exit_code == 0, written.output
    assert out.read_text(encoding="utf-8") == configuration_markdown()
    fresh = CliRunner().invoke(app, ["config", "docs", "--out", str(out), "--check"])
    assert fresh.exit_code == 0, fresh.output
    printed = CliRunner().invoke(app, ["config", "docs"])
    assert printed.stdout == configuration_markdown()
