"""``orchestrator sandbox ...``: run a command in a throwaway sandbox, list and reap them."""

from __future__ import annotations

import shlex
import sys
from typing import Annotated, cast

import typer
from rich.console import Console
from rich.table import Column, Table

from orchestrator.config import Runtime, get_settings
from orchestrator.images.codebases import CodebaseError, codebase_image
from orchestrator.sandbox.backend import SandboxError, SandboxSpec
from orchestrator.sandbox.factory import HostBackend, make_backend
from orchestrator.sandbox.gc import collect_expired
from orchestrator.views.sandboxes import list_sandboxes as list_sandboxes_of

app = typer.Typer(help="Sandboxes: run, list, garbage-collect.", no_args_is_help=True)
console = Console()


def _backend() -> HostBackend:
    try:
        return make_backend(get_settings())
    except SandboxError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc


@app.command()
def run(
    codebase: Annotated[str, typer.Argument(help="Codebase name, or 'base' for the base image.")],
    command: Annotated[
        list[str], typer.Argument(help="The command, after `--` (options go before it).")
    ],
    runtime: Annotated[str, typer.Option(help="runc or runsc (gVisor).")] = "",
    timeout: Annotated[float, typer.Option(help="Command timeout, seconds.")] = 0,
) -> None:
    """Create a sandbox, run COMMAND in /workspace, print its output, destroy it.

    Several words are run as one command line, each word quoted (`-- grep -rn "a b" .`);
    a single word is a shell command line of its own (`-- 'grep -rn x . | head'`).
    Exits with the command's exit status (124 when it timed out)."""
    settings = get_settings()
    if runtime and runtime not in ("runc", "runsc"):
        console.print(f"[red]error:[/red] unknown runtime {runtime!r}; use runc or runsc")
        raise typer.Exit(2)
    try:
        image = settings.base_image if codebase == "base" else codebase_image(settings, codebase)
    except CodebaseError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    backend = _backend()
    # No rollout id: an ad hoc sandbox, left to its expiry by the workers' orphan sweep
    # (which destroys a sandbox naming a rollout without a record, even mid-command).
    spec = SandboxSpec.from_settings(settings, image=image, runtime=cast(Runtime, runtime or None))
    try:
        handle = backend.create(spec)
    except SandboxError as exc:
        console.print(f"[red]error:[/red] could not create a sandbox: {exc}")
        raise typer.Exit(2) from exc
    try:
        result = backend.exec(
            handle,
            command[0] if len(command) == 1 else shlex.join(command),
            timeout_s=timeout or settings.command_timeout_s,
            output_budget_bytes=settings.output_budget_bytes * 64,
        )
    finally:
        backend.destroy(handle)
    for stream, capture in ((sys.stdout, result.stdout), (sys.stderr, result.stderr)):
        stream.write(capture.head)
        if capture.truncated:
            stream.write(f"\n... [{capture.omitted_bytes} bytes omitted] ...\n")
        stream.write(capture.tail)
        stream.flush()
    if result.timed_out:
        console.print(f"[yellow]timed out after {timeout or settings.command_timeout_s} s[/]")
        raise typer.Exit(124)
    raise typer.Exit(result.exit_code or 0)


@app.command("ls")
def list_sandboxes(
    json_: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List this deployment's sandboxes on this host, oldest first, with who holds each now.

    OWNER is read from Redis: a rollout id, or `pool` for a sandbox lying in a warm pool or
    being recycled into one. FIRST ROLLOUT is the one it was made for (its label), which a
    recycled sandbox has long outlived: a hint, not the owner."""
    listing = list_sandboxes_of(get_settings(), _backend())
    if json_:
        typer.echo(listing.model_dump_json(indent=2))
        return
    table = Table("owner", "first rollout", "runtime", "image", "created", "expires")
    # Ids are what people copy into other commands: never cut them.
    table.columns.insert(0, Column("sandbox", no_wrap=True, min_width=20))
    for view in listing.sandboxes:
        owner = view.owner or "-"
        if view.recycling:
            owner += " (recycling)"
        table.add_row(
            view.sandbox_id,
            owner if view.owner_known else f"{owner}?",
            view.first_rollout or "-",
            view.runtime,
            view.image[:40],
            view.created_at.strftime("%Y-%m-%d %H:%M:%S"),
            view.expires_at.strftime("%Y-%m-%d %H:%M:%S"),
        )
    console.print(table)
    if listing.redis_error:
        console.print(
            f"[yellow]Redis could not be read ({listing.redis_error}): owners marked ? are "
            "the labels' first owners, which a recycled sandbox has outlived[/]"
        )


@app.command()
def gc(
    everything: Annotated[
        bool, typer.Option("--all", help="Destroy every sandbox of this deployment.")
    ] = False,
) -> None:
    """Destroy expired sandboxes (or all with --all) and sweep leftover volumes/sockets."""
    report = collect_expired(_backend(), everything=everything)
    console.print(
        f"examined {report.examined}, destroyed {len(report.destroyed)}, "
        f"leftovers removed {report.leftovers_removed}"
    )
