"""Redis behind Sentinel: where the primary is now, asked of the Sentinels, for every client
of the deployment (redis-py's, the call path's own connections, Celery's).

A deployment names a Sentinel-watched Redis with one URL in ``redis_url``::

    redis+sentinel://[[user]:password@]host:port[,host:port...]/<service>[/<db>]

``service`` is the name the Sentinels monitor the primary under (``sentinel monitor
<service> ...``); the password, if any, is the data nodes' and the Sentinels' both (as the
chart sets them). Every other URL is a plain Redis URL and goes to redis-py unchanged.

Why the primary is asked for at each connect, never kept: after a failover the old primary
is gone, or back as a replica that refuses writes (READONLY); each client's next
connection then finds the new one. What a failover can lose, and how the deployment makes
that loss visible, is docs/failure-model.md, "Redis failover".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.sentinel import Sentinel

SCHEME = "redis+sentinel"
# How long one Sentinel may take to answer where the primary is before the next is asked.
SENTINEL_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed ``redis+sentinel://`` URL."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None

    @classmethod
    def parse(cls, url: str) -> SentinelUrl:
        """``url`` read, or ValueError saying what is wrong with it."""
        parts = urlsplit(url)
        if parts.scheme != SCHEME:
            raise ValueError(f"{url!r} is not a {SCHEME}:// URL")
        _, _, hosts = parts.netloc.rpartition("@")
        sentinels = []
        for address in filter(None, hosts.split(",")):
            host, sep, port = address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"{url!r}: a Sentinel is host:port, not {address!r}")
            sentinels.append((host.strip("[]"), int(port)))
        if not sentinels:
            raise ValueError(f"{url!r} names no Sentinel")
        path = [p for p in parts.path.split("/") if p]
        if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
            raise ValueError(f"{url!r}: the path is /<service>[/<db>]")
        return cls(
            sentinels=tuple(sentinels),
            service=unquote(path[0]),
            db=int(path[1]) if len(path) == 2 else 0,
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password is not None else None,
        )

    def auth(self) -> dict[str, Any]:
        """The credentials of the data nodes and the Sentinels."""
        return {"username": self.username, "password": self.password}

    def sentinel(self) -> Sentinel:
        """redis-py's blocking Sentinel client for these Sentinels."""
        return Sentinel(
            list(self.sentinels),
            sentinel_kwargs={**self.auth(), "socket_timeout": SENTINEL_TIMEOUT_S},
            socket_timeout=SENTINEL_TIMEOUT_S,
        )

    def async_sentinel(self) -> AsyncSentinel:
        """redis-py's asyncio Sentinel client for these Sentinels."""
        return AsyncSentinel(
            list(self.sentinels),
            sentinel_kwargs={**self.auth(), "socket_timeout": SENTINEL_TIMEOUT_S},
            socket_timeout=SENTINEL_TIMEOUT_S,
        )

    def primary(self) -> tuple[str, int]:
        """Where the primary is now, by the first Sentinel that knows one that is up;
        ``redis.ConnectionError`` when none does (no Sentinel answers, or a failover has
        not elected one yet)."""
        try:
            host, port = self.sentinel().discover_master(self.service)
        except redis.sentinel.MasterNotFoundError as exc:
            raise redis.ConnectionError(f"no Redis primary for {self.service!r}: {exc}") from exc
        return str(host), int(port)

    async def primary_async(self) -> tuple[str, int]:
        """:meth:`primary`, on the event loop."""
        sentinel = self.async_sentinel()
        try:
            host, port = await sentinel.discover_master(self.service)
        except redis.sentinel.MasterNotFoundError as exc:
            raise redis.ConnectionError(f"no Redis primary for {self.service!r}: {exc}") from exc
        finally:
            for client in sentinel.sentinels:
                await client.aclose()
        return str(host), int(port)

    def celery(self) -> tuple[str, dict[str, Any]]:
        """The broker URL and transport options kombu's Sentinel transport takes (Celery's
        Sentinel result backend takes the same)."""
        auth = ""
        if self.password is not None:
            auth = f"{self.username or ''}:{self.password}@"
        url = ";".join(f"sentinel://{auth}{host}:{port}/{self.db}" for host, port in self.sentinels)
        options: dict[str, Any] = {"master_name": self.service}
        if self.password is not None:
            options["sentinel_kwargs"] = self.auth()
        return url, options


def online_replicas(replication: dict[str, Any]) -> int:
    """Replicas past their first full sync with the primary, from the primary's ``INFO
    replication`` as redis-py parses it (a ``slaveN`` entry each)."""
    return sum(
        1
        for key, value in replication.items()
        if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online"
    )


def is_sentinel(url: str) -> bool:
    """Whether ``url`` names a Sentinel-watched Redis."""
    return url.startswith(SCHEME + "://")
