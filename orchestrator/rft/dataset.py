"""Agent RFT dataset rows, made and checked the way the platform takes them
(docs/agent-rft.md): every row carries ``messages`` (the last one from the user) and its
tools' schemas as ``tools``, the two reserved keys; every other field reaches the tools and
the grader as ``item``. A row without ``messages`` gets them from its environment's
``prompt`` template. A row the platform, or this deployment, would refuse is an error
naming its ``file:line``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.environments.loader import EnvironmentRegistry, ResolvedEnvironment, row_commit
from orchestrator.sandbox.backend import BackendUnavailable, CommitWorkspace

RESERVED = ("messages", "tools")
"""The row keys the platform keeps for itself; the rest is the ``item``."""
ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_ITEM_BYTES = 1024 * 1024 - 64 * 1024
"""The platform sends the item with every tool call and posts at most 1 MB: room is kept
for the call's own fields and its arguments."""
MIN_ROWS = 10
"""Azure's Agent RFT samples ask for at least this many rows per file."""


class DatasetError(Exception):
    """A dataset row that the platform or the server would refuse; the message names its
    ``file:line``."""


def row_tool(schema: dict[str, Any]) -> dict[str, Any]:
    """A function tool (``orchestrator tools``' shape) in a training row's shape."""
    fields = ("name", "description", "parameters", "strict")
    return {"type": "function", "function": {k: schema[k] for k in fields if k in schema}}


def check_messages(messages: Any, where: str) -> None:
    """The platform's rule for a row's ``messages``: a non-empty list of ``{role,
    content}`` whose last message is the user's."""
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{where}: messages must be a non-empty list of messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise DatasetError(
                f"{where}: messages[{index}] must be an object with a role among "
                f"{', '.join(sorted(ROLES))}"
            )
        content = message.get("content")
        if not (isinstance(content, str) and content.strip()) and not isinstance(content, list):
            raise DatasetError(f"{where}: messages[{index}] has no content")
    if messages[-1]["role"] != "user":
        raise DatasetError(
            f"{where}: the last message must be the user's, not the {messages[-1]['role']}'s"
        )


def platform_row(
    row: dict[str, Any], resolved: ResolvedEnvironment, tools: list[dict[str, Any]], where: str
) -> dict[str, Any]:
    """``row`` as the platform takes it: ``messages`` (its own, else rendered from the
    environment's prompt), the environment's ``tools``, then the item's fields."""
    environment = resolved.environment
    messages = row.get("messages")
    if messages is None:
        prompt = environment.prompt
        if prompt is None:
            raise DatasetError(
                f"{where}: the row has no messages, and environment {environment.name!r} has "
                "no prompt template to make them from (add `prompt: {user: ...}` to it, or "
                "give the row its messages)"
            )
        missing = sorted(prompt.fields() - row.keys())
        if missing:
            raise DatasetError(
                f"{where}: environment {environment.name!r}'s prompt uses "
                f"{', '.join('{' + m + '}' for m in missing)}, which the row lacks"
            )
        messages = prompt.render(row)
    check_messages(messages, where)
    if "tools" in row and row["tools"] != tools:
        raise DatasetError(
            f"{where}: the row's own tools differ from environment {environment.name!r}'s; "
            "`tools` is reserved for the schemas of the tools the server runs (drop it)"
        )
    item = {k: v for k, v in row.items() if k not in RESERVED}
    size = len(json.dumps(item, ensure_ascii=False).encode())
    if size > MAX_ITEM_BYTES:
        raise DatasetError(
            f"{where}: the row's item is {size:,} bytes; the platform sends it with every tool "
            f"call and posts at most 1 MB (keep it under {MAX_ITEM_BYTES:,})"
        )
    return {"messages": messages, "tools": tools, **item}


def rewrite_dataset(
    registry: EnvironmentRegistry,
    source: Path,
    *,
    environment: str | None,
    tools_of: Callable[[str], list[dict[str, Any]]],
) -> list[dict[str, Any]]:
    """The rows of ``source`` (JSONL) as the platform takes them (:func:`platform_row`);
    rows naming no environment get ``environment`` when it is given. ``tools_of`` gives an
    environment's tool schemas. Raises :class:`DatasetError` on the first bad row."""
    rows: list[dict[str, Any]] = []
    schemas: dict[str, list[dict[str, Any]]] = {}
    with source.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{source}:{number}"
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise DatasetError(f"{where}: not JSON: {exc}") from None
            if not isinstance(row, dict):
                raise DatasetError(
                    f"{where}: a row must be a JSON object, got {type(row).__name__}"
                )
            if environment is not None and row.get("environment") is None:
                row["environment"] = environment
            try:
                resolved = registry.resolve(row, workspace=_unchecked_workspace(row))
            except BackendUnavailable as exc:
                raise DatasetError(
                    f"{where}: cannot check the row's codebase, the Docker daemon is "
                    f"unreachable: {exc}"
                ) from None
            except (LookupError, ValueError) as exc:
                raise DatasetError(f"{where}: {exc}") from None
            name = resolved.environment.name
            if name not in schemas:
                schemas[name] = [row_tool(s) for s in tools_of(name)]
            rows.append(platform_row(row, resolved, schemas[name], where))
    if not rows:
        raise DatasetError(f"{source}: no rows")
    return rows


def _unchecked_workspace(row: dict[str, Any]) -> CommitWorkspace | None:
    """A row's repository at its commit, its form checked but not its existence: this
    rewrite runs without the deployment (`orchestrator preflight --rows` and `orchestrator
    dataset prepare` check that both exist)."""
    wanted = row_commit(row)
    if wanted is None:
        return None
    return CommitWorkspace(repo=wanted[0], commit=wanted[1], source="(not looked up)")


def write_jsonl(rows: list[dict[str, Any]], out: Path) -> None:
    """Write ``rows`` to ``out`` whole or not at all (a temporary file, then a rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        Path(tmp).replace(out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
