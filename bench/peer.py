"""SWE-ReX, this orchestrator and raw `docker exec`, side by side in one run.

    python -m bench.peer [--iterations 200] [--concurrency 1 8 32] [--seconds 4] [--rounds 2]

SWE-ReX (`swe-rex` on PyPI) is what many users would reach for. Its remote-runtime image is
built here from our base image, with swe-rex installed offline from a wheelhouse downloaded on
this host, and cached under a hash of its inputs (orchestrator/bench-swerex:<hash>); SWE-ReX's
own DockerDeployment then starts its containers its own way (`docker run -p`, `swerex-remote`
inside, one bash session per container, HTTP from RemoteRuntime).

Modes, each one session per container (a rollout's sandbox):

- SWE-ReX session: `run_in_session(BashAction)` in a bash session (what SWE-agent does);
- SWE-ReX execute: `execute(Command(shell=True))`, a subprocess per command;
- orchestrator: the `shell` tool end to end (HTTP → API → Celery/Redis → worker → exec agent),
  on a deployment this script starts (orchestrator.local.local_stack);
- docker exec: the docker SDK's `exec_run(["bash", "-c", ...])` into a plain container of the
  SWE-ReX image;
- exec agent: our sandbox's exec agent called directly (DockerBackend.exec), for reference.

Every mode runs `true` and the same grep over the same tree (this Python's standard library,
the codebase of bench/tool_call.py, copied into the SWE-ReX image), and every output is
checked. Containers get the sandboxes' CPU and memory limits. Latency: one session per mode,
modes interleaved call by call. Throughput: N sessions per mode calling back to back for a
fixed time; modes take turns in short windows (rotated each round), and the CPU each window
cost is read per process group (this client, the orchestrator's processes, Redis, Docker's
daemons, our containers' cgroups). Prints a table; writes bench/results/peer.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, Protocol

import aiohttp
import docker
from docker.errors import DockerException, ImageNotFound
from swerex.deployment.docker import DockerDeployment
from swerex.runtime.abstract import BashAction, Command, CreateBashSessionRequest

from bench.common import (
    BENCH_CODEBASE,
    STACK_ENVIRONMENTS,
    ensure_bench_codebase,
    function_call,
    summary,
    throwaway_stack_settings,
    write_report,
)
from orchestrator.config import Settings
from orchestrator.docker_client import connect
from orchestrator.images.base import INPUTS_HASH_LABEL, build_base_image, run_build
from orchestrator.local import local_stack
from orchestrator.sandbox import labels
from orchestrator.sandbox.backend import SandboxHandle, SandboxSpec
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.sandbox.gc import collect_expired

PEER_REPO = "orchestrator/bench-swerex"
PEER_CONTEXT = Path(__file__).resolve().parent / "peer"
RUN_LABEL = "orchestrator.bench.peer"
"""Label on every container this script starts itself (SWE-ReX's and the plain ones)."""
COMMANDS = {"true": "true", "grep": "grep -rn 'def __init__' --include=*.py /workspace | wc -l"}
MODES = ("SWE-ReX session", "SWE-ReX execute", "orchestrator", "docker exec", "exec agent")
COMMAND_TIMEOUT_S = 60.0
STARTUP_TIMEOUT_S = 120.0
START_PARALLEL = 4
"""Containers started at once while a fleet grows (32 SWE-ReX servers at once starve 2 cores)."""

log = logging.getLogger("bench.peer")
Call = Callable[[str], Awaitable[str]]
"""Runs one command in one session and returns its output; raises if it did not run."""
Progress = Callable[[str], None]


# -- the SWE-ReX image -------------------------------------------------------------------------


def ensure_peer_image(settings: Settings, codebase_image: str, progress: Progress) -> str:
    """orchestrator/bench-swerex:<hash>: swe-rex on our base image, the codebase at /workspace.

    Built only when no image carries the hash of its inputs (the Dockerfile, the base and
    codebase image ids, the swe-rex version of this venv, which the server must match).
    """
    client = connect(settings, timeout_s=1800)
    version = importlib.metadata.version("swe-rex")
    dockerfile = (PEER_CONTEXT / "Dockerfile").read_bytes()
    base_id = str(client.images.get(settings.base_image).id)
    codebase_id = str(client.images.get(codebase_image).id)
    h = hashlib.sha256(dockerfile)
    for part in (base_id, codebase_id, version):
        h.update(b"\0" + part.encode())
    digest = h.hexdigest()
    tag = f"{PEER_REPO}:{digest[:16]}"
    with contextlib.suppress(ImageNotFound):
        if (client.images.get(tag).labels or {}).get(INPUTS_HASH_LABEL) == digest:
            progress(f"{tag} is up to date (swe-rex {version})")
            return tag
    python, glibc, machine = _image_python(client, settings.base_image)
    with tempfile.TemporaryDirectory(prefix="bench-swerex-") as tmp:
        context = Path(tmp)
        shutil.copy(PEER_CONTEXT / "Dockerfile", context / "Dockerfile")
        progress(f"downloading swe-rex {version} wheels for cp{python} {machine} glibc {glibc}")
        download_wheelhouse(context / "wheels", version, python, glibc, machine)
        progress(f"building {tag}")
        run_build(
            client,
            progress=progress,
            what=tag,
            path=str(context),
            tag=tag,
            buildargs={
                "BASE_IMAGE": settings.base_image,
                "CODEBASE_IMAGE": codebase_image,
                "SWEREX_VERSION": version,
            },
            labels={INPUTS_HASH_LABEL: digest},
        )
    # One cached image at a time: older builds of it go.
    for image in client.images.list(name=PEER_REPO):
        if tag not in image.tags:
            with contextlib.suppress(DockerException):
                client.images.remove(str(image.id), force=True)
    return tag


def _image_python(client: docker.DockerClient, image: str) -> tuple[str, tuple[int, int], str]:
    """The image's python3 version (``3.11``), glibc version and machine, for pip's tags."""
    script = (
        "import json, platform, sys; "
        "print(json.dumps([list(sys.version_info[:2]), platform.libc_ver()[1], "
        "platform.machine()]))"
    )
    raw = client.containers.run(image, ["python3", "-c", script], remove=True, network_mode="none")
    (major, minor), libc, machine = json.loads(raw)
    glibc_major, glibc_minor = (int(x) for x in str(libc).split(".")[:2])
    return f"{major}.{minor}", (glibc_major, glibc_minor), str(machine)


def download_wheelhouse(
    dest: Path, version: str, python: str, glibc: tuple[int, int], machine: str
) -> None:
    """swe-rex, its dependencies and pip as wheels for the image's Python, from this host."""
    platforms = [f"manylinux_2_{m}_{machine}" for m in range(17, glibc[1] + 1)]
    platforms.append(f"manylinux2014_{machine}")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--dest",
            str(dest),
            "--only-binary=:all:",
            "--python-version",
            python,
            "--implementation",
            "cp",
            "--abi",
            "cp" + python.replace(".", ""),
            *(arg for p in platforms for arg in ("--platform", p)),
            f"swe-rex=={version}",
            "pip",
        ],
        check=True,
    )


