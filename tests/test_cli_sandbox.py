"""``orchestrator sandbox run|ls|gc`` and ``orchestrator smoke`` through the real CLI app,
against the real daemon, each leaving no sandbox behind."""

from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner, Result

from orchestrator.cli import app
from orchestrator.cli import sandbox as sandbox_cli
from orchestrator.config import Runtime, Settings, get_settings
from orchestrator.local import free_port
from orchestrator.sandbox.backend import SandboxSpec
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.sandbox.gc import collect_expired

pytestmark = pytest.mark.xdist_group("cli_sandbox")


@dataclass
class Cli:
    runner: CliRunner
    backend: DockerBackend
    monkeypatch: pytest.MonkeyPatch

    def invoke(self, *args: str, columns: int = 200) -> Result:
        # The CLI's console fixes its width when imported (from COLUMNS, which pytest-xdist
        # sets to 80): give it the width this call is about.
        self.monkeypatch.setattr(sandbox_cli, "console", Console(width=columns))
        return self.runner.invoke(app, list(args))


@pytest.fixture()
def cli(settings: Settings, base_image: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cli]:
    """The CLI pointed at a deployment of its own (so `gc --all` cannot reach the worker's
    shared sandbox), with a backend on the same deployment to check on it."""
    # A short state dir: agent sockets live under it, and Unix socket paths are short.
    state_dir = Path(tempfile.mkdtemp(prefix="orch-cli-", dir="/tmp"))
    own = settings.model_copy(
        update={
            "deployment": f"{settings.deployment[:24]}-cli-{uuid.uuid4().hex[:6]}",
            "state_dir": state_dir,
        }
    )
    monkeypatch.setenv("ORCH_DEPLOYMENT", own.deployment)
    monkeypatch.setenv("ORCH_STATE_DIR", str(own.state_dir))
    monkeypatch.setenv("ORCH_BASE_IMAGE", own.base_image)
    get_settings.cache_clear()
    backend = DockerBackend(own)
    try:
        assert get_settings().deployment == own.deployment
        yield Cli(CliRunner(), backend, monkeypatch)
        assert backend.list_owned() == [], "the CLI left a sandbox behind"
    finally:
        collect_expired(backend, everything=True)
        get_settings.cache_clear()
        shutil.rmtree(state_dir, ignore_errors=True)


# Every command line below follows the documented form (`sandbox run CODEBASE -- COMMAND`,
# options anywhere before `--`). Those that fail today fail because of one bug; the tests
# after them check the same behaviour in the form that works today (options before the
# codebase, no `--`).
DOUBLE_DASH_BUG = (
    "`sandbox run` sets allow_interspersed_args=False, so after CODEBASE every word, `--` "
    "and options included, lands in COMMAND: `sandbox run base -- 'echo hi'` runs "
    "`-- 'echo hi'` (bash: eval: --: invalid option, exit 2) and `--timeout`/`--runtime` "
    "after CODEBASE are run as part of the command -- orchestrator/cli/sandbox.py run()"
)


@pytest.mark.parametrize(
    ("args", "exit_code", "expected"),
    [
        (["base", "--", "echo hi; exit 3"], 3, "hi\n"),
        (["base", "--", "echo", "a  b"], 0, "a  b\n"),
        (["base", "--timeout", "1", "--", "echo early; sleep 5"], 124, "early\n"),
        (["base", "--runtime", "bogus", "--", "true"], 2, "unknown runtime 'bogus'"),
    ],
    ids=["exit-status", "several-words", "timeout", "bogus-runtime"],
)
def test_run_documented_form(cli: Cli, args: list[str], exit_code: int, expected: str) -> None:
    result = cli.invoke("sandbox", "run", *args)
    assert cli.backend.list_owned() == []
    assert result.exit_code == exit_code, result.output
    assert expected in result.output, result.output


def test_run_prints_output_and_exits_with_the_commands_status(cli: Cli) -> None:
    result = cli.invoke("sandbox", "run", "base", "echo hi; echo oops >&2; exit 3")
    assert result.exit_code == 3, result.output
    assert result.stdout == "hi\n"
    assert "oops" in result.stderr
    assert cli.backend.list_owned() == []

    ok = cli.invoke("sandbox", "run", "base", "pwd; id -un")
    assert ok.exit_code == 0, ok.output
    assert ok.stdout == "/workspace\nagent\n"
    assert cli.backend.list_owned() == []


def test_run_quotes_each_of_several_words(cli: Cli) -> None:
    result = cli.invoke("sandbox", "run", "base", "--", "echo", "a  b", "$HOME", "x;y", "-n")
    assert result.exit_code == 0, result.output
    # Each word arrives as one argument: spaces kept, nothing expanded, split or parsed
    # as an option of ours.
    assert result.stdout == "a  b $HOME x;y -n\n"
    assert cli.backend.list_owned() == []


