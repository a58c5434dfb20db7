"""The chart's Redis-with-Sentinel start scripts (templates/redis-sentinel.yaml), run for
real: three "pods" as network namespaces of this test's own on a bridge of its own, each
running the rendered ``redis.sh`` and ``sentinel.sh`` with Debian's redis-server, their
stable names (``<set>-N.<headless>``) in each namespace's /etc/hosts (``ip netns exec``
mounts /etc/netns/<ns>/hosts there), as the headless Service gives them in a cluster.

What the scripts must do: on the set's first start, pod 0 is the primary and the others
its replicas, watched by three Sentinels that found each other; when the primary's Redis
is killed, the Sentinels promote a replica; when it starts again, its script asks the
Sentinels and it rejoins as a replica of the new primary, not as a second primary; and when
the whole set restarts, the promoted pod leads again (the Sentinels' files are on the pods'
volumes), not pod 0.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from orchestrator.state.sentinel import online_replicas
from tests.chart.conftest import FULLNAME, Helm, find
from tests.redis_ha import stop_process

pytestmark = pytest.mark.xdist_group("chart")

PASSWORD = "s3cret-sentinel"
SERVICE = "orchestrator"
SET = "redis"
HEADLESS = "redis-headless.test.svc"
PODS = 3
SETTLE_S = 60.0


@dataclass
class Pod:
    """One namespace: its address and the two processes the StatefulSet's pod runs."""

    index: int
    namespace: str
    address: str
    root: Path
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{SET}-{self.index}.{HEADLESS}"

    def start(self, script: str, scripts: Path) -> None:
        env = {
            "PATH": os.environ["PATH"],
            "HOSTNAME": f"{SET}-{self.index}",
            "REDIS_PASSWORD": PASSWORD,
            "SET": SET,
            "HEADLESS": HEADLESS,
            "SERVICE": SERVICE,
            "DOWN_AFTER_MS": "1000",
            "FAILOVER_TIMEOUT_MS": "5000",
            "SCRIPTS": str(scripts),
            "DATA": str(self.root / "data"),
        }
        with (self.root / f"{script}.log").open("ab") as log:
            self.procs[script] = subprocess.Popen(
                ["ip", "netns", "exec", self.namespace, "sh", str(scripts / f"{script}.sh")],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def kill(self, script: str) -> None:
        proc = self.procs.pop(script)
        proc.send_signal(signal.SIGKILL)  # `ip netns exec` execs: this is the server
        proc.wait()

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(
            host=self.address, port=port, password=PASSWORD, socket_timeout=1,
            decode_responses=True,
        )  # fmt: skip

    def stop(self) -> None:
        for proc in self.procs.values():
            stop_process(proc)
        self.procs.clear()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextlib.contextmanager
def _network(root: Path) -> Iterator[list[Pod]]:
    """Three namespaces on a bridge of their own, each with the set's names in its hosts
    file."""
    tag = uuid.uuid4().hex[:6]
    bridge = f"ors{tag}"
    subnet = f"10.233.{random.randrange(1, 250)}"
    pods = [
        Pod(i, f"orch-rs-{tag}-{i}", f"{subnet}.{i + 1}", root / f"pod{i}") for i in range(PODS)
    ]
    hosts = "127.0.0.1 localhost\n" + "".join(f"{p.address} {p.name}\n" for p in pods)
    # Docker's br_netfilter sends bridged frames through iptables, whose FORWARD policy it
    # sets to DROP: the pods' traffic to each other is let through, on this bridge only.
    accept = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
    with contextlib.ExitStack() as undo:
        _ip("link", "add", bridge, "type", "bridge")
        undo.callback(subprocess.run, ["ip", "link", "del", bridge], check=False)
        subprocess.run(["iptables", "-I", *accept], check=True)
        undo.callback(subprocess.run, ["iptables", "-D", *accept], check=False)
        _ip("addr", "add", f"{subnet}.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for pod in pods:
            (pod.root / "data").mkdir(parents=True)
            _ip("netns", "add", pod.namespace)
            undo.callback(subprocess.run, ["ip", "netns", "del", pod.namespace], check=False)
            etc = Path("/etc/netns") / pod.namespace
            etc.mkdir(parents=True)
            undo.callback(shutil.rmtree, etc, ignore_errors=True)
            (etc / "hosts").write_text(hosts)
            outside, inside = f"ors{tag}h{pod.index}", f"ors{tag}p{pod.index}"
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", outside, "master", bridge, "up")
            _ip("link", "set", inside, "netns", pod.namespace)
            in_ns = ("netns", "exec", pod.namespace, "ip")
            _ip(*in_ns, "addr", "add", f"{pod.address}/24", "dev", inside)
            _ip(*in_ns, "link", "set", inside, "up")
            _ip(*in_ns, "link", "set", "lo", "up")
            undo.callback(pod.stop)
        yield pods


def _primary(pods: list[Pod]) -> str | None:
    """The primary's name, if every Sentinel names the same one."""
    named = set()
    for pod in pods:
        client = pod.client(26379)
        try:
            address = client.sentinel_get_master_addr_by_name(SERVICE)
        except redis.RedisError:
            return None
        finally:
            client.close()
        if not isinstance(address, tuple):
            return None
        named.add(str(address[0]))
    return named.pop() if len(named) == 1 else None


def _known(pods: list[Pod]) -> bool:
    """Whether every Sentinel knows the two replicas and the two other Sentinels (it learns
    of replicas from the primary's INFO, every 10 s: one not known at a failover is not
    moved to the new primary)."""
    for pod in pods:
        client = pod.client(26379)
        try:
            master = cast(dict[str, Any], client.sentinel_master(SERVICE))
        except redis.RedisError:
            return False
        finally:
            client.close()
        if int(master.get("num-slaves", 0)) < PODS - 1:
            return False
        if int(master.get("num-other-sentinels", 0)) < PODS - 1:
            return False
    return True


def _pod(pods: list[Pod], name: str | None) -> Pod:
    return next(p for p in pods if p.name == name)


def _replication(pod: Pod) -> dict[str, object]:
    client = pod.client(6379)
    try:
        return dict(client.info("replication"))
    except redis.RedisError as exc:
        return {"error": repr(exc)}
    finally:
        client.close()


def _until(check: object, what: str, pods: list[Pod]) -> None:
    deadline = time.monotonic() + SETTLE_S
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            logs = "\n".join(
                f"--- {log}\n{log.read_text(errors='replace')[-6000:]}"
                for pod in pods
                for log in sorted(pod.root.glob("*.log"))
            )
            raise AssertionError(f"{what} within {SETTLE_S} s\n{logs}")
        time.sleep(0.2)


def _online_replicas(pod: Pod) -> int:
    return online_replicas(_replication(pod))


@pytest.fixture()
def scripts(helm: Helm, tmp_path: Path) -> Path:
    """The chart's scripts as rendered with Sentinel on."""
    objects = helm.render("--set", "redis.bundled.sentinel.enabled=true")
    data = find(objects, "ConfigMap", f"{FULLNAME}-redis-scripts")["data"]
    assert set(data) == {"primary.sh", "redis.sh", "sentinel.sh"}
    out = tmp_path / "scripts"
    out.mkdir()
    for name, text in data.items():
        (out / name).write_text(text)
    return out


def test_the_set_starts_fails_over_and_takes_its_old_primary_back(scripts: Path) -> None:
    root = Path(tempfile.mkdtemp(prefix="orch-rs-", dir="/tmp"))
    try:
        with _network(root) as pods:
            for pod in pods:
                pod.start("redis", scripts)
                pod.start("sentinel", scripts)
            first = pods[0]
            # The first start: pod 0 leads, both others replicate it, the Sentinels agree.
            _until(lambda: _primary(pods) == first.name, "the Sentinels name pod 0", pods)
            _until(lambda: _online_replicas(first) == 2, "two replicas online", pods)
            _until(lambda: _known(pods), "the Sentinels know every replica", pods)
            client = first.client(6379)
            client.set("kept", "yes")
            assert client.wait(2, 5000) == 2
            client.close()

            first.kill("redis")
            _until(
                lambda: _primary(pods) not in (None, first.name),
                "a replica promoted",
                pods,
            )

            # Pod 0 starts again: its script asks the Sentinels and it follows the primary
            # they name (a first attempt that timed out may have been followed by a second,
            # electing the other replica: whichever they settle on).
            first.start("redis", scripts)

            def rejoined() -> bool:
                info = _replication(first)
                return (
                    info.get("role") == "slave"
                    and info.get("master_link_status") == "up"
                    and info.get("master_host") == _primary(pods)
                )

            _until(rejoined, "the old primary back as a replica of the one named", pods)
            leader = _pod(pods, _primary(pods))
            _until(lambda: _online_replicas(leader) == 2, "two replicas online again", pods)
            _until(lambda: _known(pods), "the Sentinels know every replica again", pods)
            assert first.client(6379).get("kept") == "yes"
            assert leader.client(6379).get("kept") == "yes"

            # The whole set stops and starts again (a cluster restart): no Sentinel answers
            # at first, and each pod falls back on the primary its Sentinel knew last, the
            # promoted one, never on pod 0 with what it missed.
            leader.client(6379).set("after", "failover")
            assert leader.client(6379).wait(2, 5000) == 2
            for pod in pods:
                pod.stop()
            for pod in pods:
                pod.start("redis", scripts)
                pod.start("sentinel", scripts)
            _until(lambda: _primary(pods) == leader.name, "the promoted pod leads again", pods)
            _until(lambda: _online_replicas(leader) == 2, "two replicas after the restart", pods)
            assert leader.client(6379).get("after") == "failover"
    finally:
        shutil.rmtree(root, ignore_errors=True)
