"""Times as operators type them on the command line."""

from __future__ import annotations

import datetime
import re

import typer

_AGO = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def when(text: str | None, option: str) -> float | None:
    """A time given as ISO 8601, Unix seconds, or an age before now (``2h``), in Unix
    seconds."""
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    if match := _AGO.match(text.strip()):
        return datetime.datetime.now(datetime.UTC).timestamp() - float(match[1]) * _UNIT_S[match[2]]
    try:
        parsed = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise typer.BadParameter(
            f"{text!r} is not an ISO 8601 time, Unix seconds or an age such as 2h",
            param_hint=option,
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=datetime.UTC)
    return parsed.timestamp()