# -- modes -------------------------------------------------------------------------------------


class Fleet(Protocol):
    """Sessions of one system, one container (or sandbox) each, grown on demand."""

    modes: tuple[str, ...]

    async def grow(self, n: int) -> None: ...

    def calls(self, mode: str, n: int) -> list[Call]: ...

    def container_ids(self) -> list[str]: ...

    async def close(self) -> None: ...


async def _grow(have: int, want: int, start_one: Callable[[], Awaitable[None]]) -> None:
    gate = asyncio.Semaphore(START_PARALLEL)

    async def gated() -> None:
        async with gate:
            await start_one()

    await asyncio.gather(*(gated() for _ in range(want - have)))


def _drain(stream: IO[bytes] | None) -> None:
    # DockerDeployment keeps the attached `docker run` client's stdout and stderr as pipes
    # and never reads them, while the server writes an access-log line per request. 2,000
    # calls without reading did not stall a server here; reading them rules it out.
    if stream is not None:
        threading.Thread(target=lambda: shutil.copyfileobj(stream, _Null()), daemon=True).start()


class _Null:
    def write(self, data: bytes) -> int:
        return len(data)


class SweRexFleet:
    """SWE-ReX's DockerDeployment per session, with one bash session in each."""

    modes: tuple[str, ...] = ("SWE-ReX session", "SWE-ReX execute")

    def __init__(self, image: str, docker_args: list[str], drain: bool) -> None:
        self.image = image
        self.docker_args = docker_args
        self.drain = drain
        self.deployments: list[DockerDeployment] = []
        self.started: list[DockerDeployment] = []
        self.quiet = logging.getLogger("bench.peer.swerex")
        self.quiet.setLevel(logging.WARNING)

    async def grow(self, n: int) -> None:
        await _grow(len(self.started), n, self._start_one)

    async def _start_one(self) -> None:
        deployment = DockerDeployment(
            image=self.image,
            pull="never",
            docker_args=self.docker_args,
            startup_timeout=STARTUP_TIMEOUT_S,
            logger=self.quiet,
        )
        self.deployments.append(deployment)  # stopped by close() even if start fails
        # DockerDeployment.start() polls with time.sleep() and 0.15 s HTTP timeouts: several
        # starting in one event loop time each other out. Each starts in its own thread
        # and loop; once started, its RemoteRuntime opens a new HTTP session per request, so
        # it is called from the benchmark's loop like any client would.
        await asyncio.wait_for(
            asyncio.to_thread(asyncio.run, self._start(deployment)), STARTUP_TIMEOUT_S + 30
        )
        self.started.append(deployment)

    async def _start(self, deployment: DockerDeployment) -> None:
        await deployment.start()  # type: ignore[no-untyped-call, unused-ignore]
        if self.drain:
            process = getattr(deployment, "_container_process", None)
            if process is not None:
                _drain(process.stdout)
                _drain(process.stderr)
        await deployment.runtime.create_session(CreateBashSessionRequest(startup_timeout=30))

    def calls(self, mode: str, n: int) -> list[Call]:
        if mode == "SWE-ReX session":
            return [self._session_call(d) for d in self.started[:n]]
        return [self._execute_call(d) for d in self.started[:n]]

    @staticmethod
    def _session_call(deployment: DockerDeployment) -> Call:
        runtime = deployment.runtime

        async def call(command: str) -> str:
            action = BashAction(command=command, timeout=COMMAND_TIMEOUT_S, check="silent")
            observation = await runtime.run_in_session(action)
            if observation.exit_code != 0:
                raise RuntimeError(f"exit {observation.exit_code}: {observation.output[:200]!r}")
            return str(observation.output)

        return call

    @staticmethod
    def _execute_call(deployment: DockerDeployment) -> Call:
        runtime = deployment.runtime

        async def call(command: str) -> str:
            request = Command(command=command, shell=True, timeout=COMMAND_TIMEOUT_S)
            response = await runtime.execute(request)
            if response.exit_code != 0:
                raise RuntimeError(f"exit {response.exit_code}: {response.stderr[:200]!r}")
            return str(response.stdout)

        return call

    def container_ids(self) -> list[str]:
        client = docker.from_env()
        names = [str(d.container_name) for d in self.started if d.container_name]
        return [str(client.containers.get(name).id) for name in names]

    async def close(self) -> None:
        async def stop(deployment: DockerDeployment) -> None:
            with contextlib.suppress(Exception):
                await deployment.stop()  # type: ignore[no-untyped-call, unused-ignore]

        # stop() blocks on `docker kill`: each in its own thread and loop.
        await asyncio.gather(
            *(asyncio.to_thread(asyncio.run, stop(d)) for d in self.deployments),
            return_exceptions=True,
        )


