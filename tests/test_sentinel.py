"""Redis behind Sentinel (state/sentinel.py) for every kind of client the deployment has:
the call path's lean connections (state/resp.py, the API's asyncio one and a worker
thread's), redis-py's (state/connection.py) and Celery's (kombu's Sentinel transport).

On real processes (tests/redis_ha.py): a primary, its replica and three Sentinels. The
primary is killed (SIGKILL) or handed over (SENTINEL FAILOVER, which demotes it alive,
so connections to it are refused writes): a command that is safe to retry completes on
the new primary once Sentinel has promoted it, within a bound, without the caller doing
anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from celery import Celery

from orchestrator.config import Settings
from orchestrator.environments.loader import load_environments
from orchestrator.local import free_port
from orchestrator.state.broker import celery_url, make_celery
from orchestrator.state.collector import StateCollector
from orchestrator.state.connection import async_redis_client, redis_client
from orchestrator.state.resp import FAILOVER_RETRY_S, AsyncConnection, SyncConnection
from orchestrator.state.sentinel import SentinelUrl
from tests.redis_ha import REPLICAS, SERVICE, Sentinels
from tests.test_metrics_unit import collect

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "redis-sentinel.sh"

# -- the URL ----------------------------------------------------------------------------------


def test_a_sentinel_url_is_read_whole() -> None:
    parsed = SentinelUrl.parse("redis+sentinel://u:p%40ss@s1:26379,[::1]:26380/orch/3")
    assert parsed == SentinelUrl(
        sentinels=(("s1", 26379), ("::1", 26380)),
        service="orch",
        db=3,
        username="u",
        password="p@ss",
    )
    assert SentinelUrl.parse("redis+sentinel://s1:26379/orch").db == 0


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://h:6379/0", r"is not a redis\+sentinel"),
        ("redis+sentinel:///orch", "names no Sentinel"),
        ("redis+sentinel://s1/orch", "host:port"),
        ("redis+sentinel://s1:x/orch", "host:port"),
        ("redis+sentinel://s1:26379", "/<service>"),
        ("redis+sentinel://s1:26379/orch/zero", "/<service>"),
        ("redis+sentinel://s1:26379/orch/0/more", "/<service>"),
    ],
)
def test_a_bad_sentinel_url_says_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        SentinelUrl.parse(url)


# -- against real Sentinels -------------------------------------------------------------------


@pytest.fixture()
def sentinels() -> Iterator[Sentinels]:
    """A primary, a replica and three Sentinels of this test's own, stopped after."""
    root = Path(tempfile.mkdtemp(prefix="orch-sentinel-", dir="/tmp"))
    made = Sentinels(root)
    try:
        yield made.start()
    finally:
        made.close()
        shutil.rmtree(root, ignore_errors=True)


def _wait_new_primary(sentinels: Sentinels, old: int) -> float:
    """Seconds until the Sentinels name a primary other than ``old``."""
    started = time.monotonic()
    while sentinels.primary_port() in (old, None):
        assert time.monotonic() - started < FAILOVER_RETRY_S, "no failover"
        time.sleep(0.05)
    return time.monotonic() - started


def test_every_client_follows_a_killed_primary(sentinels: Sentinels) -> None:
    """SIGKILL of the primary: retried commands of every client land on the promoted
    replica, each within the retry window; what was written and replicated before is
    there."""
    old = sentinels.primary()
    url = sentinels.url
    plain = redis_client(url, socket_timeout=2)
    lean = SyncConnection(url, "test-sync")
    assert lean.call("SET", "k", "before", retry=True) == "OK"
    # On both replicas before the kill: whichever is promoted has it.
    assert plain.wait(REPLICAS, 2000) == REPLICAS
    old.kill()

    started = time.monotonic()
    assert lean.call("SET", "k", "after", retry=True) == "OK"
    resumed_s = time.monotonic() - started
    assert sentinels.primary_port() != old.port
    assert resumed_s < FAILOVER_RETRY_S
    # redis-py's pool finds the new primary on its next connection.
    deadline = time.monotonic() + FAILOVER_RETRY_S
    while True:
        try:
            assert plain.get("k") == b"after"
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline
            time.sleep(0.1)

    async def on_the_loop() -> None:
        connection = AsyncConnection(url, "test-async")
        client = async_redis_client(url, decode_responses=True)
        try:
            assert await connection.call("GET", "k", retry=True) == "after"
            assert await client.get("k") == "after"
        finally:
            await connection.close()
            await client.aclose()

    asyncio.run(on_the_loop())
    lean.close()
    plain.close()


def _role(port: int) -> str | None:
    client = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
    try:
        return str(client.info("replication")["role"])
    except redis.RedisError:
        return None
    finally:
        client.close()


