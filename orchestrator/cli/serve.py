"""``orchestrator serve|worker|beat|up``: the processes of a deployment.

``up`` runs Redis (if not running), the API, one worker and beat in the foreground and
stops them all on Ctrl-C; ``make up`` calls it after installing everything.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from orchestrator.config import Settings, get_settings
from orchestrator.state.keys import Keys

console = Console()


def _celery(settings: Settings, *args: str) -> list[str]:
    # Celery's start-up banner is plain text: JSON logs must hold nothing but JSON lines.
    quiet = ["--quiet"] if settings.log_format == "json" else []
    return [sys.executable, "-m", "celery", "-A", "orchestrator.celery_main", *quiet, *args]


def worker_command(settings: Settings) -> list[str]:
    """A worker for this host: it takes sandbox creations and its own host's calls."""
    keys = Keys.of(settings.deployment)
    return _celery(
        settings,
        "worker",
        "--queues",
        f"{keys.shared_queue},{keys.host_queue(settings.host_id)}",
        "--pool",
        "threads",
        "--concurrency",
        str(settings.worker_concurrency),
        "--hostname",
        f"{settings.host_id}@{settings.deployment}",
        "--loglevel",
        settings.log_level,
        "--without-gossip",
        "--without-mingle",
    )


def beat_command(settings: Settings) -> list[str]:
    schedule = settings.state_dir / f"beat-{settings.deployment}.schedule"
    return _celery(settings, "beat", "--schedule", str(schedule), "--loglevel", settings.log_level)


def api_command(settings: Settings) -> list[str]:
    # uvicorn, with logging and multiprocess metrics set up in its parent process.
    return [
        sys.executable,
        "-m",
        "orchestrator.observability.api_process",
        "--host",
        settings.api_host,
        "--port",
        str(settings.api_port),
        "--log-level",
        settings.log_level.lower(),
        # Trainers keep connections open between a rollout's calls; a short keep-alive
        # makes the server close one just as the client reuses it.
        "--timeout-keep-alive",
        "75",
        "--workers",
        str(settings.api_workers),
    ]


def serve() -> None:
    """Run the API (uvicorn) in the foreground."""
    os.execv(sys.executable, api_command(get_settings()))


def worker() -> None:
    """Run a worker for this host in the foreground."""
    os.execv(sys.executable, worker_command(get_settings()))


def beat() -> None:
    """Run beat (the periodic reaper) in the foreground. Run exactly one per deployment."""
    os.execv(sys.executable, beat_command(get_settings()))


def api_token(settings: Settings) -> str:
    """ORCH_API_TOKENS if set; else the token kept from the last start, or a new one."""
    return settings.api_tokens if settings.tokens else _kept_secret(settings, "api-token")


def grader_secret(settings: Settings) -> str:
    """ORCH_GRADER_URL_SECRET if set; else the one kept from the last start, or a new one."""
    return settings.grader_url_secret or _kept_secret(settings, "grader-secret")


def _kept_secret(settings: Settings, name: str) -> str:
    """The secret kept in ``state_dir/name`` (mode 0600), made on the first start."""
    path = settings.state_dir / name
    if path.exists():
        return path.read_text().strip()
    secret = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(secret + "\n")
    return secret


def up(
    check: Annotated[bool, typer.Option(help="Start, wait until ready, then stop.")] = False,
) -> None:
    """Serve: API, one worker and beat in the foreground; Ctrl-C stops them all."""
    settings = get_settings()
    token = api_token(settings)
    secret = grader_secret(settings)
    env = {**os.environ, "ORCH_API_TOKENS": token, "ORCH_GRADER_URL_SECRET": secret}
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    procs = {
        "worker": subprocess.Popen(worker_command(settings), env=env),
        "beat": subprocess.Popen(beat_command(settings), env=env),
        "api": subprocess.Popen(api_command(settings), env=env),
    }
    base = f"http://{settings.api_host}:{settings.api_port}"
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    ready = _wait_ready(base, procs, timeout_s=60)
    if ready:
        console.print(
            f"[green]orchestrator is up[/green] at {base}\n"
            f"  tools:  {base}/agent-rft/tools   grader: {base}/agent-rft/grade\n"
            f"  grader without a header: {base}/agent-rft/grade/{secret}   (kept in "
            f"{Path(settings.state_dir) / 'grader-secret'}; the URL is a credential)\n"
            f"  docs:   {base}/docs\n"
            f"  token:  {token}   (Authorization: Bearer <token>; kept in "
            f"{Path(settings.state_dir) / 'api-token'} unless ORCH_API_TOKENS is set)\n"
            "Ctrl-C stops everything.",
            soft_wrap=True,  # URLs and the token must stay on one line to be copied
        )
    code = 0 if ready else 1
    while ready and not check and not stopping:
        dead = [name for name, p in procs.items() if p.poll() is not None]
        if dead:
            console.print(f"[red]{', '.join(dead)} exited[/red]; stopping the rest")
            code = 1
            break
        time.sleep(0.5)
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs.values():
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
    raise typer.Exit(code)


def _wait_ready(base: str, procs: dict[str, subprocess.Popen[bytes]], timeout_s: float) -> bool:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs.values()):
            return False
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    console.print(f"[red]not ready within {timeout_s:.0f} s[/red]")
    return False