class OrchestratorFleet:
    """Rollouts of a local deployment of this orchestrator, called through HTTP.

    With aiohttp, the HTTP client SWE-ReX's own RemoteRuntime uses, so the two are driven
    alike (one connection per session, kept alive). httpx here cost 10.3 ms of the
    benchmark's own CPU per call at 32 sessions against SWE-ReX's client's 1.6 ms
    (2026-12-03, before/after in bench/README.md), on the cores the servers share."""

    modes: tuple[str, ...] = ("orchestrator",)

    def __init__(self, base: str, token: str, settings: Settings, max_sessions: int) -> None:
        self.base = base
        self.headers = {"Authorization": f"Bearer {token}"}
        self.max_sessions = max_sessions
        self._http: aiohttp.ClientSession | None = None
        self.settings = settings
        self.traces: list[str] = []
        self.seq: dict[str, int] = {}

    @property
    def http(self) -> aiohttp.ClientSession:
        # Made in the running loop, at first use.
        if self._http is None:
            self._http = aiohttp.ClientSession(
                base_url=self.base,
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=120),
                connector=aiohttp.TCPConnector(limit=self.max_sessions + 8),
            )
        return self._http

    async def _call(self, trace: str, command: str) -> str:
        n = self.seq[trace] = self.seq[trace] + 1
        body = function_call(
            trace, str(n), "shell", {"command": command}, {"codebase": BENCH_CODEBASE}
        )
        async with self.http.post("/agent-rft/tools", json=body) as response:
            response.raise_for_status()
            output = str((await response.json())["output"])
        return "" if output == "(no output)" else output

    async def grow(self, n: int) -> None:
        async def start_one() -> None:
            trace = f"trace_{uuid.uuid4().hex}"
            self.seq[trace] = 0
            await self._call(trace, "true")  # creates the sandbox
            self.traces.append(trace)

        await _grow(len(self.traces), n, start_one)

    def calls(self, mode: str, n: int) -> list[Call]:
        def bind(trace: str) -> Call:
            return lambda command: self._call(trace, command)

        return [bind(trace) for trace in self.traces[:n]]

    def container_ids(self) -> list[str]:
        client = docker.from_env()
        found = client.containers.list(
            filters={"label": labels.deployment_filter(self.settings.deployment)}
        )
        return [str(c.id) for c in found]

    async def close(self) -> None:
        for trace in self.traces:
            with contextlib.suppress(aiohttp.ClientError):
                async with self.http.delete(f"/v1/rollouts/{trace}"):
                    pass
        await self.http.close()


