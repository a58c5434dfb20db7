"""Labels stamped on every sandbox and its volume, so any process can find and reap them
after any crash, even when every other record of them is lost."""

from __future__ import annotations

from datetime import UTC, datetime

PREFIX = "orchestrator."
MANAGED = PREFIX + "managed"
DEPLOYMENT = PREFIX + "deployment"
SANDBOX = PREFIX + "sandbox"
ROLLOUT = PREFIX + "rollout"
HOST = PREFIX + "host"
RUNTIME = PREFIX + "runtime"
CREATED = PREFIX + "created"
EXPIRES = PREFIX + "expires"


def sandbox_labels(
    *,
    deployment: str,
    sandbox_id: str,
    rollout_id: str,
    host: str,
    runtime: str,
    created_at: datetime,
    expires_at: datetime,
) -> dict[str, str]:
    return {
        MANAGED: "true",
        DEPLOYMENT: deployment,
        SANDBOX: sandbox_id,
        ROLLOUT: rollout_id,
        HOST: host,
        RUNTIME: runtime,
        CREATED: created_at.isoformat(),
        EXPIRES: expires_at.isoformat(),
    }


def deployment_filter(deployment: str) -> list[str]:
    """A docker ``label`` filter selecting everything this deployment owns."""
    return [f"{MANAGED}=true", f"{DEPLOYMENT}={deployment}"]


def parse_time(value: str | None) -> datetime:
    """A label's timestamp; a missing or garbled one counts as the epoch (so: expired)."""
    if value:
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            pass
        else:
            return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)
    return datetime.fromtimestamp(0, tz=UTC)
