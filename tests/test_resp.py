"""state/resp.py, the call path's lean Redis connections, on real Redis: the suite's, and
one of this module's own with a password and a Unix socket.

Pipelined commands of many coroutines on one connection each get their own reply; an error
reply reaches only its caller; a lost connection fails what was in flight and the next
command connects again (retried when the caller says it is safe); a script Redis forgot is
loaded again; a blocking command cancelled takes its connection with it; a thread's
connection is its own; a Redis that hangs fails its commands in bounded time.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from orchestrator.config import Settings
from orchestrator.local import free_port
from orchestrator.state import resp
from orchestrator.state.resp import AsyncConnection, BlockingPool, Script, SyncConnection
from tests.redis_units import delete_keys

NAME = "orch:test:resp"


@pytest.fixture()
def prefix(settings: Settings) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted after."""
    prefix = f"{settings.deployment}:resp:{uuid.uuid4().hex[:8]}:"
    yield prefix
    delete_keys(settings.redis_url, f"{prefix}*")


@pytest.fixture(scope="module")
def private_redis() -> Iterator[dict[str, str]]:
    """A Redis of this module's own: a password, a Unix socket and TCP."""
    directory = Path(tempfile.mkdtemp(prefix="orch-resp-", dir="/tmp"))
    port = free_port()
    socket_path = directory / "redis.sock"
    server = subprocess.Popen(
        [
            "redis-server", "--port", str(port), "--bind", "127.0.0.1",
            "--unixsocket", str(socket_path), "--unixsocketperm", "700",
            "--requirepass", "s3cret", "--save", "", "--appendonly", "no",
            "--dir", str(directory),
        ],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while not socket_path.exists():
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)
        yield {
            "tcp": f"redis://:s3cret@127.0.0.1:{port}/3",
            "unix": f"unix://:s3cret@{socket_path}?db=3",
            "wrong": f"redis://:nope@127.0.0.1:{port}/0",
        }
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture()
def admin(private_redis: dict[str, str]) -> Iterator[redis.Redis]:
    """A redis-py client of the private Redis; its database is emptied after the test."""
    client = redis.Redis.from_url(private_redis["tcp"])
    yield client
    client.flushdb()
    client.close()


def test_many_coroutines_pipelined_on_one_connection_each_get_their_reply(
    settings: Settings, prefix: str
) -> None:
    async def main() -> None:
        connection = AsyncConnection(settings.redis_url, NAME)
        try:

            async def one(i: int) -> str:
                await connection.call("SET", f"{prefix}{i}", f"value-{i}")
                await asyncio.sleep(0)
                reply: str = await connection.call("GET", f"{prefix}{i}")
                return reply

            replies = await asyncio.gather(*(one(i) for i in range(300)))
            assert replies == [f"value-{i}" for i in range(300)]
            names = await connection.call("CLIENT", "GETNAME")
            assert names == NAME
        finally:
            await connection.close()

    asyncio.run(main())


def test_an_error_reply_reaches_only_its_caller(settings: Settings, prefix: str) -> None:
    async def main() -> None:
        connection = AsyncConnection(settings.redis_url, NAME)
        try:
            await connection.call("SET", f"{prefix}text", "not a number")
            results = await asyncio.gather(
                connection.call("PING"),
                connection.call("INCR", f"{prefix}text"),
                connection.call("ECHO", "after"),
                return_exceptions=True,
            )
            assert results[0] == "PONG" and results[2] == "after"
            assert isinstance(results[1], redis.ResponseError)
            assert "not an integer" in str(results[1])
        finally:
            await connection.close()

    asyncio.run(main())


def test_a_lost_connection_fails_what_was_in_flight_and_is_retried_when_safe(
    private_redis: dict[str, str], admin: redis.Redis
) -> None:
    name = f"{NAME}:{uuid.uuid4().hex[:6]}"

    async def main() -> None:
        pool = BlockingPool(private_redis["tcp"], name)
        connection = AsyncConnection(private_redis["tcp"], name)
        try:
            await connection.call("PING")
            waiting = asyncio.ensure_future(pool.call("BLPOP", "never", 20, block_s=20))
            await asyncio.sleep(0.3)
            assert admin.client_kill_filter(skipme=True) >= 2
            with pytest.raises(redis.ConnectionError):
                await waiting
            # Not retried, yet connected again: the loss was seen before it was sent.
            assert await connection.call("PING") == "PONG"
            # A command in flight when its connection dies is retried when safe: writes are
            # held by a pause, so the INCR is in flight when its connection is killed.
            admin.client_pause(500, all=False)
            racing = asyncio.ensure_future(connection.call("INCR", "counter", retry=True))
            await asyncio.sleep(0.1)
            admin.client_kill_filter(skipme=True)
            assert await racing in (1, 2)
            assert await pool.call("LPUSH", "l", "x", block_s=0) == 1
        finally:
            await connection.close()
            await pool.close()

    asyncio.run(main())


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_password_database_and_unix_socket(private_redis: dict[str, str], transport: str) -> None:
    url = private_redis[transport]

    async def main() -> None:
        connection = AsyncConnection(url, NAME)
        try:
            await connection.call("SET", "where", transport)
        finally:
            await connection.close()

    asyncio.run(main())
    sync = SyncConnection(url, NAME)
    try:
        assert sync.call("GET", "where") == transport
        assert sync.call("CLIENT", "GETNAME") == NAME
    finally:
        sync.close()
    check = redis.Redis.from_url(url.replace("/3", "/0").replace("db=3", "db=0"))
    assert check.get("where") is None, "SELECT was not applied"
    check.close()