def _check_exit(exit_code: int | None, output: str) -> str:
    if exit_code != 0:
        raise RuntimeError(f"exit {exit_code}: {output[:200]!r}")
    return output


class DockerExecFleet:
    """Plain containers of the SWE-ReX image; commands through `docker exec` (SDK)."""

    modes: tuple[str, ...] = ("docker exec",)

    def __init__(self, image: str, run_id: str, cpus: float, memory_mb: int, pool: int) -> None:
        self.client = docker.from_env(max_pool_size=pool)
        self.image = image
        self.run_id = run_id
        self.cpus = cpus
        self.memory_mb = memory_mb
        self.containers: list[Any] = []

    async def grow(self, n: int) -> None:
        async def start_one() -> None:
            container = await asyncio.to_thread(
                self.client.containers.run,
                self.image,
                ["sleep", "infinity"],
                detach=True,
                labels={RUN_LABEL: self.run_id},
                network_mode="none",
                nano_cpus=int(self.cpus * 1e9),
                mem_limit=f"{self.memory_mb}m",
            )
            self.containers.append(container)

        await _grow(len(self.containers), n, start_one)

    def calls(self, mode: str, n: int) -> list[Call]:
        def bind(container: Any) -> Call:
            async def call(command: str) -> str:
                for _ in range(3):
                    result = await asyncio.to_thread(container.exec_run, ["bash", "-c", command])
                    output = _check_exit(result.exit_code, result.output.decode(errors="replace"))
                    # Under load dockerd now and then answers exit 0 with the output lost
                    # (seen at 32 sessions: a `grep | wc -l` that printed nothing). Run it
                    # again, timed whole, rather than abort the run or count a lost run.
                    if output or command == COMMANDS["true"]:
                        break
                return output

            return call

        return [bind(c) for c in self.containers[:n]]

    def container_ids(self) -> list[str]:
        return [str(c.id) for c in self.containers]

    async def close(self) -> None:
        for container in self.containers:
            with contextlib.suppress(DockerException):
                await asyncio.to_thread(container.remove, force=True)


class AgentFleet:
    """Sandboxes of our Docker backend; commands straight to their exec agent (no API)."""

    modes: tuple[str, ...] = ("exec agent",)

    def __init__(self, settings: Settings, image: str) -> None:
        self.backend = DockerBackend(settings)
        self.settings = settings
        self.image = image
        self.handles: list[SandboxHandle] = []

    async def grow(self, n: int) -> None:
        async def start_one() -> None:
            spec = SandboxSpec.from_settings(self.settings, image=self.image, rollout_id="peer")
            self.handles.append(await asyncio.to_thread(self.backend.create, spec))

        await _grow(len(self.handles), n, start_one)

    def calls(self, mode: str, n: int) -> list[Call]:
        def bind(handle: SandboxHandle) -> Call:
            async def call(command: str) -> str:
                result = await asyncio.to_thread(
                    self.backend.exec,
                    handle,
                    command,
                    timeout_s=COMMAND_TIMEOUT_S,
                    output_budget_bytes=16384,
                )
                return _check_exit(result.exit_code, result.stdout.head + result.stdout.tail)

            return call

        return [bind(h) for h in self.handles[:n]]

    def container_ids(self) -> list[str]:
        return [h.native_id for h in self.handles]

    async def close(self) -> None:
        for handle in self.handles:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.backend.destroy, handle)
        collect_expired(self.backend, everything=True)


