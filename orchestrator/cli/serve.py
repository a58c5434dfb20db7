"""``orchestrator serve|worker|reaper|up``: the processes of a deployment.

``up`` runs Redis (if not running), the API, one worker and the reaper in the foreground and
stops them all on Ctrl-C, ending the rollouts and sandboxes it holds (unless
``--keep-sandboxes``); ``make up`` calls it after installing everything.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from orchestrator.config import Settings, get_settings
from orchestrator.environments.loader import load_environments
from orchestrator.local import end_sandboxes
from orchestrator.rollouts.teardown import end_rollouts
from orchestrator.state.keys import Keys
from orchestrator.tls import tls

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


def reaper_command(settings: Settings) -> list[str]:
    """The reaper, a process of its own (rollouts/reaper.Reaper)."""
    return [sys.executable, "-m", "orchestrator.cli", "reaper"]


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


def reaper() -> None:
    """Run the reaper (the control plane's controller: idle and expired rollouts, lost
    hosts, slots, sweeps, refills) in the foreground. Run one per deployment, or more as
    standbys: they share a lease and one reaps. ``beat`` is its name before 2026-12."""
    from orchestrator.observability.logging import configure_logging
    from orchestrator.observability.metrics import serve_process_metrics
    from orchestrator.rollouts.reaper import Reaper

    settings = get_settings()
    configure_logging(settings)
    serve_process_metrics("reaper", settings.reaper_metrics_port, settings)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await Reaper(settings).run(stop)

    asyncio.run(run())


def api_token(settings: Settings) -> str:
    """ORCH_API_TOKENS if set; else the token kept from the last start, or a new one."""
    return settings.api_tokens if settings.tokens else _kept_secret(settings, "api-token")


def operator_token(settings: Settings) -> str | None:
    """A token of the operator's that this process can present: the first of
    ORCH_API_TOKENS given as itself (not as a digest), else the one ``up`` kept; None."""
    plain = [t for t in settings.tokens if not t.startswith("sha256:")]
    if plain:
        return plain[0]
    kept = settings.state_dir / "api-token"
    return kept.read_text().strip() if not settings.tokens and kept.exists() else None


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
    keep_sandboxes: Annotated[
        bool,
        typer.Option(
            help="On stop, leave this host's rollouts and sandboxes as they are (a restarted "
            "stack takes them up again) instead of ending them."
        ),
    ] = False,
) -> None:
    """Serve: API, one worker and the reaper in the foreground; Ctrl-C stops them all and ends
    the rollouts and sandboxes this host holds (a trainer coming back to one is told to
    discard it), unless ``--keep-sandboxes``."""
    settings = get_settings()
    token = api_token(settings)
    secret = grader_secret(settings)
    env = {**os.environ, "ORCH_API_TOKENS": token, "ORCH_GRADER_URL_SECRET": secret}
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    procs = {
        name: subprocess.Popen(
            command, env=env, preexec_fn=functools.partial(_die_with, os.getpid())
        )
        for name, command in (
            ("worker", worker_command(settings)),
            ("reaper", reaper_command(settings)),
            ("api", api_command(settings)),
        )
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
    # A second Ctrl-C cuts the teardown short: what is left is swept at the next start.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # No new rollouts, calls or pool refills first; the worker goes on destroying nothing
    # until the records are ended, so no call runs in a sandbox about to go.
    _stop(procs, "api", "reaper")
    if not keep_sandboxes:
        code = _end_what_it_holds(settings, lambda: _stop(procs, "worker")) or code
    _stop(procs, "worker")
    raise typer.Exit(code)


def _die_with(parent: int) -> None:
    """In a child of ``up`` (pid ``parent``), before it runs: SIGTERM it when ``up`` dies,
    however it dies. Killed outright (SIGKILL, an OOM kill), ``up`` cannot stop its
    children, and a worker left behind went on refilling its pools with no one to end them
    (seen: a test's killed stack left its worker, API and two sandboxes running for hours).
    A SIGTERMed worker drains and keeps its sandboxes, for the next start's sweep. ``up``
    forks them before it starts a thread, so this runs in a single-threaded child."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:  # up died before the prctl: no signal would come
        os.kill(os.getpid(), signal.SIGTERM)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _stop(procs: dict[str, subprocess.Popen[bytes]], *names: str) -> None:
    """SIGTERM ``names`` (a worker drains its running calls), then wait; kill after 20 s."""
    for name in names:
        if procs[name].poll() is None:
            procs[name].send_signal(signal.SIGTERM)
    for name in names:
        try:
            procs[name].wait(timeout=20)
        except subprocess.TimeoutExpired:
            procs[name].kill()
            procs[name].wait()


def _end_what_it_holds(settings: Settings, stop_worker: Callable[[], None]) -> int:
    """End this host's rollouts (records closed, ``stack_stopped``), stop the worker, then
    destroy its sandboxes, pools' included. 0, or 1 when something could not be ended."""
    started = time.monotonic()
    try:
        environments = load_environments(settings)
        ended = asyncio.run(end_rollouts(settings, environments))
    except Exception as exc:  # noqa: BLE001 - Redis down: the sandboxes still go
        console.print(f"[red]could not end the rollouts:[/red] {exc}")
        ended, environments = -1, None
    stop_worker()
    try:
        destroyed, dropped = end_sandboxes(settings, environments) if environments else (0, 0)
    except Exception as exc:  # noqa: BLE001 - said, and left for the next start's sweep
        console.print(f"[red]could not destroy every sandbox:[/red] {exc}")
        return 1
    console.print(
        f"ended {max(ended, 0)} rollouts, destroyed {destroyed} sandboxes "
        f"({dropped} pool entries) in {time.monotonic() - started:.1f} s"
    )
    return 1 if ended < 0 else 0


def _wait_ready(base: str, procs: dict[str, subprocess.Popen[bytes]], timeout_s: float) -> bool:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs.values()):
            return False
        try:
            if httpx.get(f"{base}/readyz", timeout=2, verify=tls()).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    console.print(f"[red]not ready within {timeout_s:.0f} s[/red]")
    return False