def test_a_refused_password_is_an_authentication_error(private_redis: dict[str, str]) -> None:
    async def main() -> None:
        connection = AsyncConnection(private_redis["wrong"], NAME)
        with pytest.raises(redis.AuthenticationError):
            await connection.call("PING")
        await connection.close()

    asyncio.run(main())
    with pytest.raises(redis.AuthenticationError):
        SyncConnection(private_redis["wrong"], NAME).call("PING")


def test_a_script_redis_forgot_is_loaded_again(
    private_redis: dict[str, str], admin: redis.Redis
) -> None:
    script = Script("return redis.call('INCRBY', KEYS[1], ARGV[1])")

    async def main() -> None:
        connection = AsyncConnection(private_redis["tcp"], NAME)
        try:
            admin.script_flush()
            assert await script.run(connection, ["n"], [2]) == 2
            admin.script_flush()
            assert await script.run(connection, ["n"], [3]) == 5
        finally:
            await connection.close()

    asyncio.run(main())
    sync = SyncConnection(private_redis["tcp"], NAME)
    admin.script_flush()
    assert script.run_sync(sync, ["n"], [10]) == 15
    sync.close()


def test_a_cancelled_blocking_command_takes_its_connection_with_it(
    private_redis: dict[str, str], admin: redis.Redis
) -> None:

    async def main() -> None:
        pool = BlockingPool(private_redis["tcp"], f"{NAME}:cancel")
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(pool.call("BLPOP", "later", 5, block_s=5), 0.3)
            # Its answer would have been someone else's: the connection is gone, and the
            # element pushed now is not popped by a ghost.
            admin.rpush("later", "x")
            assert await pool.call("LPOP", "later", block_s=0) == "x"
        finally:
            await pool.close()

    asyncio.run(main())


def test_each_thread_has_its_own_connection(settings: Settings, prefix: str) -> None:
    sync = SyncConnection(settings.redis_url, NAME)
    seen: list[int] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            ident = sync.call("CLIENT", "ID")
            for _ in range(200):
                sync.call("INCR", f"{prefix}n")
            assert sync.call("CLIENT", "ID") == ident
            seen.append(ident)
        except BaseException as exc:  # noqa: BLE001 - reported below, in the main thread
            errors.append(exc)
        finally:
            sync.close()

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(set(seen)) == 8
    assert sync.call("GET", f"{prefix}n") == "1600"
    sync.close()


def test_a_hung_redis_is_a_lost_connection_on_every_kind_not_a_wait_forever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Redis that hangs (its process stopped: its kernel still acknowledges, nothing
    answers, as a frozen primary or one cut off without a reset) fails a command within
    ``REPLY_TIMEOUT_S`` past the time it blocks by design, as a lost connection: the
    pipelined connection, the blocking pool's and a thread's. Once Redis answers again, the
    next command connects again."""
    monkeypatch.setattr(resp, "REPLY_TIMEOUT_S", 0.5)
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"redis://127.0.0.1:{port}/0"
    sync = SyncConnection(url, NAME, timeout_s=0.5)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                assert sync.call("PING") == "PONG"
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

        async def hung() -> list[float]:
            connection = AsyncConnection(url, NAME)
            pool = BlockingPool(url, NAME)
            try:
                assert await connection.call("PING") == "PONG"
                # The pool's connection made (and idle) before Redis hangs: a new one would
                # fail its handshake instead, within CONNECT_TIMEOUT_S.
                assert await pool.call("BLPOP", "hung", 0.05, block_s=0.05) is None
                server.send_signal(signal.SIGSTOP)
                took = []
                for command in (
                    connection.call("PING", retry=False),
                    pool.call("BLPOP", "hung", 0.3, block_s=0.3),
                ):
                    started = time.monotonic()
                    with pytest.raises(redis.ConnectionError, match="no reply from Redis"):
                        await command
                    took.append(time.monotonic() - started)
                server.send_signal(signal.SIGCONT)
                assert await connection.call("PING") == "PONG"
                assert await pool.call("BLPOP", "hung", 0.05, block_s=0.05) is None
                return took
            finally:
                server.send_signal(signal.SIGCONT)
                await connection.close()
                await pool.close()

        pipelined, blocking = asyncio.run(hung())
        assert 0.5 <= pipelined < 2.5 and 0.8 <= blocking < 2.8, (pipelined, blocking)
        server.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(redis.ConnectionError):
            sync.call("PING")
        assert time.monotonic() - started < 2.5
        server.send_signal(signal.SIGCONT)
        assert sync.call("PING") == "PONG"
    finally:
        server.send_signal(signal.SIGCONT)
        sync.close()
        server.terminate()
        server.wait(timeout=10)
