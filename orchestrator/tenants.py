"""Who is calling: a credential (an API token, an E2B API key, a grader URL's secret) maps
to a :class:`Principal`, the tenant it acts for (docs/tenancy.md).

Credentials are kept as SHA-256 digests only (``sha256:<hex>``), in ``ORCH_API_TOKENS``
and in the tenants file (``ORCH_TENANTS_FILE``, a Kubernetes Secret in the chart). A token
is 32 random bytes or more, so a fast hash is enough: nobody can search a 256-bit space,
and a slow one (bcrypt) would cost every tool call milliseconds. A presented credential is
hashed and looked up: the time taken says nothing about how close a guess came.

The file is read again when it changes (checked at most once a second), so a token is
added or revoked without a restart; a file that does not parse keeps the last good one and
says why in the log (a typo never locks every tenant out).
"""

from __future__ import annotations

import hashlib
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from orchestrator.observability.logging import get_logger

DEFAULT_TENANT = "default"
"""The tenant of ``ORCH_API_TOKENS``' tokens and of records made before tenants were."""

TENANT_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,40}$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
MIN_TOKEN_CHARS = 32
RELOAD_CHECK_S = 1.0


log = get_logger(__name__)


def digest(credential: str) -> str:
    """A credential as it is kept: ``sha256:<hex>``."""
    return "sha256:" + hashlib.sha256(credential.encode()).hexdigest()


class Quotas(BaseModel):
    """A tenant's share of the deployment (docs/tenancy.md); None: no bound of its own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sandboxes: int | None = Field(None, ge=0, description="Sandboxes held at once.")
    creations_per_s: float | None = Field(None, gt=0, description="Sandboxes made per second.")
    calls_per_s: float | None = Field(None, gt=0, description="Tool calls per second.")
    warm_sandboxes: int | None = Field(
        None,
        ge=0,
        description="Warm sandboxes (from pools) held at once; past it, a new rollout gets "
        "a cold one, so one tenant's burst cannot empty the pools the others count on.",
    )


@dataclass(frozen=True)
class Principal:
    """Who a request acts for: its tenant, whether it may see every tenant's things, and
    the tenant's quotas."""

    tenant: str
    admin: bool = False
    quotas: Quotas = field(default_factory=Quotas)

    def sees(self, owner: str) -> bool:
        """Whether a thing of tenant ``owner`` exists for this caller (else: a 404)."""
        return self.admin or owner == self.tenant


OPERATOR = Principal(DEFAULT_TENANT, admin=True)
"""The deployment's own code acting for itself (the reaper, a set-up step, the CLI)."""


class TenantConfig(BaseModel):
    """One tenant of the tenants file."""

    model_config = ConfigDict(extra="forbid")

    tokens: list[str] = Field(
        default_factory=list, description="Digests of its API tokens (E2B API keys too)."
    )
    grader_secrets: list[str] = Field(
        default_factory=list,
        description="Digests of its grader URL secrets: /agent-rft/grade/<secret> grades "
        "this tenant's rollouts without a header (docs/agent-rft.md).",
    )
    admin: bool = Field(False, description="Sees and drives every tenant's things.")
    quotas: Quotas = Field(default_factory=Quotas)

    @field_validator("tokens", "grader_secrets")
    @classmethod
    def _digests(cls, values: list[str]) -> list[str]:
        for value in values:
            if not DIGEST.fullmatch(value):
                raise ValueError(
                    "every entry is a digest, sha256:<64 hex digits>, never the token itself "
                    "(`orchestrator tenants token` makes a token and its digest)"
                )
        return values


class TenantsFile(BaseModel):
    """``ORCH_TENANTS_FILE``: ``tenants: {<name>: TenantConfig}``."""

    model_config = ConfigDict(extra="forbid")

    tenants: dict[str, TenantConfig] = Field(default_factory=dict)

    @field_validator("tenants")
    @classmethod
    def _names(cls, tenants: dict[str, TenantConfig]) -> dict[str, TenantConfig]:
        for name in tenants:
            if not TENANT_NAME.fullmatch(name):
                raise ValueError(f"tenant {name!r}: a name is [a-z0-9-], up to 41 characters")
        owners: dict[str, str] = {}
        for name, tenant in tenants.items():
            for kept in [*tenant.tokens, *tenant.grader_secrets]:
                if owners.setdefault(kept, name) != name:
                    raise ValueError(
                        f"one credential belongs to tenants {owners[kept]!r} and {name!r}"
                    )
        return tenants


class TenantsError(ValueError):
    """A tenants file or token list that cannot be used."""


def parse_tenants(text: str, origin: str = "the tenants file") -> TenantsFile:
    """The tenants file's text, checked; :class:`TenantsError` saying what is wrong."""
    try:
        raw = yaml.safe_load(text) or {}
        return TenantsFile.model_validate(raw)
    except (yaml.YAMLError, ValidationError) as exc:
        raise TenantsError(f"{origin}: {exc}") from None


def token_digests(api_tokens: list[str]) -> list[str]:
    """``ORCH_API_TOKENS``' entries as digests: a digest as it is, a plain token hashed."""
    kept = []
    for token in api_tokens:
        if token.startswith("sha256:"):
            if not DIGEST.fullmatch(token):
                raise TenantsError("ORCH_API_TOKENS: a sha256: entry is 64 hex digits")
            kept.append(token)
        else:
            kept.append(digest(token))
    return kept


