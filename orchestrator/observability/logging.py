"""The one logger setup: structlog, JSON with ``ORCH_LOG_FORMAT=json``, readable in a
terminal otherwise.

Every line goes through one handler on the root logger whose formatter is structlog's
``ProcessorFormatter``: structlog's own events and stdlib records (uvicorn, Celery, httpx)
come out in the same format, so JSON mode yields only JSON lines. Every line carries
``host`` (this process's ``settings.host_id``). Lines about a rollout also carry
``trace_id``, ``rollout_id`` and ``sandbox_id``, bound at the boundaries with
:func:`rollout_context` (a request in the API, a task in a worker, a rollout in the
reaper) and :func:`bind_sandbox` once the sandbox is known.
"""

from __future__ import annotations

import functools
import getpass
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from orchestrator.config import Settings, get_settings

_configured = False

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")


def _host_adder(host: str) -> Processor:
    def add_host(_: WrappedLogger, __: str, event: EventDict) -> EventDict:
        event.setdefault("host", host)
        return event

    return add_host


def configure_logging(settings: Settings | None = None) -> None:
    """Configure structlog and stdlib logging once per process."""
    global _configured
    if _configured:
        return
    settings = settings or get_settings()
    level = logging.getLevelName(settings.log_level.upper())
    renderer: Processor = (
        structlog.processors.JSONRenderer()
        if settings.log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    # Run on every line, structlog's and stdlib's alike.
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        _host_adder(settings.host_id),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            # Not the records' extras: Celery's hold whole task payloads, uvicorn's colours.
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
    logging.captureWarnings(True)  # warnings.warn (Celery's, say) as log lines too
    # Servers' own loggers reach the root handler (uvicorn's defaults give them handlers
    # and formats of their own).
    for name in ("uvicorn", "uvicorn.error", "celery"):
        logging.getLogger(name).handlers = []
        logging.getLogger(name).propagate = True
    # Noise, not logs: a line per HTTP request from a client library, and Celery's "task
    # received/succeeded" for every call (the worker logs what matters itself; a failed
    # task still logs at ERROR).
    for chatty in (
        "httpx",
        "httpcore",
        # lightkube's fork of httpx: the Kubernetes backend's list on every heartbeat.
        "httpx2",
        "httpcore2",
        "celery.worker.strategy",
        "celery.app.trace",
    ):
        logging.getLogger(chatty).setLevel(max(level, logging.WARNING))
    _configured = True


_stdout_captured = False


def capture_stray_output(settings: Settings | None = None) -> None:
    """In JSON mode, turn what a server process prints to stdout (Celery writes its
    "worker: Warm shutdown" straight to the process's stdout, as libraries may) into log
    lines, so a log pipeline that parses every line as JSON never meets plain text. Only
    for servers: a CLI's stdout is its output. Once per process."""
    global _stdout_captured
    settings = settings or get_settings()
    if _stdout_captured or settings.log_format != "json":
        return
    configure_logging(settings)
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    os.dup2(write_end, 1)  # fd 1 itself, so sys.__stdout__ and child processes follow
    os.close(write_end)
    stray = structlog.get_logger("stdout")

    def relay() -> None:
        with os.fdopen(read_end, "r", errors="replace") as lines:
            for line in lines:
                if line.strip():
                    stray.info("stdout", text=line.rstrip("\n"))

    threading.Thread(target=relay, name="stdout-relay", daemon=True).start()
    _stdout_captured = True


def get_logger(name: str) -> Any:
    """A structlog logger; configures logging on first use."""
    configure_logging()
    return structlog.get_logger(name)


@contextmanager
def rollout_context(
    rollout_id: str, *, trace_id: str | None = None, sandbox_id: str | None = None
) -> Iterator[None]:
    """Every line logged inside carries the rollout's ids; they are unbound (restored) on
    exit, which matters in worker threads that Celery reuses for other tasks.
    ``trace_id``: Agent RFT's trace id, which is the rollout's id (the default). Inside the
    same rollout's context already (the service's entry points call each other), the
    ids bound so far stay, the sandbox's included."""
    if structlog.contextvars.get_contextvars().get("rollout_id") == rollout_id:
        yield
        return
    with structlog.contextvars.bound_contextvars(
        trace_id=trace_id or rollout_id, rollout_id=rollout_id, sandbox_id=sandbox_id
    ):
        yield


def bind_sandbox(sandbox_id: str | None) -> None:
    """Within a :func:`rollout_context`: the rollout's sandbox is now known."""
    if sandbox_id is not None:
        structlog.contextvars.bind_contextvars(sandbox_id=sandbox_id)


def in_rollout_context(
    method: Callable[Concatenate[S, str, P], Awaitable[R]],
) -> Callable[Concatenate[S, str, P], Awaitable[R]]:
    """Run an async method whose first argument is a rollout id in that rollout's
    :func:`rollout_context` (the service's entry points)."""

    @functools.wraps(method)
    async def wrapper(self: S, rollout_id: str, /, *args: P.args, **kwargs: P.kwargs) -> R:
        with rollout_context(rollout_id):
            return await method(self, rollout_id, *args, **kwargs)

    return wrapper


AUDIT_LOGGER = "orchestrator.audit"
"""The audit log's logger: a deployment ships its lines (``audit.*`` events) apart by
this name (docs/tenancy.md, "Audit log")."""


def audit(event: str, *, actor: str, **fields: Any) -> None:
    """One line of the audit log: ``audit.<event>``, who did it (``actor``: a tenant, an
    operating-system user at a host, or the process itself) and when, and what changed.
    Never a credential: a digest's first digits name one (tenants.credential_id)."""
    get_logger(AUDIT_LOGGER).info(f"audit.{event}", actor=actor, at=time.time(), **fields)


def local_actor() -> str:
    """The operating-system user running this command, at this host: the actor of a CLI
    command's audit line."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"