def _replid(port: int) -> str:
    client = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
    try:
        return str(client.info("replication")["master_replid"])
    finally:
        client.close()


def test_a_handover_moves_writers_and_the_epoch(sentinels: Sentinels) -> None:
    """SENTINEL FAILOVER while a worker thread writes with ``replicas=1`` (WAIT in the same
    round trip). The old primary takes writes until it is demoted, and those its promoted
    replica never got are gone: Redis replication is asynchronous, and WAIT does not make
    it a consistent store (a write the other replica acknowledged can be lost this way).
    What the deployment relies on instead holds: the promoted primary has a new
    replication id (the records' epoch, so every rollout in flight is discarded at its
    grade), a connection still open to the demoted primary is refused writes (READONLY),
    taken as lost, and the writers carry on on the new primary by themselves."""
    old = sentinels.primary()
    epoch = _replid(old.port)
    url = sentinels.url
    lean = SyncConnection(url, "test-sync")
    acknowledged: list[int] = []
    stop = threading.Event()

    def write() -> None:
        index = 0
        while not stop.is_set():
            lean.call("SET", f"w{index}", index, retry=True, replicas=1)
            acknowledged.append(index)
            index += 1

    async def connect() -> AsyncConnection:
        connection = AsyncConnection(url, "test-async")
        assert await connection.call("SET", "a", "1", retry=True) == "OK"
        return connection

    loop = asyncio.new_event_loop()
    writer = threading.Thread(target=write)
    try:
        connection = loop.run_until_complete(connect())
        writer.start()
        while len(acknowledged) < 20:
            time.sleep(0.01)
        admin = redis.Redis(port=sentinels.ports[0], socket_timeout=2)
        assert admin.sentinel_failover(SERVICE)
        admin.close()
        took_s = _wait_new_primary(sentinels, old.port)
        deadline = time.monotonic() + FAILOVER_RETRY_S
        while _role(old.port) != "slave":
            assert time.monotonic() < deadline, "the old primary was never demoted"
            time.sleep(0.05)
        demoted_at = len(acknowledged)
        while len(acknowledged) < demoted_at + 20:
            assert time.monotonic() < deadline, "writes did not go on on the new primary"
            time.sleep(0.01)
        stop.set()
        writer.join(timeout=FAILOVER_RETRY_S)
        assert loop.run_until_complete(connection.call("SET", "a", "2", retry=True)) == "OK"
        loop.run_until_complete(connection.close())
    finally:
        stop.set()
        loop.close()
    new = sentinels.primary()
    assert _replid(new.port) != epoch
    client = redis.Redis(port=new.port, decode_responses=True)
    after = acknowledged[demoted_at:]
    assert client.mget([f"w{index}" for index in after]) == [str(index) for index in after]
    assert client.get("a") == "2"
    client.close()
    lean.close()
    assert took_s < FAILOVER_RETRY_S


def test_celery_reaches_the_primary_through_the_sentinels(sentinels: Sentinels) -> None:
    """kombu's Sentinel transport, given what celery_url makes of the URL, publishes to
    the primary the Sentinels name, before a failover and after it."""
    url, options = celery_url(sentinels.url)
    app = Celery("sentinel-test", broker=url)
    app.conf.broker_transport_options = options
    primary = sentinels.primary()

    def publish(queue: str) -> None:
        with app.connection_for_write() as connection:
            connection.default_channel.client.lpush(queue, "x")

    publish("q1")
    assert redis.Redis(port=primary.port).llen("q1") == 1
    primary.kill()
    _wait_new_primary(sentinels, primary.port)
    publish("q2")
    assert redis.Redis(port=sentinels.primary().port).llen("q2") == 1


def test_celery_publishes_past_a_hung_primary(sentinels: Sentinels, settings: Settings) -> None:
    """A primary that hangs (SIGSTOP: its connections stay open, its kernel acknowledges,
    nothing answers) holds a publish on its connection for no longer than make_celery's
    socket timeout and the retries after it: the publish ends, and once the Sentinels
    promote a replica, publishes land there. Without the timeout a publish waited forever,
    and with it a worker's whole consumer loop (its heartbeat publishes)."""
    app = make_celery(settings.model_copy(update={"redis_url": sentinels.url}))
    primary = sentinels.primary()
    assert primary.proc is not None
    ended: list[BaseException | None] = []
    with app.connection_for_write() as connection:
        client = connection.default_channel.client
        client.lpush("q1", "x")
        primary.proc.send_signal(signal.SIGSTOP)
        try:

            def publish() -> None:
                try:
                    client.lpush("q1", "y")
                    ended.append(None)
                except redis.RedisError as exc:
                    ended.append(exc)

            worker = threading.Thread(target=publish, daemon=True)
            started = time.monotonic()
            worker.start()
            _wait_new_primary(sentinels, primary.port)
            worker.join(HUNG_PUBLISH_BOUND_S)
            assert not worker.is_alive(), "a publish on a hung primary never ended"
            print(f"publish on a hung primary ended after {time.monotonic() - started:.1f} s")
        finally:
            primary.proc.send_signal(signal.SIGCONT)
    with app.connection_for_write() as connection:
        connection.default_channel.client.lpush("q2", "x")
    assert redis.Redis(port=sentinels.primary().port).llen("q2") == 1


