"""The ``orchestrator`` command: one sub-command group per concept.

Each sub-command's module is imported when that sub-command runs (``--help`` imports them
all, for their one-line help): the modules reach Docker, Celery, FastAPI, Kubernetes and
Redis between them, and importing every one cost each invocation 1.5 s of CPU, where
``orchestrator rollouts ls`` needs a fraction of that.
"""

import importlib

import typer
from typer import _click as click  # typer (0.29) carries its own click; its types are these
from typer.core import TyperGroup
from typer.main import get_command_from_info, get_group
from typer.models import CommandInfo

# name -> (module, attribute): a typer.Typer (a group of sub-commands) or a function (one
# command). In the order ``--help`` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "image": ("orchestrator.cli.image", "app"),
    "codebase": ("orchestrator.cli.codebase", "app"),
    "repo": ("orchestrator.cli.repo", "app"),
    "dataset": ("orchestrator.cli.repo", "dataset_app"),
    "sandbox": ("orchestrator.cli.sandbox", "app"),
    "up": ("orchestrator.cli.serve", "up"),
    "serve": ("orchestrator.cli.serve", "serve"),
    "worker": ("orchestrator.cli.serve", "worker"),
    "reaper": ("orchestrator.cli.serve", "reaper"),
    "smoke": ("orchestrator.cli.smoke", "smoke"),
    "tools": ("orchestrator.cli.tools", "tools"),
    "status": ("orchestrator.cli.status", "status"),
    "rollouts": ("orchestrator.cli.rollouts", "app"),
    "export": ("orchestrator.cli.rewards", "export"),
    "regrade": ("orchestrator.cli.rewards", "regrade"),
    "rft-config": ("orchestrator.cli.rft_config", "rft_config"),
    "preflight": ("orchestrator.cli.preflight", "preflight"),
    "tenants": ("orchestrator.cli.tenants", "app"),
    "audit": ("orchestrator.cli.audit", "audit"),
    "config": ("orchestrator.cli.config_docs", "app"),
}


ALIASES = {"beat": "reaper"}
"""Old names still taken, not listed: ``beat`` ran Celery beat, the reaper's scheduler,
until 2026-12 (a deployment's scripts and charts name it)."""


class LazyCommands(TyperGroup):
    """The root group: :data:`COMMANDS`, each built from its module on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        cmd_name = ALIASES.get(cmd_name, cmd_name)
        if cmd_name not in COMMANDS:
            return None
        module, attribute = COMMANDS[cmd_name]
        target = getattr(importlib.import_module(module), attribute)
        command: click.Command
        if isinstance(target, typer.Typer):
            command = get_group(target)
        else:
            command = get_command_from_info(
                CommandInfo(name=cmd_name, callback=target),
                pretty_exceptions_short=app.pretty_exceptions_short,
                rich_markup_mode=app.rich_markup_mode,
            )
        command.name = cmd_name
        return command


app = typer.Typer(
    cls=LazyCommands, help="Sandboxed rollout orchestrator for agent RL.", no_args_is_help=True
)


@app.callback()
def main() -> None:
    """Sandboxed rollout orchestrator for agent RL."""
