"""The API's process tree (``python -m orchestrator.observability.api_process``, started by
``orchestrator serve``): uvicorn, with logging and per-process metrics set up in the
parent before any worker process starts.

- Logging: uvicorn gets no logging config of its own (``log_config=None``), so its lines,
  the parent's included, go through the one root handler (observability/logging.py).
- Metrics: with ``--workers`` above 1 each process keeps its counters in files under a
  directory of this deployment and port (``<state_dir>/metrics/<deployment>-api-<port>``,
  or ``PROMETHEUS_MULTIPROC_DIR`` when set), wiped here once, at the parent's start (not
  per worker: a worker restarted by the parent must not erase the others' counts), and
  merged at every scrape. A worker that exits is marked dead
  (``multiprocess.mark_process_dead``) by the parent, which is the only process that sees
  every exit, a SIGKILL included. Its counter files stay: they hold counts already made.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import uvicorn
from prometheus_client import multiprocess
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors.multiprocess import Multiprocess

from orchestrator.config import Settings, get_settings
from orchestrator.observability.logging import (
    capture_stray_output,
    configure_logging,
    get_logger,
)
from orchestrator.observability.metrics import MULTIPROC_ENV

APP = "orchestrator.api.app:create_app"


def multiproc_dir(settings: Settings) -> Path:
    """This API's directory of per-process metric files (two APIs of one deployment on one
    host, on different ports, must not share one)."""
    return settings.state_dir / "metrics" / f"{settings.deployment}-api-{settings.api_port}"


def prepare_multiproc_dir(settings: Settings, workers: int) -> Path | None:
    """Set ``PROMETHEUS_MULTIPROC_DIR`` for the worker processes (they inherit it) and empty
    it; None when one process serves and none was asked for."""
    configured = os.environ.get(MULTIPROC_ENV)
    if not configured and workers <= 1:
        return None
    path = Path(configured) if configured else multiproc_dir(settings)
    path.mkdir(parents=True, exist_ok=True)
    # Files of a previous run would add its counts, under pids that may be reused, to ours.
    for stale in path.glob("*.db"):
        stale.unlink(missing_ok=True)
    os.environ[MULTIPROC_ENV] = str(path)
    return path


class _MarkingMultiprocess(Multiprocess):
    """uvicorn's supervisor, marking each worker process that goes as dead."""

    def keep_subprocess_alive(self) -> None:
        self._marking(super().keep_subprocess_alive)

    def restart_all(self) -> None:
        self._marking(super().restart_all)

    def handle_ttou(self) -> None:
        self._marking(super().handle_ttou)

    def _marking(self, step: Callable[[], None]) -> None:
        before = {p.pid for p in self.processes}
        step()
        path = os.environ.get(MULTIPROC_ENV)
        for pid in before - {p.pid for p in self.processes}:
            if pid is not None and path:
                multiprocess.mark_process_dead(pid, path)  # type: ignore[no-untyped-call]


def run(settings: Settings, *, workers: int, log_level: str, timeout_keep_alive: int) -> None:
    """Serve the API in the foreground with ``workers`` processes."""
    configure_logging(settings)
    capture_stray_output(settings)
    path = prepare_multiproc_dir(settings, workers)
    if path is not None:
        get_logger(__name__).info("api.metrics_multiprocess", directory=str(path))
    config = uvicorn.Config(
        APP,
        factory=True,
        host=settings.api_host,
        port=settings.api_port,
        workers=workers,
        log_config=None,
        log_level=log_level,
        access_log=False,
        timeout_keep_alive=timeout_keep_alive,
        proxy_headers=True,
        forwarded_allow_ips=settings.api_forwarded_allow_ips,
        # uvloop and httptools when installed (they are dependencies); the stdlib's loop
        # for asyncio's debug mode, whose slow-callback report is the stdlib's.
        loop="asyncio" if settings.asyncio_debug else "auto",
        http="auto",
    )
    server = uvicorn.Server(config)
    if workers > 1:
        _MarkingMultiprocess(config, sockets=[config.bind_socket()]).run()
        return
    config.load_app()
    server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--timeout-keep-alive", type=int, default=5)
    args = parser.parse_args(argv)
    settings = get_settings()
    overrides = {"api_host": args.host, "api_port": args.port}
    settings = settings.model_copy(update={k: v for k, v in overrides.items() if v is not None})
    run(
        settings,
        workers=args.workers,
        log_level=args.log_level,
        timeout_keep_alive=args.timeout_keep_alive,
    )


if __name__ == "__main__":
    main()
