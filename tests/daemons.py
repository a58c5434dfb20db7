"""Extra Docker daemons for tests, beside the machine's own: several Docker hosts on one
machine (docs/architecture.md, "Testing several hosts on one machine").

Each daemon has its own socket, data root, exec root, pidfile and bridge, so tests may stop
it, restart it or fill it without disturbing the machine's dockerd or any other test. Its
data root persists under ``/var/lib/orchestrator-test/<name>``, so images are loaded into
it once per machine (:func:`copy_image` skips an image whose id already matches).

Two test runs on one machine would share a daemon's fixed paths: a lock file in the data
root makes the second wait for the first. A daemon left running by a run that was killed
(its pidfile names a live dockerd on this daemon's socket) is stopped before a new start.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import docker

TEST_ROOT = Path("/var/lib/orchestrator-test")


def _sh(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, check=False)


@dataclass
class DockerDaemon:
    """One extra dockerd. ``name`` makes its paths: ``/run/orchestrator-test-<name>.sock``,
    ``/run/orchestrator-test-<name>`` (exec root), ``/run/orchestrator-test-<name>.pid``
    and ``/var/lib/orchestrator-test/<name>`` (data root under ``data/``, log, config).

    ``bridge``/``address``: the bridge it gets (never ``--bridge=none``: that deletes the
    machine daemon's docker0). ``config``: its daemon.json (e.g. a ``runtimes`` section).
    """

    name: str
    bridge: str
    address: str
    config: dict[str, Any] = field(default_factory=dict)
    shutdown_timeout_s: int | None = None
    proc: subprocess.Popen[bytes] | None = None
    _lock: IO[bytes] | None = None

    @property
    def socket(self) -> str:
        return f"unix:///run/orchestrator-test-{self.name}.sock"

    @property
    def root(self) -> Path:
        return TEST_ROOT / self.name

    @property
    def exec_root(self) -> Path:
        return Path(f"/run/orchestrator-test-{self.name}")

    @property
    def pidfile(self) -> Path:
        return Path(f"/run/orchestrator-test-{self.name}.pid")

    @property
    def log(self) -> Path:
        return self.root / "dockerd.log"

    def command(self) -> list[str]:
        config = self.root / "daemon.json"
        config.write_text(json.dumps(self.config, indent=2) + "\n")
        command = [
            "dockerd",
            "-H",
            self.socket,
            "--data-root",
            str(self.root / "data"),
            "--exec-root",
            str(self.exec_root),
            "--pidfile",
            str(self.pidfile),
            "--iptables=false",
            "--ip-masq=false",
            "--bridge",
            self.bridge,
            "--config-file",
            str(config),
        ]
        if self.shutdown_timeout_s is not None:
            command += ["--shutdown-timeout", str(self.shutdown_timeout_s)]
        return command

    def start(self, timeout_s: float = 60) -> docker.DockerClient:
        """Start the daemon (its bridge first) and return a client once it answers."""
        assert self.proc is None or self.proc.poll() is not None, f"{self.name} is running"
        if self._lock is None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock = (self.root / "lock").open("wb")
            fcntl.flock(self._lock, fcntl.LOCK_EX)
            self._stop_stale()
        if _sh("ip", "link", "show", self.bridge).returncode != 0:
            _sh("ip", "link", "add", self.bridge, "type", "bridge")
            _sh("ip", "addr", "add", self.address, "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        return self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float = 60) -> docker.DockerClient:
        # The client asks the daemon for its API version when it is built, so building it
        # is itself the readiness probe.
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client = docker.DockerClient(base_url=self.socket, timeout=120)
                client.ping()
                return client
            except docker.errors.DockerException:
                if self.proc is None or self.proc.poll() is not None:
                    raise RuntimeError(f"dockerd {self.name} exited: see {self.log}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"dockerd {self.name} did not start: see {self.log}"
                    ) from None
                time.sleep(0.2)

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM, as an operator's ``systemctl stop`` would: dockerd stops its containers
        (within ``shutdown_timeout_s``) and exits."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        """Stop the daemon, delete its bridge and let the next run have it."""
        try:
            self.stop()
        finally:
            _sh("ip", "link", "del", self.bridge)
            if self._lock is not None:
                self._lock.close()  # releases the flock
                self._lock = None

    def _stop_stale(self) -> None:
        """A daemon of ours that outlived its test run (the run was killed): we hold the
        lock, so no live run owns it."""
        try:
            pid = int(self.pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return
        if not cmdline[0].endswith(b"dockerd") or self.socket.encode() not in cmdline:
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def running(daemon: DockerDaemon, *images: str) -> Iterator[docker.DockerClient]:
    """The daemon, started, with ``images`` copied in from the machine's daemon; stopped and
    its bridge deleted afterwards, whatever happened."""
    client: docker.DockerClient | None = None
    try:
        client = daemon.start()
        for ref in images:
            copy_image(ref, client)
        yield client
    finally:
        if client is not None:
            client.close()
        daemon.close()


def copy_image(ref: str, target: docker.DockerClient) -> None:
    """Load image ``ref`` from the machine's daemon into ``target`` unless it has it (same
    image id) already."""
    source = docker.from_env()
    try:
        wanted = source.images.get(ref).id
        try:
            if target.images.get(ref).id == wanted:
                return
        except docker.errors.ImageNotFound:
            pass
        with tempfile.TemporaryFile() as archive:
            for chunk in source.images.get(ref).save(named=True):
                archive.write(chunk)
            archive.seek(0)
            target.images.load(archive)
    finally:
        source.close()


def machine_runtimes() -> dict[str, Any]:
    """The ``runtimes`` section of the machine's /etc/docker/daemon.json (runsc), if any."""
    try:
        config = json.loads(Path("/etc/docker/daemon.json").read_text())
    except (OSError, ValueError):
        return {}
    runtimes = config.get("runtimes") if isinstance(config, dict) else None
    return dict(runtimes) if isinstance(runtimes, dict) else {}