# The socket timeout (REPLY_TIMEOUT_S) of each try redis-py makes, and the backoff
# between them; far below forever.
HUNG_PUBLISH_BOUND_S = 60.0


def test_the_state_collector_reports_replicas_and_failovers(
    sentinels: Sentinels, settings: Settings
) -> None:
    """What the Redis alerts read (helm/orchestrator/files/alerts.yaml): replicas online
    with the primary and down as the Sentinels see them, the replicas calls wait for, and
    the failovers this API process saw."""
    behind = settings.model_copy(update={"redis_url": sentinels.url, "redis_replicas_to_wait": 1})
    collector = StateCollector(behind, load_environments(behind))
    try:
        got = collect(collector)
        assert got[("orchestrator_redis_replicas", (("state", "online"),))] == REPLICAS
        assert got[("orchestrator_redis_replicas", (("state", "down"),))] == 0
        assert got[("orchestrator_redis_replicas_required", ())] == 1
        assert got[("orchestrator_redis_failovers_total", ())] == 0

        old = sentinels.primary()
        old.kill()
        _wait_new_primary(sentinels, old.port)
        deadline = time.monotonic() + FAILOVER_RETRY_S
        while True:  # the Sentinels see the old primary, now a replica, down
            got = collect(collector)
            if got.get(("orchestrator_redis_replicas", (("state", "down"),))) == 1:
                break
            assert time.monotonic() < deadline, got
            time.sleep(0.2)
        assert got[("orchestrator_redis_failovers_total", ())] == 1
    finally:
        collector.close()


def test_make_up_sentinel_script_starts_a_set_the_clients_follow(tmp_path: Path) -> None:
    """scripts/redis-sentinel.sh (`make up REDIS=sentinel`): prints a URL the product's
    clients use; after its primary dies the clients follow the promoted replica, and the
    script run again brings the dead server back as a replica of it, not as a second
    primary."""
    redis_ports = [free_port() for _ in range(3)]
    sentinel_ports = [free_port() for _ in range(3)]
    env = {
        **os.environ,
        "ORCH_SENTINEL_DIR": str(tmp_path),
        "ORCH_SENTINEL_REDIS_PORTS": " ".join(map(str, redis_ports)),
        "ORCH_SENTINEL_PORTS": " ".join(map(str, sentinel_ports)),
        "ORCH_SENTINEL_DOWN_AFTER_MS": "1000",
    }

    def run_script() -> str:
        done = subprocess.run(
            [str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    try:
        url = run_script()
        assert url == (
            "redis+sentinel://"
            + ",".join(f"127.0.0.1:{port}" for port in sentinel_ports)
            + "/orchestrator/0"
        )
        lean = SyncConnection(url, "test-sync")
        assert lean.call("SET", "k", "v", retry=True, replicas=1) == "OK"
        first = redis.Redis(port=redis_ports[0])
        assert first.info("replication")["role"] == "master"
        # The Sentinels learn of the replicas from the primary within ten seconds: one
        # they do not know at the failover would be left following the dead primary.
        deadline = time.monotonic() + 30
        while True:
            known = cast(
                dict[str, Any], redis.Redis(port=sentinel_ports[0]).sentinel_master("orchestrator")
            )
            if int(known["num-slaves"]) == 2 and int(known["num-other-sentinels"]) == 2:
                break
            assert time.monotonic() < deadline, known
            time.sleep(0.2)
        first.shutdown(nosave=True)
        assert lean.call("GET", "k", retry=True) == "v"  # on the promoted replica
        run_script()  # the dead one back, as a replica of the new primary
        back = redis.Redis(port=redis_ports[0], decode_responses=True)
        deadline = time.monotonic() + 30
        while back.info("replication").get("master_link_status") != "up":
            assert time.monotonic() < deadline, back.info("replication")
            time.sleep(0.2)
        assert back.info("replication")["role"] == "slave"
        assert back.get("k") == "v"
        lean.close()
    finally:
        for port in sentinel_ports + redis_ports:
            with contextlib.suppress(redis.RedisError):
                redis.Redis(port=port, socket_timeout=2).shutdown(nosave=True)