# -- CPU accounting ----------------------------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")
DOCKER_COMMS = {"dockerd", "containerd", "docker-proxy", "docker", "runc"}
CPU_GROUPS = ("client", "orchestrator", "redis", "docker", "containers")
"""Where a call's CPU went: this script (the load generator, and SWE-ReX's client), the
orchestrator's API/worker/beat, Redis, Docker's daemons, shims, proxies and CLI clients, and
the cgroups of this run's containers (SWE-ReX's server and the commands, or the exec agent)."""


class CpuMeter:
    """Cumulative CPU seconds per group; deltas around a window give its cost."""

    def __init__(self) -> None:
        self.cgroups: dict[str, Path] = {}

    def track(self, container_ids: list[str]) -> None:
        client = docker.from_env()
        for cid in container_ids:
            if cid in self.cgroups:
                continue
            with contextlib.suppress(DockerException, OSError, ValueError):
                pid = int(client.api.inspect_container(cid)["State"]["Pid"])
                self.cgroups[cid] = _cpu_usage_file(pid)

    def snapshot(self) -> dict[str, tuple[str, float]]:
        """Every counter (a process, a container's cgroup, the host) -> (group, CPU seconds)."""
        counters: dict[str, tuple[str, float]] = {}
        me = os.getpid()
        procs = _processes()
        parents = {pid: p[0] for pid, p in procs.items()}
        for pid, (_, comm, started, own, children) in procs.items():
            key = f"pid {pid} {started}"
            if comm.startswith("containerd-shim"):
                # A shim reaps the processes `docker exec` starts, which the container's
                # cgroup counts already; the runc runs it reaps are lost with them.
                counters[key] = ("docker", own)
            elif comm in DOCKER_COMMS:
                counters[key] = ("docker", own + children)
            elif pid == me:
                counters[key] = ("client", own)
            elif _descends(pid, me, parents):
                counters[key] = ("orchestrator", own + children)
            elif comm == "redis-server":
                counters[key] = ("redis", own)
        for cid, path in self.cgroups.items():
            with contextlib.suppress(OSError, ValueError):
                counters[f"cgroup {cid}"] = ("containers", _read_cgroup_seconds(path))
        counters["host"] = ("host busy", _host_busy_seconds())
        return counters

    @staticmethod
    def delta(
        before: dict[str, tuple[str, float]], after: dict[str, tuple[str, float]]
    ) -> dict[str, float]:
        """CPU seconds per group between two snapshots. A process born in between counts
        whole; one that exited in between loses its last moments (its parent's children
        time has them when the parent is counted)."""
        spent = dict.fromkeys((*CPU_GROUPS, "host busy"), 0.0)
        for key, (group, value) in after.items():
            if key in before:
                spent[group] += max(0.0, value - before[key][1])
            elif key.startswith("pid "):
                spent[group] += value
        return spent


