"""Small text helpers the operators' views share: ages, sizes, output heads."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from rich.console import Console

# Piped or captured output has no terminal to size to; rich would assume 80 columns and
# fold ids and tables into unreadable columns.
PIPED_WIDTH = 160


def console() -> Console:
    """The console the views print to: the terminal's width, or a wide page when piped."""
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=PIPED_WIDTH)


def age(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``2h10m``, ``4d03h``; ``-`` for None."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def size(n: int | None) -> str:
    """Bytes as ``512M``/``3.2G``; ``-`` for None."""
    if n is None:
        return "-"
    if n >= 2**30:
        return f"{n / 2**30:.1f}G"
    return f"{n // 2**20}M"


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}ms" if value < 1000 else f"{value / 1000:.2f}s"


def head(text: str, lines: int, chars: int = 4000) -> tuple[str, int]:
    """The first ``lines`` lines of ``text`` (at most ``chars`` characters) and how many
    lines were left out."""
    all_lines = text.splitlines()
    kept = "\n".join(all_lines[:lines])
    if len(kept) > chars:
        kept = kept[:chars] + "…"
    return kept, max(0, len(all_lines) - lines)


def arguments_text(arguments: Any) -> str:
    """Tool arguments as compact JSON (a JSON string is decoded first)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return str(arguments)
    return json.dumps(arguments, ensure_ascii=False, separators=(", ", ": "))