def test_run_with_a_timeout_exits_124(cli: Cli) -> None:
    result = cli.invoke("sandbox", "run", "--timeout", "1", "base", "echo early; sleep 5")
    assert result.exit_code == 124, result.output
    assert result.stdout.startswith("early\n")
    assert "timed out after 1" in result.output
    assert cli.backend.list_owned() == []


def test_run_on_each_runtime(cli: Cli, runtime: Runtime) -> None:
    result = cli.invoke("sandbox", "run", "--runtime", runtime, "base", "echo", "on-$0")
    assert result.exit_code == 0, result.output
    assert result.stdout == "on-$0\n"
    assert cli.backend.list_owned() == []


def test_run_bogus_runtime_exits_2(cli: Cli) -> None:
    result = cli.invoke("sandbox", "run", "--runtime", "bogus", "base", "--", "true")
    assert result.exit_code == 2, result.output
    assert "unknown runtime 'bogus'" in result.output
    assert cli.backend.list_owned() == []


def test_run_unknown_codebase_exits_2(cli: Cli) -> None:
    name = f"no-such-codebase-{uuid.uuid4().hex[:6]}"
    result = cli.invoke("sandbox", "run", name, "--", "true")
    assert result.exit_code == 2, result.output
    assert f"unknown codebase {name!r}" in result.output
    assert cli.backend.list_owned() == []


def test_ls_lists_and_gc_all_destroys(cli: Cli, base_image: str) -> None:
    rollout = f"cli-{uuid.uuid4().hex[:6]}"
    handle = cli.backend.create(SandboxSpec(image=base_image, rollout_id=rollout))
    try:
        listed = cli.invoke("sandbox", "ls")
        assert listed.exit_code == 0, listed.output
        assert handle.sandbox_id in listed.output
        assert rollout in listed.output

        expired_only = cli.invoke("sandbox", "gc")
        assert expired_only.exit_code == 0, expired_only.output
        assert "examined 1, destroyed 0" in expired_only.output
        assert [h.sandbox_id for h in cli.backend.list_owned()] == [handle.sandbox_id]

        everything = cli.invoke("sandbox", "gc", "--all")
        assert everything.exit_code == 0, everything.output
        assert "examined 1, destroyed 1" in everything.output
        assert cli.backend.list_owned() == []
        assert cli.backend.probe(handle).state == "missing"

        empty = cli.invoke("sandbox", "ls")
        assert empty.exit_code == 0 and handle.sandbox_id not in empty.output
    finally:
        cli.backend.destroy(handle)


def test_ls_shows_whole_sandbox_ids_at_80_columns(cli: Cli, base_image: str) -> None:
    handle = cli.backend.create(SandboxSpec(image=base_image, rollout_id="narrow"))
    try:
        listed = cli.invoke("sandbox", "ls", columns=80)
        assert listed.exit_code == 0, listed.output
        assert handle.sandbox_id in listed.output
    finally:
        cli.backend.destroy(handle)


def test_ls_json_names_the_owner_and_falls_back_to_the_label_without_redis(
    cli: Cli, base_image: str
) -> None:
    """With Redis, a sandbox no pool ever held is its label's rollout's; without Redis the
    listing still answers, from the labels, and says the owners are only that."""
    rollout = f"cli-{uuid.uuid4().hex[:6]}"
    handle = cli.backend.create(SandboxSpec(image=base_image, rollout_id=rollout))
    try:
        listed = cli.invoke("sandbox", "ls", "--json")
        assert listed.exit_code == 0, listed.output
        listing = json.loads(listed.output)
        assert listing["redis_error"] is None
        (entry,) = listing["sandboxes"]
        assert entry["sandbox_id"] == handle.sandbox_id
        assert (entry["owner"], entry["first_rollout"], entry["owner_known"]) == (
            rollout,
            rollout,
            True,
        )
        cli.monkeypatch.setenv("ORCH_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
        get_settings.cache_clear()
        blind = cli.invoke("sandbox", "ls", "--json")
        assert blind.exit_code == 0, blind.output
        listing = json.loads(blind.output)
        assert "ConnectionError" in listing["redis_error"], listing
        (entry,) = listing["sandboxes"]
        assert (entry["owner"], entry["owner_known"]) == (rollout, False)
        table = cli.invoke("sandbox", "ls")
        assert f"{rollout}?" in table.output and "Redis could not be read" in table.output
    finally:
        cli.backend.destroy(handle)
        get_settings.cache_clear()


def test_smoke_passes_on_every_runtime(cli: Cli) -> None:
    result = cli.invoke("smoke")
    assert result.exit_code == 0, result.output
    runtimes = ["runc"]
    if "runsc" in cli.backend.client.info().get("Runtimes", {}):
        runtimes.append("runsc")
    lines = [line for line in result.output.splitlines() if line.startswith("✓")]
    assert [line.split()[1] for line in lines] == [f"{r}:" for r in runtimes], result.output
    assert "✗" not in result.output
    assert cli.backend.list_owned() == []
