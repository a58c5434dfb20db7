"""Lean Redis connections for the tool call's path: a command costs its RESP bytes and one
read, parsed by hiredis, and nothing else.

Why not redis-py there: on this project's 2-core hosts redis-py 8 spends 160-180 us of CPU
per command on its asyncio client (its pool, retry and observability layers around each
command) and 95-110 us on its blocking one, against 33-48 us and 20 us for the same
EVALSHA through these (measured side by side, 5,000 commands each; docs/architecture.md,
"What a call costs"). A steady call makes five such commands (begin, reply, end on the API
side; claim, finish on the worker's), so on the hot path that difference was most of what
Redis cost per call. Everything off the hot path keeps redis-py.

- :class:`AsyncConnection` (the API): one connection shared by every coroutine of the
  process. Commands are written as they come and RESP answers them in order, so
  concurrent calls pipeline on it without a pool. Never for blocking commands: those go
  through a :class:`BlockingPool`, a connection each while they block.
- :class:`SyncConnection` (a worker thread): one blocking connection per thread.
- :class:`Script`: EVALSHA, loading the script when Redis does not know it (NOSCRIPT,
  after a restart or a SCRIPT FLUSH).

A reply that does not come within :data:`REPLY_TIMEOUT_S` (past the time a blocking
command blocks) is a lost connection too: a hung Redis acknowledges at the TCP level and
answers nothing.

Failures look like redis-py's, so the layers above catch one name
(:data:`~orchestrator.state.errors.StateError`): a lost or refused connection is a
``redis.ConnectionError``, an error reply a ``redis.ResponseError``. A command that lost its
connection is retried on a new one, with backoff, only where the caller says running it
twice is safe (``retry=True``: every script of the call path is).

URLs are read by redis-py's own parser: ``redis://[[user]:password@]host[:port][/db]``,
``rediss://`` (TLS, ``ssl_cert_reqs`` and ``ssl_ca_certs`` from the query) and
``unix://path[?db=N]``; a ``redis+sentinel://`` URL (state/sentinel.py) is a primary asked
of the Sentinels at each connect. After a failover a connection to the old primary is
lost, or refused writes (READONLY: it came back as a replica), and either is a lost
connection here: the next one goes to the new primary, and a retried command keeps trying
for :data:`FAILOVER_RETRY_S`, the time Sentinel takes to elect one. Each connection names
itself (CLIENT SETNAME), so ``CLIENT LIST`` and tests/e2e/test_round_trips.py see whose it
is.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import hiredis
import redis
from redis.connection import parse_url

from orchestrator.state.sentinel import SentinelUrl, is_sentinel

Arg = str | bytes | int | float
CONNECT_TIMEOUT_S = 5.0
# A command that lost its connection is tried again this many times (when safe), after
# RETRY_FIRST_S, doubling up to RETRY_MAX_S: about 3 s in all, the time a restarting local
# Redis takes to listen again (redis-py's retry here was 4 tries, 0.05 s doubling to 1 s).
RETRIES = 6
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0
# Behind Sentinel a retried command keeps trying this long, a quarter second apart: a
# primary is declared down after the Sentinels' down-after-milliseconds (the chart's: 5 s),
# and a replica is promoted within a second or two of that.
FAILOVER_RETRY_S = 15.0
FAILOVER_RETRY_EVERY_S = 0.25
# How long a command's reply may take (beyond the time it blocks by design: BLPOP's) before
# its connection is taken as lost. A Redis that hangs (its process frozen, its node cut off
# without a reset) keeps the TCP connection open, its kernel still acknowledging, and
# answers nothing: without this every call waited on it forever, a failover included
# (tests/k8s/test_helm_install.py, the chart's Sentinel mode). A loaded Redis answers a
# call path's script in milliseconds.
REPLY_TIMEOUT_S = 5.0
# How long a write waits for its replicas (WAIT) before it is taken as not kept: healthy
# replicas acknowledge within a millisecond or two on one network.
REPLICA_WAIT_MS = 1000


@dataclass(frozen=True)
class Endpoint:
    """Where a Redis URL points, and how to talk to it."""

    host: str
    port: int
    path: str | None
    db: int
    username: str | None
    password: str | None
    tls: ssl.SSLContext | None
    sentinel: SentinelUrl | None = None

    @classmethod
    def from_url(cls, url: str) -> Endpoint:
        if is_sentinel(url):
            parsed = SentinelUrl.parse(url)
            return cls(
                host="",
                port=0,
                path=None,
                db=parsed.db,
                username=parsed.username,
                password=parsed.password,
                tls=None,
                sentinel=parsed,
            )
        options = parse_url(url)  # type: ignore[no-untyped-call]
        tls: ssl.SSLContext | None = None
        if options.get("connection_class") is redis.SSLConnection:
            tls = ssl.create_default_context(cafile=options.get("ssl_ca_certs"))
            if options.get("ssl_cert_reqs") in ("none", ssl.CERT_NONE):
                tls.check_hostname = False
                tls.verify_mode = ssl.CERT_NONE
        return cls(
            host=options.get("host", "localhost"),
            port=int(options.get("port", 6379)),
            path=options.get("path"),
            db=int(options.get("db", 0)),
            username=options.get("username"),
            password=options.get("password"),
            tls=tls,
        )

    def handshake(self, name: str) -> list[tuple[Arg, ...]]:
        """The commands a new connection sends first (their replies are checked)."""
        commands: list[tuple[Arg, ...]] = []
        if self.password is not None:
            user = (self.username,) if self.username else ()
            commands.append(("AUTH", *user, self.password))
        if self.db:
            commands.append(("SELECT", self.db))
        commands.append(("CLIENT", "SETNAME", name))
        return commands


def _reader() -> hiredis.Reader:
    # Error replies come back as values (not raised), so each lands with its own caller.
    return hiredis.Reader(
        encoding="utf-8",
        protocolError=redis.ConnectionError,
        replyError=redis.ResponseError,
    )


def _pack(args: Sequence[Arg]) -> bytes:
    packed: bytes = hiredis.pack_command(tuple(args))  # type: ignore[arg-type]
    return packed


def _backoff(attempt: int) -> float:
    return float(min(RETRY_MAX_S, RETRY_FIRST_S * (2**attempt)))


class _Retries:
    """When a command that lost its connection is tried again: :data:`RETRIES` times with
    backoff, and behind Sentinel for :data:`FAILOVER_RETRY_S` (a failover's length)."""

    def __init__(self, endpoint: Endpoint, for_s: float | None = None) -> None:
        self.failover = endpoint.sentinel is not None
        self.attempt = 0
        window = for_s if for_s is not None else (FAILOVER_RETRY_S if self.failover else None)
        self.deadline = None if window is None else time.monotonic() + window

    def next_wait(self) -> float | None:
        """Seconds to wait before the next try, or None: give up."""
        if self.deadline is None:
            if self.attempt >= RETRIES:
                return None
        elif time.monotonic() >= self.deadline:
            return None
        wait = FAILOVER_RETRY_EVERY_S if self.failover else _backoff(self.attempt)
        wait = min(wait, _backoff(self.attempt))
        self.attempt += 1
        return wait


def _demoted(reply: object) -> bool:
    """Whether ``reply`` is a replica refusing a write: the primary this connection was
    made to has been demoted by a failover."""
    return isinstance(reply, redis.ResponseError) and str(reply).startswith("READONLY")


# -- the API's: asyncio ------------------------------------------------------------------------


class _Protocol(asyncio.Protocol):
    """One connection: writes commands, resolves their futures in order as replies come.
    Each waits with its deadline; a watchdog looks at the oldest now and then (replies
    come in order, so it is the first to be late), not a timer per command: the call path
    sends thousands a second."""

    def __init__(self) -> None:
        self.reader = _reader()
        self.waiting: deque[tuple[asyncio.Future[Any], float]] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost: Exception | None = None
        self._watchdog: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._watch()

    def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        self._watchdog = loop.call_later(max(0.05, REPLY_TIMEOUT_S / 4), self._look)

    def _look(self) -> None:
        if self.lost is not None:
            return
        if self.waiting and self.waiting[0][1] < asyncio.get_running_loop().time():
            self.abandon(redis.ConnectionError("no reply from Redis in time: taken as lost"))
            return
        self._watch()

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            try:
                reply = self.reader.gets()
            except redis.ConnectionError as exc:  # not RESP: nothing after it can be read
                self._fail(exc)
                if self.transport is not None:
                    self.transport.close()
                return
            if reply is False:
                return
            if not self.waiting:  # a reply nobody asked for: the stream is out of step
                self._fail(redis.ConnectionError("Redis sent a reply no command asked for"))
                if self.transport is not None:
                    self.transport.close()
                return
            future, _ = self.waiting.popleft()
            if _demoted(reply):  # every later command on it would be refused too
                lost = redis.ConnectionError(f"Redis is a replica now: {reply}")
                if not future.done():
                    future.set_exception(lost)
                self._fail(lost)
                if self.transport is not None:
                    self.transport.close()
                return
            if future.done():  # its caller was cancelled; the reply is dropped
                continue
            if isinstance(reply, redis.ResponseError):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(redis.ConnectionError(f"connection to Redis lost: {exc or 'closed'}"))

    def abandon(self, exc: Exception) -> None:
        """No reply came in time: fail every command waiting on this connection and close
        it (its stream can no longer be trusted to be in step)."""
        self._fail(exc)
        if self.transport is not None:
            self.transport.close()

    def _fail(self, exc: Exception) -> None:
        self.lost = exc
        if self._watchdog is not None:
            self._watchdog.cancel()
        while self.waiting:
            future, _ = self.waiting.popleft()
            if not future.done():
                future.set_exception(exc)

    def send(self, args: Sequence[Arg], block_s: float = 0.0) -> asyncio.Future[Any]:
        """The future of the command's reply; failed when none came within ``block_s``
        (the time it blocks by design) plus :data:`REPLY_TIMEOUT_S`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if self.lost is not None or self.transport is None or self.transport.is_closing():
            future.set_exception(self.lost or redis.ConnectionError("not connected to Redis"))
            return future
        self.waiting.append((future, loop.time() + block_s + REPLY_TIMEOUT_S))
        self.transport.write(_pack(args))
        return future


class AsyncConnection:
    """A Redis connection for every coroutine of an event loop, commands pipelined on it
    (see the module's docstring). Connects on first use and again after a loss. Not for
    blocking commands (BLPOP and the like): :class:`BlockingPool` is."""

    def __init__(self, url: str, name: str) -> None:
        self.endpoint = Endpoint.from_url(url)
        self.name = name
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Lock | None = None

    async def call(self, *args: Arg, retry: bool = False, block_s: float = 0.0) -> Any:
        """The reply to one command. ``retry``: the command may run twice (it is retried
        on a new connection when its connection was lost, whether or not Redis ran it).
        ``block_s``: how long the command blocks by design (BLPOP's timeout); a reply
        later than that plus :data:`REPLY_TIMEOUT_S` loses the connection."""
        retries = _Retries(self.endpoint)
        while True:
            try:
                protocol = await self._connected()
                return await protocol.send(args, block_s)
            except redis.ConnectionError:
                wait = retries.next_wait() if retry else None
                if wait is None:
                    raise
                await asyncio.sleep(wait)

    async def close(self) -> None:
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()

    async def _connected(self) -> _Protocol:
        protocol = self._protocol
        if protocol is not None and protocol.lost is None:
            return protocol
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._protocol is not None and self._protocol.lost is None:
                return self._protocol
            self._protocol = await _open(self.endpoint, self.name)
            return self._protocol


async def _open(endpoint: Endpoint, name: str) -> _Protocol:
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            host, port = endpoint.host, endpoint.port
            if endpoint.sentinel is not None:
                host, port = await endpoint.sentinel.primary_async()
            if endpoint.path is not None:
                _, protocol = await loop.create_unix_connection(_Protocol, endpoint.path)
            else:
                _, protocol = await loop.create_connection(
                    _Protocol,
                    host,
                    port,
                    ssl=endpoint.tls,
                    server_hostname=host if endpoint.tls else None,
                )
            replies = [protocol.send(command) for command in endpoint.handshake(name)]
            await asyncio.gather(*replies)
    except (OSError, TimeoutError) as exc:
        raise redis.ConnectionError(f"cannot connect to Redis: {exc}") from exc
    except redis.ResponseError as exc:  # AUTH or SELECT refused
        raise redis.AuthenticationError(str(exc)) from exc
    return protocol


class BlockingPool:
    """Connections for blocking commands (BLPOP): each command has a connection to itself
    until Redis answers; idle ones are kept for the next. A command whose caller was
    cancelled takes its connection with it (the answer it still holds is nobody's)."""

    def __init__(self, url: str, name: str) -> None:
        self.url = url
        self.name = name
        self._idle: list[AsyncConnection] = []

    async def call(self, *args: Arg, block_s: float) -> Any:
        """The reply to one blocking command that blocks up to ``block_s``."""
        connection = self._idle.pop() if self._idle else AsyncConnection(self.url, self.name)
        try:
            reply = await connection.call(*args, block_s=block_s)
        except BaseException:
            await connection.close()
            raise
        self._idle.append(connection)
        return reply

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            await connection.close()


# -- a worker thread's: blocking ---------------------------------------------------------------


class SyncConnection:
    """A blocking Redis connection per thread of the process (Celery runs tasks in
    threads); connects on first use in a thread and again after a loss."""

    def __init__(self, url: str, name: str, *, timeout_s: float = REPLY_TIMEOUT_S) -> None:
        """``timeout_s``: how long a reply may take before the connection is taken as
        lost (each read; a WAIT blocks up to :data:`REPLICA_WAIT_MS`, less)."""
        self.endpoint = Endpoint.from_url(url)
        self.name = name
        self.timeout_s = timeout_s
        self._local = threading.local()

    def call(
        self,
        *args: Arg,
        retry: bool = False,
        retry_for_s: float | None = None,
        replicas: int = 0,
    ) -> Any:
        """The reply to one command. ``retry``: safe to run twice, so retried on a new
        connection after a loss (``retry_for_s``: for that long, instead of
        :data:`RETRIES` times). ``replicas``: the write must reach that many replicas
        before it counts (WAIT, in the same round trip): one that did not within
        :data:`REPLICA_WAIT_MS` is taken as a lost connection (after a failover it may be
        on a demoted primary only), so a retry runs it again, on the primary then."""
        request = _pack(args)
        if replicas:
            request += _pack(("WAIT", replicas, REPLICA_WAIT_MS))
        retries = _Retries(self.endpoint, retry_for_s)
        while True:
            try:
                if not replicas:
                    return self._exchange(request)
                reply, acked = self._exchange(request, replies=2)
                if isinstance(reply, redis.ResponseError):
                    raise reply
                if int(acked) < replicas:
                    raise redis.ConnectionError(
                        f"a write reached {acked} of the {replicas} replicas it needs"
                    )
                return reply
            except redis.ConnectionError:
                self._drop()
                wait = retries.next_wait() if retry else None
                if wait is None:
                    raise
                time.sleep(wait)

    def close(self) -> None:
        """Close this thread's connection (others close with their threads)."""
        self._drop()

    def _exchange(self, request: bytes, replies: int = 1) -> Any:
        """Send ``request`` and read its reply (an error reply raised); with ``replies``
        > 1, that many replies as a list (error replies in it, to keep the stream in
        step)."""
        sock, reader = self._connected()
        answers: list[Any] = []
        try:
            sock.sendall(request)
            while len(answers) < replies:
                reply = reader.gets()
                while reply is False:
                    data = sock.recv(65536)
                    if not data:
                        raise redis.ConnectionError("Redis closed the connection")
                    reader.feed(data)
                    reply = reader.gets()
                answers.append(reply)
        except OSError as exc:
            raise redis.ConnectionError(f"connection to Redis lost: {exc}") from exc
        for reply in answers:
            if _demoted(reply):
                raise redis.ConnectionError(f"Redis is a replica now: {reply}")
        if replies > 1:
            return answers
        if isinstance(answers[0], redis.ResponseError):
            raise answers[0]
        return answers[0]

    def _connected(self) -> tuple[socket.socket, hiredis.Reader]:
        held = getattr(self._local, "held", None)
        if held is not None:
            return held  # type: ignore[no-any-return]
        endpoint = self.endpoint
        try:
            host, port = endpoint.host, endpoint.port
            if endpoint.sentinel is not None:
                host, port = endpoint.sentinel.primary()
            if endpoint.path is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(CONNECT_TIMEOUT_S)
                sock.connect(endpoint.path)
            else:
                sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if endpoint.tls is not None:
                    sock = endpoint.tls.wrap_socket(sock, server_hostname=host)
            sock.settimeout(self.timeout_s)
        except OSError as exc:
            raise redis.ConnectionError(f"cannot connect to Redis: {exc}") from exc
        held = (sock, _reader())
        self._local.held = held
        try:
            for command in endpoint.handshake(self.name):
                self._exchange(_pack(command))
        except redis.ResponseError as exc:
            self._drop()
            raise redis.AuthenticationError(str(exc)) from exc
        return held

    def _drop(self) -> None:
        held = getattr(self._local, "held", None)
        self._local.held = None
        if held is not None:
            with contextlib.suppress(OSError):
                held[0].close()


# -- scripts -----------------------------------------------------------------------------------


class Script:
    """A Lua script run by its SHA1 (EVALSHA), loaded when Redis answers NOSCRIPT."""

    def __init__(self, source: str) -> None:
        self.source = source
        # Redis names scripts by SHA1; not a security use.
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()

    def command(self, keys: Sequence[Arg], args: Sequence[Arg]) -> tuple[Arg, ...]:
        return ("EVALSHA", self.sha, len(keys), *keys, *args)

    async def run(
        self, connection: AsyncConnection, keys: Sequence[Arg], args: Sequence[Arg]
    ) -> Any:
        """Run it; a script that changes state is safe to run twice on this project's call
        path (each says why), so a lost connection is retried."""
        try:
            return await connection.call(*self.command(keys, args), retry=True)
        except redis.ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            await connection.call("SCRIPT", "LOAD", self.source, retry=True)
            return await connection.call(*self.command(keys, args), retry=True)

    def run_sync(
        self,
        connection: SyncConnection,
        keys: Sequence[Arg],
        args: Sequence[Arg],
        *,
        retry_for_s: float | None = None,
        replicas: int = 0,
    ) -> Any:
        """:meth:`run`, blocking; ``replicas``: as :meth:`SyncConnection.call`'s."""
        call: Callable[..., Any] = connection.call
        command = self.command(keys, args)
        try:
            return call(*command, retry=True, retry_for_s=retry_for_s, replicas=replicas)
        except redis.ResponseError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
            call("SCRIPT", "LOAD", self.source, retry=True, retry_for_s=retry_for_s)
            return call(*command, retry=True, retry_for_s=retry_for_s, replicas=replicas)
