"""An environment's named secrets (docs/tenancy.md, "Secrets"): where each is read, read
when it is used (a rotated Kubernetes Secret's file needs no restart), and taken out of
any text a model, a trajectory or a log could be given.

Shared by the API (an HTTP tool's headers) and the worker (a sandbox's commands): neither
keeps a value longer than the call that needs it, and no value travels through Redis (a
call carries where to read a secret, never the secret).
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

MIN_REDACTED_CHARS = 4
"""Values shorter than this are not searched for in output: they would match everywhere
and hide the model's own text (a secret that short is no secret)."""


class SecretSource(BaseModel):
    """Where one of an environment's secrets is read, each time it is used: a file, or a
    variable of the process that uses it (the API for an HTTP tool, the worker for a
    sandbox's commands)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str | None = Field(None, min_length=1, description="A file holding it (trimmed).")
    env: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="An environment variable."
    )

    @model_validator(mode="after")
    def _one_source(self) -> SecretSource:
        if (self.file is None) == (self.env is None):
            raise ValueError("a secret is read from exactly one of: file, env")
        return self


class SecretUnreadable(Exception):
    """A secret could not be read: the deployment's configuration, never the agent."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"secret {name!r} could not be read ({why})")
        self.name = name


def read_secret(name: str, source: SecretSource) -> str:
    """The secret's value now; :class:`SecretUnreadable` (naming it, never its value)."""
    try:
        if source.file is not None:
            found = Path(source.file).read_text().strip()
        else:
            found = os.environ.get(source.env or "", "")
    except OSError as exc:
        raise SecretUnreadable(name, type(exc).__name__) from None
    if not found:
        raise SecretUnreadable(name, "it is empty or not set")
    return found


def redact(text: str, values: dict[str, str]) -> str:
    """``text`` with each value of ``values`` replaced by ``[secret NAME]``."""
    for name, value in values.items():
        if len(value) >= MIN_REDACTED_CHARS and value in text:
            text = text.replace(value, f"[secret {name}]")
    return text