def _processes() -> dict[int, tuple[int, str, int, float, float]]:
    """pid -> (ppid, comm, start time, own CPU s, reaped children's CPU s)."""
    found: dict[int, tuple[int, str, int, float, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1 : raw.rindex(")")]
        rest = raw[raw.rindex(")") + 2 :].split()  # rest[i] is field i + 3 of proc(5)
        utime, stime, cutime, cstime = (int(x) for x in rest[11:15])
        found[int(entry)] = (
            int(rest[1]),
            comm,
            int(rest[19]),
            (utime + stime) / CLK_TCK,
            (cutime + cstime) / CLK_TCK,
        )
    return found


def _descends(pid: int, ancestor: int, parents: dict[int, int]) -> bool:
    seen = 0
    while pid > 1 and seen < 64:
        pid = parents.get(pid, 0)
        if pid == ancestor:
            return True
        seen += 1
    return False


def _cpu_usage_file(pid: int) -> Path:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(","):
            return Path(f"/sys/fs/cgroup/cpuacct{path}/cpuacct.usage")
        if controllers == "" and Path("/sys/fs/cgroup/cgroup.controllers").exists():
            return Path(f"/sys/fs/cgroup{path}/cpu.stat")
    raise ValueError(f"no CPU accounting cgroup for pid {pid}")


def _read_cgroup_seconds(path: Path) -> float:
    text = path.read_text()
    if path.name == "cpu.stat":
        fields = dict(line.split() for line in text.splitlines())
        return int(fields["usage_usec"]) / 1e6
    return int(text) / 1e9


def _host_busy_seconds() -> float:
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


# -- measuring ---------------------------------------------------------------------------------


class OutputCheck:
    """Only real runs count: `true` prints nothing; the grep prints the same count everywhere."""

    def __init__(self) -> None:
        self.grep_count: str | None = None

    def __call__(self, mode: str, label: str, output: str) -> None:
        out = output.strip()
        if label == "true":
            ok = out == ""
        else:
            self.grep_count = self.grep_count or out
            ok = out.isdigit() and out == self.grep_count
        if not ok:
            raise RuntimeError(f"{mode}: unexpected output for {label}: {out[:200]!r}")


async def timed(call: Call, mode: str, label: str, check: OutputCheck) -> float:
    started = time.perf_counter()
    output = await call(COMMANDS[label])
    elapsed = (time.perf_counter() - started) * 1000
    check(mode, label, output)
    return elapsed


def _rotated(items: tuple[str, ...], by: int) -> list[str]:
    k = by % len(items)
    return [*items[k:], *items[:k]]


async def latency_phase(
    calls: dict[str, Call], iterations: int, check: OutputCheck
) -> dict[str, dict[str, dict[str, float]]]:
    """One session per mode; modes interleaved call by call, their order rotated each time."""
    modes = tuple(calls)
    for mode in modes:  # warm-up
        for label in COMMANDS:
            for _ in range(3):
                await timed(calls[mode], mode, label, check)
    samples: dict[str, dict[str, list[float]]] = {m: {c: [] for c in COMMANDS} for m in modes}
    for i in range(iterations):
        # The grep is slower: a fifth as many samples keeps the run short.
        for label in ("true", "grep") if i % 5 == 0 else ("true",):
            for mode in _rotated(modes, i):
                samples[mode][label].append(await timed(calls[mode], mode, label, check))
    return {m: {c: summary(v) for c, v in by_cmd.items()} for m, by_cmd in samples.items()}


class Window:
    """Calls, their latencies and their CPU, over all windows of one cell."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.wall_s = 0.0
        self.cpu_s = dict.fromkeys((*CPU_GROUPS, "host busy"), 0.0)

    def report(self) -> dict[str, Any]:
        n = len(self.latencies)
        ours = sum(self.cpu_s[g] for g in CPU_GROUPS)
        cpu = {g: round(self.cpu_s[g] / n * 1000, 2) for g in CPU_GROUPS} if n else {}
        return {
            **summary(self.latencies),
            "calls_per_s": round(n / self.wall_s, 1) if self.wall_s else 0.0,
            "wall_s": round(self.wall_s, 2),
            "cpu_ms_per_call": {
                **cpu,
                "ours": round(ours / n * 1000, 2) if n else 0.0,
                "host busy": round(self.cpu_s["host busy"] / n * 1000, 2) if n else 0.0,
            },
            "cores_busy": round(self.cpu_s["host busy"] / self.wall_s, 2) if self.wall_s else 0,
        }


async def run_window(
    calls: list[Call], mode: str, label: str, seconds: float, check: OutputCheck, into: Window
) -> None:
    deadline = time.perf_counter() + seconds

    async def worker(call: Call) -> None:
        while time.perf_counter() < deadline:
            into.latencies.append(await timed(call, mode, label, check))

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in calls))
    into.wall_s += time.perf_counter() - started


async def measure(
    fleets: list[Fleet], args: argparse.Namespace, check: OutputCheck
) -> dict[str, Any]:
    by_mode = {mode: fleet for fleet in fleets for mode in fleet.modes}
    modes = tuple(m for m in MODES if m in by_mode)
    meter = CpuMeter()
    for fleet in fleets:
        await fleet.grow(1)
    print("latency: one session per mode, interleaved", flush=True)
    latency = await latency_phase(
        {m: by_mode[m].calls(m, 1)[0] for m in modes}, args.iterations, check
    )
    throughput: dict[str, dict[str, dict[str, Any]]] = {}
    for level in args.concurrency:
        print(f"throughput: {level} sessions per mode", flush=True)
        for fleet in fleets:
            await fleet.grow(level)
            meter.track(fleet.container_ids())
        cells = {(m, c): Window() for m in modes for c in COMMANDS}
        await asyncio.sleep(1)  # let start-up work settle
        for r in range(args.rounds):
            for label in COMMANDS:
                for mode in _rotated(modes, r):
                    cell = cells[(mode, label)]
                    before = meter.snapshot()
                    await run_window(
                        by_mode[mode].calls(mode, level), mode, label, args.seconds, check, cell
                    )
                    spent = meter.delta(before, meter.snapshot())
                    for group, value in spent.items():
                        cell.cpu_s[group] += value
        throughput[str(level)] = {m: {c: cells[(m, c)].report() for c in COMMANDS} for m in modes}
        for m in modes:
            r_true, r_grep = (throughput[str(level)][m][c] for c in COMMANDS)
            print(
                f"  {m}: true {r_true['calls_per_s']}/s p50 {r_true['p50']} ms; "
                f"grep {r_grep['calls_per_s']}/s p50 {r_grep['p50']} ms",
                flush=True,
            )
    return {"latency": latency, "throughput": throughput}


def ratios(report: dict[str, Any]) -> dict[str, Any]:
    """Orchestrator vs the others: latency as their p50 / ours, throughput as ours / theirs."""
    out: dict[str, Any] = {"latency_p50": {}, "calls_per_s": {}}
    lat = report["latency"]
    others = [m for m in lat if m not in ("orchestrator", "exec agent")]
    for label in COMMANDS:
        ours = lat["orchestrator"][label]["p50"]
        out["latency_p50"][label] = {m: round(lat[m][label]["p50"] / ours, 2) for m in others}
    for level, modes in report["throughput"].items():
        out["calls_per_s"][level] = {}
        for label in COMMANDS:
            ours = modes["orchestrator"][label]["calls_per_s"]
            out["calls_per_s"][level][label] = {
                m: round(ours / modes[m][label]["calls_per_s"], 2)
                for m in others
                if modes[m][label]["calls_per_s"]
            }
    return out


# -- report ------------------------------------------------------------------------------------


def render(report: dict[str, Any]) -> str:
    p = report["parameters"]
    lat = report["latency"]
    lines = [
        f"## Per-command latency, one session per mode, interleaved call by call (ms; "
        f"{p['iterations']} `true`, {len(range(0, p['iterations'], 5))} grep each)",
        "",
        "| mode | `true` p50 | `true` p90 | `true` p99 | grep p50 | grep p90 | grep p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, r in lat.items():
        t, g = r["true"], r["grep"]
        lines.append(
            f"| {mode} | {t['p50']} | {t['p90']} | {t['p99']} | {g['p50']} | {g['p90']}"
            f" | {g['p99']} |"
        )
    lines += [
        "",
        f"## Concurrent throughput: N sessions per mode back to back, {p['rounds']} windows of "
        f"{p['seconds']} s per cell, modes taking turns",
        "",
        "| sessions | mode | `true` calls/s | p50 | p99 | grep calls/s | p50 | p99 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for level, modes in report["throughput"].items():
        for mode, r in modes.items():
            t, g = r["true"], r["grep"]
            lines.append(
                f"| {level} | {mode} | {t['calls_per_s']} | {t['p50']} | {t['p99']}"
                f" | {g['calls_per_s']} | {g['p50']} | {g['p99']} |"
            )
    rat = report["ratios"]
    others = list(rat["latency_p50"]["true"])
    lines += [
        "",
        "## Ratios (orchestrator vs each; > 1 means the orchestrator is faster)",
        "",
        "| measure | " + " | ".join(f"vs {m}" for m in others) + " |",
        "|---|" + "---|" * len(others),
    ]
    for label in COMMANDS:
        row = rat["latency_p50"][label]
        lines.append(
            f"| p50 latency, `{label}`, 1 session | "
            + " | ".join(f"{row[m]}x" for m in others)
            + " |"
        )
    for level, by_cmd in rat["calls_per_s"].items():
        for label in COMMANDS:
            row = by_cmd[label]
            lines.append(
                f"| calls/s, `{label}`, {level} sessions | "
                + " | ".join(f"{row.get(m, float('nan'))}x" for m in others)
                + " |"
            )
    top = max(report["throughput"], key=int)
    lines += [
        "",
        f"## CPU per call at {top} sessions (ms of CPU; `true` / grep)",
        "",
        "| mode | client | orchestrator | redis | docker | containers | ours | host busy |"
        " cores busy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in report["throughput"][top].items():
        t, g = r["true"]["cpu_ms_per_call"], r["grep"]["cpu_ms_per_call"]
        cells = " | ".join(f"{t[k]} / {g[k]}" for k in (*CPU_GROUPS, "ours", "host busy") if k in t)
        lines.append(
            f"| {mode} | {cells} | {r['true']['cores_busy']} / {r['grep']['cores_busy']} |"
        )
    lines += [
        "",
        f"swe-rex {report['swerex_version']} in `{report['swerex_image']}`; containers of "
        f"every mode limited to {p['cpus']} CPU and {p['memory_mb']} MiB.",
    ]
    return "\n".join(lines) + "\n"


# -- main --------------------------------------------------------------------------------------


@contextlib.contextmanager
def cleanup(run_id: str, direct: Settings) -> Iterator[None]:
    """Whatever happens (SIGTERM included), no container this run started outlives it:
    neither SWE-ReX's nor the plain ones (by label) nor the direct sandboxes (local_stack
    sweeps its own)."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        client = docker.from_env()
        for container in client.containers.list(all=True, filters={"label": RUN_LABEL}):
            if (container.labels or {}).get(RUN_LABEL) == run_id:
                with contextlib.suppress(DockerException):
                    container.remove(force=True)
        collect_expired(DockerBackend(direct), everything=True)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


