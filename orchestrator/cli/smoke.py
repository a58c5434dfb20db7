"""``orchestrator smoke`` and ``orchestrator up``: prove the sandbox stack works end to end."""

from __future__ import annotations

import time

import typer
from rich.console import Console

from orchestrator.config import Runtime, get_settings
from orchestrator.sandbox.backend import SandboxError, SandboxSpec
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.sandbox.factory import make_backend
from orchestrator.tools.registry import run_tool

console = Console()


def smoke() -> None:
    """Create a sandbox per available runtime, run shell and read_file in it, destroy it."""
    settings = get_settings()
    backend = make_backend(settings)
    runtimes: list[Runtime] = ["runc"]
    if isinstance(backend, DockerBackend) and "runsc" in backend.client.info().get("Runtimes", {}):
        runtimes.append("runsc")
    failed = False
    for runtime in runtimes:
        started = time.monotonic()
        spec = SandboxSpec.from_settings(settings, image=settings.base_image, runtime=runtime)
        try:
            handle = backend.create(spec)
        except SandboxError as exc:
            console.print(f"[red]✗[/red] {runtime}: could not create a sandbox: {exc}")
            failed = True
            continue
        try:
            created_ms = (time.monotonic() - started) * 1000
            shell = run_tool(
                "shell", backend, handle, {"command": "id -un && rg --version"}, settings
            )
            backend.exec(
                handle, "printf 'a\\nb\\n' > notes.txt", timeout_s=5, output_budget_bytes=256
            )
            read = run_tool("read_file", backend, handle, {"path": "notes.txt"}, settings)
        finally:
            backend.destroy(handle)
        ok = shell.outcome == "ok" and "agent" in shell.output and read.outcome == "ok"
        failed |= not ok
        mark = "[green]✓[/green]" if ok else "[red]✗[/red]"
        console.print(
            f"{mark} {runtime}: created in {created_ms:.0f} ms, shell {shell.duration_ms:.1f} ms,"
            f" read_file {read.duration_ms:.1f} ms"
        )
    if failed:
        raise typer.Exit(1)
