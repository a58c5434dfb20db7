"""The ``orchestrator`` command: one sub-command group per concept."""

import typer

from orchestrator.cli import codebase, config_docs, image, rollouts, sandbox
from orchestrator.cli.preflight import preflight
from orchestrator.cli.rft_config import rft_config
from orchestrator.cli.serve import beat, serve, up, worker
from orchestrator.cli.smoke import smoke
from orchestrator.cli.status import status
from orchestrator.cli.tools import tools

app = typer.Typer(help="Sandboxed rollout orchestrator for agent RL.", no_args_is_help=True)
app.add_typer(image.app, name="image")
app.add_typer(codebase.app, name="codebase")
app.add_typer(sandbox.app, name="sandbox")
app.command()(up)
app.command()(serve)
app.command()(worker)
app.command()(beat)
app.command()(smoke)
app.command()(tools)
app.command()(status)
app.add_typer(rollouts.app, name="rollouts")
app.command("rft-config")(rft_config)
app.command()(preflight)
app.add_typer(config_docs.app, name="config")