async def run_all(
    args: argparse.Namespace,
    base: str,
    token: str,
    stack: Settings,
    direct: Settings,
    image: str,
    codebase: str,
    run_id: str,
) -> dict[str, Any]:
    pool = max(args.concurrency) * 2 + 16
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=pool))
    limits = ["--cpus", str(stack.sandbox_cpus), "--memory", f"{stack.sandbox_memory_mb}m"]
    fleets: list[Fleet] = [
        SweRexFleet(image, [*limits, "--label", f"{RUN_LABEL}={run_id}"], drain=not args.no_drain),
        OrchestratorFleet(base, token, stack, max(args.concurrency)),
        DockerExecFleet(image, run_id, stack.sandbox_cpus, stack.sandbox_memory_mb, pool),
        AgentFleet(direct, codebase),
    ]
    try:
        return await measure(fleets, args, OutputCheck())
    finally:
        for fleet in fleets:
            await fleet.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=200, help="latency calls per mode")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=4.0, help="length of one window")
    parser.add_argument("--rounds", type=int, default=2, help="windows per mode and command")
    parser.add_argument(
        "--no-drain",
        action="store_true",
        help="leave SWE-ReX's container output pipes unread, as DockerDeployment does",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    stack = throwaway_stack_settings("bench-peer", STACK_ENVIRONMENTS)
    state = stack.state_dir
    token = stack.api_tokens
    run_id = stack.host_id.removeprefix("bench-")
    direct = stack.model_copy(update={"deployment": "bench-peer-direct"})
    build_base_image(stack)
    codebase = ensure_bench_codebase(stack)
    image = ensure_peer_image(stack, codebase, lambda line: print(line, flush=True))

    with cleanup(run_id, direct), local_stack(stack, log=state / "stack.log", forget=True) as base:
        results = asyncio.run(run_all(args, base, token, stack, direct, image, codebase, run_id))
    report: dict[str, Any] = {
        "parameters": {
            "iterations": args.iterations,
            "concurrency": args.concurrency,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "drain": not args.no_drain,
            "cpus": stack.sandbox_cpus,
            "memory_mb": stack.sandbox_memory_mb,
            "commands": COMMANDS,
        },
        "swerex_version": importlib.metadata.version("swe-rex"),
        "swerex_image": image,
        "codebase": codebase,
        **results,
    }
    report["ratios"] = ratios(report)
    markdown = render(report)
    print(markdown)
    print(f"wrote {write_report('peer', report, markdown)}")
    _remove_state(state)


def _remove_state(state: Path) -> None:
    mounts = Path("/proc/self/mounts").read_text()
    if f" {state}/" in mounts or f" {state} " in mounts:
        print(f"left {state} in place: something is still mounted under it")
        return
    shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()
