"""Redis servers a test owns, on loopback ports: a single server (AOF on), and a primary
with two replicas watched by three Sentinels (Debian's redis-server, run with ``--sentinel``),
for the tests that kill a primary (tests/test_sentinel.py, tests/faults/test_failover.py).

Each is a real process: :meth:`RedisServer.kill` is SIGKILL, so what a failover keeps is
what the replica had received, as in production.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis

from orchestrator.local import free_port
from orchestrator.state.sentinel import online_replicas

SERVICE = "orch"
# What the Sentinels are told: a primary silent for this long is down (the chart's is
# 5,000 ms; short here so a failover fits a test), and three Sentinels, two to agree.
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000
QUORUM = 2
# Two replicas, as the chart runs: with one, a failover leaves the new primary none to
# hold a write (WAIT 1) until the lost node is back, and calls wait (docs/failure-model.md).
REPLICAS = 2


@dataclass
class RedisServer:
    """redis-server on a loopback port, appendonly with fsync every second, its files in
    ``root``; ``replica_of`` a primary's port, to start as its replica. :meth:`kill` and
    :meth:`start` again restart it on the same port and dir."""

    root: Path
    port: int
    replica_of: int | None = None
    proc: subprocess.Popen[bytes] | None = None
    paused: bool = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20) -> None:
        assert self.proc is None or self.proc.poll() is not None
        self.root.mkdir(parents=True, exist_ok=True)
        command = [
            "redis-server",
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.root),
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
            "--protected-mode", "no",
            "--daemonize", "no",
            # A replica's first sync starts at once (Redis 7 waits 5 s for others to join).
            "--repl-diskless-sync-delay", "0",
        ]  # fmt: skip
        if self.replica_of is not None:
            command += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        self.proc = _spawn(command, self.root / "redis.log")
        _wait_ping(self.port, self.proc, self.root / "redis.log", timeout_s)

    def kill(self) -> None:
        """SIGKILL: no shutdown save; what survives is what the AOF holds."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None
        self.paused = False

    def pause(self) -> None:
        """SIGSTOP: a hung Redis. Its connections stay open and its kernel still
        acknowledges what clients send; nothing is ever answered."""
        assert self.proc is not None and self.proc.poll() is None
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.proc is not None and self.paused:
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        self.resume()  # a stopped process takes no SIGTERM until continued
        stop_process(self.proc)
        self.proc = None

    def wipe(self) -> None:
        """SIGKILL, and its files gone: what a Redis with no replica and no surviving disk
        comes back as when :meth:`start` starts it again, empty."""
        self.kill()
        for path in self.root.iterdir():
            if path.name == "redis.log":
                continue
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Sentinels:
    """A primary and two replicas (:class:`RedisServer`) and three Sentinels watching them as
    :data:`SERVICE`, everything under ``root``. :attr:`url` is what a deployment's
    ``redis_url`` is set to."""

    root: Path
    servers: list[RedisServer] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self, timeout_s: float = 30) -> Sentinels:
        primary = RedisServer(self.root / "r0", free_port())
        primary.start()
        self.servers = [primary]
        for index in range(1, 1 + REPLICAS):
            replica = RedisServer(self.root / f"r{index}", free_port(), replica_of=primary.port)
            replica.start()
            self.servers.append(replica)
        for index in range(3):
            port = free_port()
            directory = self.root / f"s{index}"
            directory.mkdir(parents=True, exist_ok=True)
            conf = directory / "sentinel.conf"  # a Sentinel rewrites its own file
            conf.write_text(
                "\n".join(
                    [
                        f"port {port}",
                        "bind 127.0.0.1",
                        "protected-mode no",
                        f"dir {directory}",
                        f"sentinel monitor {SERVICE} 127.0.0.1 {primary.port} {QUORUM}",
                        f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
                        f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}",
                        f"sentinel parallel-syncs {SERVICE} 1",
                        "",
                    ]
                )
            )
            self.procs.append(
                _spawn(["redis-server", str(conf), "--sentinel"], directory / "sentinel.log")
            )
            self.ports.append(port)
        for port, proc in zip(self.ports, self.procs, strict=True):
            _wait_ping(port, proc, self.root / "s*/sentinel.log", timeout_s)
        self.wait_settled(timeout_s)
        return self

    def primary_port(self) -> int | None:
        """The primary's port as the first Sentinel that answers says; None if none does."""
        for port in self.ports:
            client = redis.Redis(port=port, socket_timeout=1)
            try:
                address = client.sentinel_get_master_addr_by_name(SERVICE)
            except redis.RedisError:
                continue
            finally:
                client.close()
            if isinstance(address, tuple):
                return int(address[1])
        return None

    def primary(self) -> RedisServer:
        port = self.primary_port()
        return next(s for s in self.servers if s.port == port)

    def wait_settled(self, timeout_s: float = 30) -> RedisServer:
        """Until every Sentinel names the same live primary and knows both its replicas up,
        and the primary has a replica in sync (online: past its first full sync); that
        primary."""
        deadline = time.monotonic() + timeout_s
        while True:
            settled = self._settled()
            if settled is not None:
                return settled
            assert time.monotonic() < deadline, f"Sentinels not settled: see {self.root}"
            time.sleep(0.1)

    def _settled(self) -> RedisServer | None:
        named = set()
        for port in self.ports:
            client = redis.Redis(port=port, socket_timeout=1)
            try:
                master = cast(dict[str, Any], client.sentinel_master(SERVICE))
                if int(master.get("num-other-sentinels", 0)) < len(self.ports) - 1:
                    return None
                replicas = client.sentinel_slaves(SERVICE)
            except redis.RedisError:
                return None
            finally:
                client.close()
            # Every replica known and up: a Sentinel learns of replicas from the primary's
            # INFO every 10 s, and one it does not know at a failover is left following
            # the dead primary.
            up = [r for r in replicas if not r.get("is_odown") and not r.get("is_sdown")]
            if len(up) < REPLICAS or master.get("is_sdown") or master.get("is_odown"):
                return None
            named.add(int(master["port"]))
        if len(named) != 1:
            return None
        primary = next((s for s in self.servers if s.port in named), None)
        if primary is None or not primary.alive():
            return None
        client = redis.Redis(port=primary.port, socket_timeout=1)
        try:
            info = client.info("replication")
        except redis.RedisError:
            return None
        finally:
            client.close()
        if info.get("role") != "master" or not online_replicas(info):
            return None
        return primary

    def restore(self, timeout_s: float = 30) -> RedisServer:
        """Whole again after a test killed or hung servers: each hung one continued, each
        dead one started again as a replica of the current primary (as an operator, or a
        StatefulSet, brings a lost node back), then :meth:`wait_settled`; the primary."""
        primary = self.primary_port()
        for server in self.servers:
            # A hung one, continued, is told by the Sentinels to follow the new primary.
            server.resume()
            if not server.alive():
                server.replica_of = primary
                server.start()
        return self.wait_settled(timeout_s)

    def close(self) -> None:
        for proc in self.procs:
            stop_process(proc)
        for server in self.servers:
            server.stop()


def _spawn(command: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def _wait_ping(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    client = redis.Redis(port=port, socket_timeout=1)
    try:
        while True:
            with contextlib.suppress(redis.RedisError):
                if client.ping():
                    return
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on {port} did not start: see {log}")
            time.sleep(0.05)
    finally:
        client.close()


def stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM, then SIGKILL after 20 s; nothing if it has exited already."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
