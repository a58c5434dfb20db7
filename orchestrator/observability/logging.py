"""The one logger setup: structlog, JSON in production, readable in a terminal.

Lines about a sandbox or rollout carry ``sandbox_id``/``rollout_id``/``trace_id`` bound with
``log.bind(...)`` or :func:`structlog.contextvars.bind_contextvars`.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from orchestrator.config import Settings, get_settings

_configured = False


def configure_logging(settings: Settings | None = None) -> None:
    """Configure structlog and stdlib logging once per process."""
    global _configured
    if _configured:
        return
    settings = settings or get_settings()
    level = logging.getLevelName(settings.log_level.upper())
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if settings.log_format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=level, stream=sys.stderr, format="%(name)s: %(message)s")
    # One line per HTTP request from a client library is noise, not a log.
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(max(level, logging.WARNING))
    _configured = True


def get_logger(name: str) -> Any:
    """A structlog logger; configures logging on first use."""
    configure_logging()
    return structlog.get_logger(name)