@dataclass(frozen=True)
class Directory:
    """Credentials to principals, and tenants to their quotas: one reading of the file."""

    by_token: dict[str, Principal]
    by_grader_secret: dict[str, Principal]
    quotas: dict[str, Quotas]
    mtime_ns: int | None = None

    @classmethod
    def build(
        cls,
        api_tokens: list[str],
        grader_url_secret: str,
        file: TenantsFile | None,
        mtime_ns: int | None = None,
    ) -> Directory:
        by_token = {d: OPERATOR for d in token_digests(api_tokens)}
        by_secret = {digest(grader_url_secret): OPERATOR} if grader_url_secret else {}
        quotas: dict[str, Quotas] = {DEFAULT_TENANT: Quotas()}
        for name, tenant in (file.tenants if file else {}).items():
            principal = Principal(name, admin=tenant.admin, quotas=tenant.quotas)
            for kept in tenant.tokens:
                if kept in by_token:
                    raise TenantsError(f"tenant {name!r}: a token of ORCH_API_TOKENS too")
                by_token[kept] = principal
            for kept in tenant.grader_secrets:
                by_secret[kept] = principal
            quotas[name] = tenant.quotas
        return cls(by_token, by_secret, quotas, mtime_ns)


class Tenants:
    """The deployment's credentials, read again from the tenants file when it changes."""

    def __init__(self, api_tokens: list[str], grader_url_secret: str, path: Path | None) -> None:
        self._api_tokens = api_tokens
        self._grader_url_secret = grader_url_secret
        self.path = path
        self._lock = threading.Lock()
        self._checked = time.monotonic()
        self.directory = self._read()  # the first read fails the start when it is wrong
        self.last_error: str | None = None
        self._refused_mtime_ns: int | None = -1  # none refused yet (None: a missing file)
        self.on_change: Callable[[list[Change]], None] | None = None
        """Told what each new reading changed (the API records it in the audit log)."""

    def _read(self) -> Directory:
        if self.path is None:
            return Directory.build(self._api_tokens, self._grader_url_secret, None)
        try:
            mtime_ns = self.path.stat().st_mtime_ns
            text = self.path.read_text()
        except OSError as exc:
            raise TenantsError(f"ORCH_TENANTS_FILE {self.path}: {exc}") from None
        file = parse_tenants(text, f"ORCH_TENANTS_FILE {self.path}")
        return Directory.build(self._api_tokens, self._grader_url_secret, file, mtime_ns)

    def current(self) -> Directory:
        """The directory, read again first when the file changed (looked at once a second
        at most). A file that cannot be used now keeps the last good reading
        (``last_error`` says why)."""
        now = time.monotonic()
        if self.path is None or now - self._checked < RELOAD_CHECK_S:
            return self.directory
        with self._lock:
            if now - self._checked < RELOAD_CHECK_S:
                return self.directory
            self._checked = now
            try:
                mtime_ns: int | None = self.path.stat().st_mtime_ns
            except OSError:
                mtime_ns = None
            # A file refused once is not read again (nor logged again) until it changes.
            if mtime_ns not in (self.directory.mtime_ns, self._refused_mtime_ns):
                self._refused_mtime_ns = -1
                try:
                    before, self.directory = self.directory, self._read()
                    self.last_error = None
                    if self.on_change is not None:
                        self.on_change(changes(before, self.directory))
                except TenantsError as exc:
                    self.last_error = str(exc)
                    self._refused_mtime_ns = mtime_ns
                    log.error("tenants.reload_refused", error=self.last_error)
        return self.directory

    def by_token(self, token: str) -> Principal | None:
        """The principal a bearer token (or an E2B API key) acts for; None: none."""
        if not token:
            return None
        return self.current().by_token.get(digest(token))

    def by_grader_secret(self, secret: str) -> Principal | None:
        """The principal a grader URL's secret segment acts for; None: none."""
        if not secret:
            return None
        return self.current().by_grader_secret.get(digest(secret))

    def quotas(self, tenant: str) -> Quotas:
        return self.current().quotas.get(tenant) or Quotas()

    def names(self) -> list[str]:
        return sorted(self.current().quotas)


def credential_id(kept: str) -> str:
    """A kept credential named in a log line: its digest's first 12 hex digits (a name for
    it, not a way to it)."""
    return kept.removeprefix("sha256:")[:12]


Change = tuple[str, dict[str, object]]
"""A change of the tenants file, as the audit log records it: its event's name
(state/audit.AuditEvent) and what changed."""


def changes(before: Directory, after: Directory) -> list[Change]:
    """What a new reading of the tenants file changed: who can now call, and who no
    longer can. Credentials are named by :func:`credential_id` only."""
    found: list[Change] = []
    for kind, old, new in (
        ("token", before.by_token, after.by_token),
        ("grader_secret", before.by_grader_secret, after.by_grader_secret),
    ):
        for kept in sorted(new.keys() - old.keys()):
            who = {"tenant": new[kept].tenant, "admin": new[kept].admin}
            found.append(
                ("credential_added", {"kind": kind, **who, "credential": credential_id(kept)})
            )
        for kept in sorted(old.keys() - new.keys()):
            who = {"tenant": old[kept].tenant}
            found.append(
                ("credential_revoked", {"kind": kind, **who, "credential": credential_id(kept)})
            )
    for name in sorted(after.quotas.keys() - before.quotas.keys()):
        found.append(("tenant_added", {"tenant": name}))
    for name in sorted(before.quotas.keys() - after.quotas.keys()):
        found.append(("tenant_removed", {"tenant": name}))
    for name in sorted(after.quotas.keys() & before.quotas.keys()):
        if after.quotas[name] != before.quotas[name]:
            quotas = after.quotas[name].model_dump(exclude_none=True)
            found.append(("quotas_changed", {"tenant": name, "quotas": quotas}))
    return found
