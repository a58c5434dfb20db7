"""A burst of Agent RFT rollouts at a training-step boundary.

    python -m bench.burst [--rollouts 256] [--pool 64] [--bursts 1] [--idle-sandboxes 1000]
                          [--seed 0] [--launch-window 1.0] [--profile]
    python -m bench.burst --bursts 0     # the idle phase alone: bench/results/burst-idle.*

Starts its own deployment (API, one worker, beat) on loopback with an environment on the
real `requests` codebase (no tool budget) and, once the warm pool (if any) is full, launches
N rollouts within one second through the Agent RFT endpoints, as a trainer would: each makes
six tool calls (grep, find, read_file, then grep and read_file at once as a parallel pair,
then find) with 0.2-1.0 s of think time before each step and before grading, then posts its
grade. ``--bursts 2``: a second identical burst starts as soon as the first is over (its
last sandboxes still being reset for the pool), as at two training steps in a row; the
report puts the bursts side by side, with the pool at each launch (ready, being reset), what
became of the sandboxes sent for recycling, and the rollouts' waits for them. 5xx and
transport errors are retried at most 3 times with the same call_id (the trainer's rule); a
rollout still failing is discarded. Other 4xx go to the model (not retried). Every
response is counted by outcome; 200s are split into ok and agent_error from the trajectory
the orchestrator recorded.

Reports sandbox acquisition (the rollout record's created -> sandbox ready, split by pool
hit and cold, and the client's view: first call minus its exec time), tool-call latency
(the trainer's round trip, calls after the first, retries included), errors by outcome, peak
host memory, sandboxes and in-flight calls over time, CPU seconds by process during the
burst, containers left once the reaper ran, how long the stack's own teardown (Ctrl-C on
``orchestrator up``) took and what it left. Then a separate phase creates
``--idle-sandboxes`` idle sandboxes directly through DockerBackend: do they all start and
answer, and what host memory do they take. Plots: bench/results/burst-latency-cdf.png and
burst-timeline.png. Writes bench/results/burst.json and .md.

The load generator runs on the same cores as the stack: its figures include that contention.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import docker
import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from bench import plots
from bench.common import (
    RESULTS,
    cmdline,
    container_cpu_s,
    function_call,
    host_busy_s,
    mem_used_mb,
    proc_cpu_s,
    summary,
    write_report,
)
from orchestrator import local
from orchestrator.config import Settings
from orchestrator.environments.examples import ensure_requests_codebase, planning_example_dir
from orchestrator.local import free_port, local_stack
from orchestrator.sandbox import labels
from orchestrator.sandbox.backend import SandboxBackend, SandboxHandle, SandboxSpec
from orchestrator.sandbox.cgroups import container_file
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.sandbox.gc import GcReport, collect_expired
from orchestrator.state.forget import forget_deployment
from orchestrator.state.keys import Keys
from orchestrator.state.pool_sizing import POOL_LABEL, pool_name

ENVIRONMENT = "bench-burst"
# A deployment of its own per run: nothing in Redis (pools, admission slots, rollouts) from
# an earlier run can leak into this one. Its keys are deleted at the end.
DEPLOYMENT = f"bench-burst-{uuid.uuid4().hex[:6]}"
IDLE_DEPLOYMENT = f"{DEPLOYMENT}-idle"
MAX_RETRIES = 3  # Agent RFT: 5xx retried at most 3 times, then the rollout is discarded
RETRY_DELAY_S = 1.0
ROLLOUTS_PER_CLIENT = 16
RAW_FILE = "burst-samples.json"
RAW_KEYS = ("series", "timeline", "calls", "per_rollout")  # when a 5xx carries no Retry-After
THINK_S = (0.2, 1.0)
# Issue 13's: a first burst on a freshly started stack, then one started right after it.
ACQUIRE_P99_MS = (15_000.0, 1000.0)
TOOL_P99_MS = (250.0, 100.0)
IDLE_SANDBOXES = 1000  # issue 13's: at least this many idle sandboxes in 24 GiB
IDLE_MEMORY_MB = 24 * 1024

# What the rollouts run on the `requests` codebase (src/requests/*.py). Every grep pattern
# matches and every file is long enough for the line ranges, so valid calls are never an
# agent_error; `| head` keeps the exit status 0.
GREP_PATTERNS = [
    "def ",
    "class ",
    "import ",
    "raise ",
    "return ",
    "self.headers",
    "Session",
    "cookie",
    "proxies",
    "timeout",
    "redirect",
    "encoding",
    "auth",
    "url",
]
FIND_COMMANDS = [
    "find src -name '*.py' | sort",
    "find src/requests -name '*.py' -size +8k | sort",
    "find . -path ./.git -prune -o -type f -print | wc -l",
    "find src/requests -maxdepth 1 -name '*s.py' | sort",
    "find src -type f -name '*.py' -newer README.md | wc -l",
]
READ_FILES = [
    "src/requests/sessions.py",
    "src/requests/models.py",
    "src/requests/adapters.py",
    "src/requests/utils.py",
    "src/requests/auth.py",
    "src/requests/cookies.py",
    "src/requests/structures.py",
    "src/requests/api.py",
]

# Outcome of one response, as the trainer sees it.
OK = "200 ok"
AGENT_ERROR = "200 agent_error"
UNRECORDED = "200 not in trajectory"
INFRA = "503 infra_error"
ADMISSION = "429/503 at_capacity (admission)"
OTHER = "other"
OUTCOMES = [OK, AGENT_ERROR, UNRECORDED, INFRA, ADMISSION, OTHER]
GRADE_OK = "200 scored"


# -- the rollouts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedCall:
    tool: str
    arguments: dict[str, Any]


def grep(rng: random.Random) -> PlannedCall:
    pattern = rng.choice(GREP_PATTERNS)
    where = rng.choice(["src/requests", "--include=*.py ."])
    command = f"grep -rn -e {shlex.quote(pattern)} {where} | head -n 40"
    return PlannedCall("shell", {"command": command})


def find(rng: random.Random) -> PlannedCall:
    return PlannedCall("shell", {"command": rng.choice(FIND_COMMANDS)})


def read(rng: random.Random) -> PlannedCall:
    start = rng.randint(1, 60)
    return PlannedCall(
        "read_file",
        {"path": rng.choice(READ_FILES), "start_line": start, "end_line": start + 79},
    )


def plan(rng: random.Random) -> list[list[PlannedCall]]:
    """Five steps, six calls: a step of two calls is a parallel pair."""
    return [[grep(rng)], [find(rng)], [read(rng)], [grep(rng), read(rng)], [find(rng)]]


def tool_label(call: PlannedCall) -> str:
    if call.tool == "read_file":
        return "read_file"
    return "shell grep" if call.arguments["command"].startswith("grep") else "shell find"


@dataclass
class Attempt:
    """One HTTP request and its response."""

    kind: str  # "tool" or "grade"
    trace: str
    call_id: str
    label: str
    step: int
    attempt: int
    sent_s: float  # since the burst started
    latency_ms: float
    status: int | None
    outcome: str
    retry_after: str | None = None


@dataclass
class CallResult:
    """One tool call or grade as the trainer saw it, retries included."""

    trace: str
    call_id: str
    label: str
    step: int
    parallel: bool
    sent_s: float
    total_ms: float
    attempts: int
    succeeded: bool


@dataclass
class RolloutResult:
    trace: str
    item: int = 0  # which dataset row: the rollouts of one row are one (GRPO) group
    launched_s: float = 0.0
    discarded: bool = False
    graded: bool = False
    score: float | None = None
    calls: list[CallResult] = field(default_factory=list)


@dataclass
class Counters:
    """What the load generator is doing right now, read by the sampler thread."""

    t0: float = 0.0  # perf_counter when the burst started; 0 before
    inflight: int = 0
    active: int = 0
    loop_lag_ms: float = 0.0  # the load generator's event loop: how late a 50 ms sleep woke
    marks: dict[str, float] = field(default_factory=dict)

    def now(self) -> float:
        return time.perf_counter() - self.t0 if self.t0 else 0.0

    def mark(self, name: str) -> None:
        self.marks[name] = round(self.now(), 2)


@dataclass
class Reply:
    """What the load generator keeps of a response."""

    status: int
    retry_after: str | None
    body: Any = None


class Burst:
    """The load generator: N rollouts and every response."""

    def __init__(
        self,
        https: list[aiohttp.ClientSession],
        items: list[dict[str, Any]],
        seed: int,
        counters: Counters,
    ) -> None:
        self.https = https
        self.items = items
        self.seed = seed
        self.c = counters
        self.attempts: list[Attempt] = []
        self.rollouts: list[RolloutResult] = []

    def now(self) -> float:
        return self.c.now()

    async def post(
        self,
        http: aiohttp.ClientSession,
        kind: str,
        path: str,
        body: dict[str, Any],
        trace: str,
        call_id: str,
        label: str,
        step: int,
    ) -> tuple[CallResult, Reply | None]:
        first_sent = self.now()
        response: Reply | None = None
        for attempt in range(1 + MAX_RETRIES):
            sent = self.now()
            self.c.inflight += 1
            status: int | None = None
            retry_after: str | None = None
            try:
                async with http.post(path, json=body) as answer:
                    response = Reply(answer.status, answer.headers.get("retry-after"))
                    if answer.content_type == "application/json":
                        response.body = await answer.json()
                status = response.status
                retry_after = response.retry_after
            except (aiohttp.ClientError, TimeoutError):
                response = None
            finally:
                self.c.inflight -= 1
            latency = (self.now() - sent) * 1000
            if status == 200:
                outcome = GRADE_OK if kind == "grade" else OK  # refined from the trajectory
            elif status in (429, 503) and _error_code(response) == "at_capacity":
                outcome = ADMISSION
            elif status == 503:
                outcome = INFRA
            else:
                outcome = OTHER
            self.attempts.append(
                Attempt(
                    kind,
                    trace,
                    call_id,
                    label,
                    step,
                    attempt,
                    sent,
                    latency,
                    status,
                    outcome,
                    retry_after,
                )
            )
            retryable = status is None or status >= 500
            if status == 200 or not retryable or attempt == MAX_RETRIES:
                break
            await asyncio.sleep(_retry_delay(retry_after))
        total = (self.now() - first_sent) * 1000
        ok = response is not None and response.status == 200
        result = CallResult(trace, call_id, label, step, False, first_sent, total, attempt + 1, ok)
        return result, response

    async def rollout(self, index: int, start: asyncio.Event, window_s: float) -> None:
        rng = random.Random(self.seed * 1_000_003 + index)
        http = self.https[index % len(self.https)]
        trace = f"trace_{uuid.uuid4().hex}"  # unique: the seed chooses the calls only
        item = self.items[index % len(self.items)]
        steps = plan(rng)
        thinks = [rng.uniform(*THINK_S) for _ in range(len(steps))]
        offset = rng.uniform(0, window_s)
        result = RolloutResult(trace, item=index % len(self.items))
        self.rollouts.append(result)
        await start.wait()
        await asyncio.sleep(offset)
        result.launched_s = self.now()
        self.c.active += 1
        try:
            for step, calls in enumerate(steps):
                if step:
                    await asyncio.sleep(thinks[step - 1])
                done = await asyncio.gather(
                    *(self.tool_call(http, trace, item, step, n, c) for n, c in enumerate(calls))
                )
                for call in done:
                    call.parallel = len(calls) > 1
                    result.calls.append(call)
                if not all(c.succeeded for c in done):
                    # 5xx after its retries (or a 4xx): a trainer discards the rollout.
                    result.discarded = True
                    return
            await asyncio.sleep(thinks[-1])
            body = {
                "sample": {"output_text": json.dumps({"files": item.get("gold_files", [])})},
                "item": item,
                "trace_id": trace,
            }
            graded, response = await self.post(
                http, "grade", "/agent-rft/grade", body, trace, "grade", "grade", len(steps)
            )
            result.calls.append(graded)
            if response is not None and response.status == 200:
                result.graded = True
                result.score = float(response.body["score"])
            else:
                result.discarded = True
        finally:
            self.c.active -= 1

    async def tool_call(
        self,
        http: aiohttp.ClientSession,
        trace: str,
        item: dict[str, Any],
        step: int,
        n: int,
        call: PlannedCall,
    ) -> CallResult:
        body = function_call(trace, f"{step}_{n}", call.tool, call.arguments, item)
        call_id = body["call_id"]
        result, _ = await self.post(
            http, "tool", "/agent-rft/tools", body, trace, call_id, tool_label(call), step
        )
        return result

    async def run(self, n: int, window_s: float) -> float:
        start = asyncio.Event()
        tasks = [asyncio.create_task(self.rollout(i, start, window_s)) for i in range(n)]
        await asyncio.sleep(0.2)  # every rollout is waiting at the barrier
        self.c.t0 = time.perf_counter()
        start.set()
        lag = asyncio.create_task(self.watch_loop())
        await asyncio.gather(*tasks)
        self.c.mark("burst over")
        lag.cancel()
        return self.now()

    async def watch_loop(self) -> None:
        """The client's own delay: a late wake-up here is latency the stack did not add."""
        while True:
            started = time.perf_counter()
            await asyncio.sleep(0.05)
            late = (time.perf_counter() - started - 0.05) * 1000
            self.c.loop_lag_ms = max(self.c.loop_lag_ms, late)  # the sampler resets it


def _retry_delay(retry_after: str | None) -> float:
    if retry_after:
        try:
            return min(30.0, max(0.0, float(retry_after)))
        except ValueError:
            pass
    return RETRY_DELAY_S


# -- sampling the host -------------------------------------------------------------------------


@dataclass
class Sample:
    t: float
    mem_mb: float
    inflight: int
    active_rollouts: int
    sandboxes: int | None  # running containers of the deployment (every second)
    client_loop_lag_ms: float  # the worst in the last 0.2 s


def running_sandboxes(client: docker.DockerClient, deployment: str) -> int:
    found = client.api.containers(
        filters={"label": labels.deployment_filter(deployment)}, quiet=True
    )
    return len(found)


def owned_resources(client: docker.DockerClient, deployment: str) -> tuple[int, int]:
    """(containers in any state, volumes) labelled with the deployment."""
    label = labels.deployment_filter(deployment)
    containers = client.api.containers(all=True, filters={"label": label}, quiet=True)
    volumes = client.api.volumes(filters={"label": label}).get("Volumes") or []
    return len(containers), len(volumes)


class Sampler:
    """A thread sampling memory and counters every 0.2 s, sandboxes every second (as often
    as the daemon answers a listing, under load less often; the listing's JSON is parsed in
    this process, so not more often)."""

    def __init__(self, counters: Counters, client: docker.DockerClient, deployment: str) -> None:
        self.c, self.client, self.deployment = counters, client, deployment
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        last_count = -1.0
        while not self._stop.wait(0.2):
            if not self.c.t0:
                continue  # the burst has not started
            t = self.c.now()
            count: int | None = None
            if time.monotonic() - last_count >= 1.0:
                last_count = time.monotonic()
                try:
                    count = running_sandboxes(self.client, self.deployment)
                except docker.errors.DockerException:
                    count = None
            self.samples.append(
                Sample(
                    round(t, 3),
                    round(mem_used_mb(), 1),
                    self.c.inflight,
                    self.c.active,
                    count,
                    round(self.c.loop_lag_ms, 1),
                )
            )
            self.c.loop_lag_ms = 0.0


# -- CPU seconds by process --------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def stack_processes() -> dict[str, list[int]]:
    """The stack's processes (children of this one) and the host's daemons, by role."""
    roles: dict[str, list[int]] = {"bench client": [os.getpid()]}
    todo = _children(os.getpid())
    while todo:
        pid = todo.pop()
        cmd = cmdline(pid)
        if "py-spy" in cmd:
            roles.setdefault("py-spy", []).append(pid)
        elif "uvicorn" in cmd:
            roles.setdefault("api", []).append(pid)
        elif "celery" in cmd and " worker" in cmd:
            roles.setdefault("worker", []).append(pid)
        elif "celery" in cmd and " beat" in cmd:
            roles.setdefault("beat", []).append(pid)
        todo += _children(pid)
    daemons = {"dockerd": "dockerd", "containerd": "containerd", "redis-server": "redis"}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            name = (proc / "comm").read_text().strip()
        except OSError:
            continue
        if name in daemons:
            roles.setdefault(daemons[name], []).append(int(proc.name))
    return roles


def container_memory_mb(container_id: str) -> float:
    """The working set (usage less inactive file cache), as `docker stats` shows it."""
    usage = container_file("memory", container_id, "memory.usage_in_bytes", "memory.current")
    stat = container_file("memory", container_id, "memory.stat", "memory.stat")
    try:
        if usage is None or stat is None:
            return 0.0
        fields = dict(line.split() for line in stat.read_text().splitlines())
        inactive = int(fields.get("total_inactive_file", fields.get("inactive_file", "0")))
        return (int(usage.read_text()) - inactive) / 2**20
    except (OSError, ValueError):
        return 0.0


def shim_pss_mb(container_ids: set[str]) -> float:
    """Proportional set size of the containerd shims of these containers."""
    total_kb = 0
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if not (proc / "comm").read_text().startswith("containerd-shim"):
                continue
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if b"-id" not in argv or argv[argv.index(b"-id") + 1].decode() not in container_ids:
                continue
            for line in (proc / "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kb += int(line.split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total_kb / 1024


def container_ids(client: docker.DockerClient, deployment: str) -> set[str]:
    found = client.api.containers(
        all=True, filters={"label": labels.deployment_filter(deployment)}, quiet=True
    )
    return {c["Id"] for c in found}


def background_load(seconds: float) -> float:
    """Cores busy on the host while the stack idles before the burst: other tenants."""
    before = host_busy_s()
    time.sleep(seconds)
    return round((host_busy_s() - before) / seconds, 2)


class CpuMeter:
    """CPU seconds each role used between start() and stop(): the stack's processes, the
    daemons, the deployment's sandboxes (their cgroups, destroyed ones not counted) and the
    rest of the host ('other': other tenants of the machine, exited processes)."""

    def __init__(self, client: docker.DockerClient) -> None:
        self.client = client

    def start(self) -> None:
        self.roles = stack_processes()
        self.before = {pid: proc_cpu_s(pid) for pids in self.roles.values() for pid in pids}
        self.sandboxes_before = {
            c: container_cpu_s(c) for c in container_ids(self.client, DEPLOYMENT)
        }
        self.busy_before = host_busy_s()
        self.t = time.monotonic()

    def stop(self) -> dict[str, float]:
        wall = time.monotonic() - self.t
        busy = host_busy_s() - self.busy_before
        used = {
            role: round(sum(max(0.0, proc_cpu_s(p) - self.before[p]) for p in pids), 2)
            for role, pids in self.roles.items()
        }
        used["sandboxes"] = round(
            sum(
                max(0.0, container_cpu_s(c) - self.sandboxes_before.get(c, 0.0))
                for c in container_ids(self.client, DEPLOYMENT)
            ),
            2,
        )
        used["other"] = round(busy - sum(used.values()), 2)
        used["host busy (all cores)"] = round(busy, 2)
        used["wall"] = round(wall, 2)
        return used


# -- py-spy (optional) -------------------------------------------------------------------------


@contextmanager
def profiled(enabled: bool, out_dir: Path) -> Iterator[dict[str, Path]]:
    """py-spy record (raw collapsed stacks) of the API and the worker while the block runs."""
    files: dict[str, Path] = {}
    procs: list[subprocess.Popen[bytes]] = []
    if enabled:
        roles = stack_processes()
        for role in ("api", "worker"):
            for pid in roles.get(role, [])[:1]:
                path = out_dir / f"pyspy-{role}.txt"
                files[role] = path
                procs.append(
                    subprocess.Popen(
                        [
                            shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"),
                            "record",
                            "--pid",
                            str(pid),
                            "--format",
                            "raw",
                            "--rate",
                            "25",
                            "--nonblocking",
                            "--output",
                            str(path),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
    try:
        yield files
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def profile_summary(path: Path, top: int = 12) -> dict[str, Any]:
    """Share of samples per leaf function and per function on the stack (inclusive)."""
    if not path.exists():
        return {}
    leaf: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [f.split(" (")[0] + _module(f) for f in stack.split(";")]
        total += count
        leaf[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count

    def pct(count: int) -> float:
        return round(100 * count / total, 1) if total else 0.0

    return {
        "samples": total,
        "leaf_pct": {f: pct(c) for f, c in leaf.most_common(top)},
        "inclusive_pct": {
            f: pct(c) for f, c in inclusive.most_common(top * 3) if not f.startswith("process ")
        },
    }


def _module(frame: str) -> str:
    """' (file)' shortened to its last two path parts, for reading."""
    if " (" not in frame:
        return ""
    where = frame.split(" (", 1)[1].rstrip(")")
    return " (" + "/".join(where.split(":")[0].split("/")[-2:]) + ")"


# -- the idle phase ----------------------------------------------------------------------------


def idle_phase(settings: Settings, image: str, n: int) -> dict[str, Any]:
    """Create n idle sandboxes directly, check each answers, measure host memory, destroy.

    Host memory is MemTotal - MemAvailable before and after: on a machine shared with other
    tenants that moves with them too, so the sandboxes' own share is also summed from what
    can be attributed to them: their cgroups' working sets and their shims' PSS."""
    backend = DockerBackend(settings)
    collect_expired(backend, everything=True)
    time.sleep(1)
    before = mem_used_mb()
    handles: list[SandboxHandle] = []
    failures: list[str] = []

    def create(i: int) -> SandboxHandle:
        spec = SandboxSpec.from_settings(settings, image=image, rollout_id=f"idle-{i}")
        return backend.create(spec)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(create, i) for i in range(n)]
        for future in futures:
            try:
                handles.append(future.result())
            except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
                failures.append(f"{type(exc).__name__}: {exc}"[:300])
    create_s = time.perf_counter() - started
    time.sleep(3)  # let start-up allocations settle
    after = mem_used_mb()
    ids = container_ids(backend.client, settings.deployment)
    cgroups_mb = sum(container_memory_mb(i) for i in ids)
    shims_mb = shim_pss_mb(ids)

    def alive(handle: SandboxHandle) -> bool:
        try:
            return (
                backend.exec(handle, "true", timeout_s=10, output_budget_bytes=1024).exit_code == 0
            )
        except Exception:  # noqa: BLE001 - a sandbox that does not answer is not alive
            return False

    with ThreadPoolExecutor(max_workers=8) as pool:
        answering = sum(pool.map(alive, handles))
        started = time.perf_counter()
        list(pool.map(backend.destroy, handles))
        destroy_s = time.perf_counter() - started
    left = len(backend.list_owned())
    collect_expired(backend, everything=True)
    used = after - before
    return {
        "requested": n,
        "created": len(handles),
        "answering": answering,
        "failures": Counter(failures).most_common(5),
        "create_s": round(create_s, 1),
        "destroy_s": round(destroy_s, 1),
        "host_used_mb_total": round(used, 1),
        "host_mb_per_sandbox": round(used / max(1, len(handles)), 2),
        "cgroups_mb_total": round(cgroups_mb, 1),
        "shims_pss_mb_total": round(shims_mb, 1),
        "accounted_mb_per_sandbox": round((cgroups_mb + shims_mb) / max(1, len(handles)), 2),
        "left_after_destroy": left,
        "fit": len(handles) == n and answering == n,
    }


# -- the burst phase ---------------------------------------------------------------------------


def environments_yaml(codebase: str, pool: int) -> str:
    """The bench environment: the requests codebase, no tool budget, a warm pool of ``pool``
    sandboxes (``pool_size``); the default grace after grading (0: the grade hands the
    sandbox back)."""
    lines = [
        "environments:",
        f"  - name: {ENVIRONMENT}",
        f"    codebase: {codebase}",
        "    tools: [shell, read_file]",
        "    grader: {name: file_f1}",
        "    idle_timeout_s: 120",
        f"    pool_size: {pool}",
    ]
    return "\n".join(lines) + "\n"


def group_seated_ms(per_rollout: list[dict[str, Any]]) -> list[float]:
    """Per group (the rollouts of one item), when its last rollout's first call answered,
    in ms since the burst began: a GRPO group is of use to the trainer only once all of
    it runs. A group with a rollout that never answered is left out."""
    done: dict[int, list[float | None]] = {}
    for row in per_rollout:
        first = row.get("first_call_ms")
        at = None if first is None else row["launched_s"] * 1000 + first
        done.setdefault(row["item"], []).append(at)
    return [max(v for v in ats if v is not None) for ats in done.values() if None not in ats]


def load_items() -> list[dict[str, Any]]:
    rows = [
        json.loads(line)
        for line in (planning_example_dir() / "dataset.jsonl").read_text().splitlines()
        if line.strip()
    ]
    return [{**row, "environment": ENVIRONMENT} for row in rows]


def wait_for_pool(client: docker.DockerClient, pool: int) -> dict[str, Any]:
    """Wait until the pool has warmed (pool sandboxes running), or it stops growing."""
    if pool == 0:
        return {"size": 0, "warm": 0, "waited_s": 0.0}
    started = time.monotonic()
    best, best_at = 0, started
    while True:
        count = running_sandboxes(client, DEPLOYMENT)
        if count > best:
            best, best_at = count, time.monotonic()
        if count >= pool:
            break
        # Nothing appeared in 60 s, or no growth for 30 s: the pool is not (fully) wired.
        if (best == 0 and time.monotonic() - started > 60) or time.monotonic() - best_at > 30:
            break
        time.sleep(0.5)
    time.sleep(1)  # a sandbox listed as running may still be starting its agent
    return {
        "size": pool,
        "warm": running_sandboxes(client, DEPLOYMENT),
        "waited_s": round(time.monotonic() - started, 1),
    }


async def fetch_records(
    base: str, token: str, traces: list[str]
) -> tuple[dict[str, dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    views: dict[str, dict[str, Any]] = {}
    steps: dict[str, list[dict[str, Any]]] = {}
    limit = asyncio.Semaphore(16)
    async with httpx.AsyncClient(
        base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=60
    ) as http:

        async def one(trace: str) -> None:
            async with limit:
                view = await http.get(f"/v1/rollouts/{trace}")
                if view.status_code == 200:
                    views[trace] = view.json()
                trajectory = await http.get(f"/v1/rollouts/{trace}/trajectory")
                if trajectory.status_code == 200:
                    steps[trace] = trajectory.json()["steps"]

        await asyncio.gather(*(one(t) for t in traces))
    return views, steps


async def burst_phase(
    base: str,
    token: str,
    n: int,
    window_s: float,
    seed: int,
    counters: Counters,
    client: docker.DockerClient,
    profile_dir: Path | None,
) -> dict[str, Any]:
    # Several clients, each for a few rollouts (a client's pool was the bottleneck with
    # httpx; kept with aiohttp, which costs a fifth of httpx's CPU per request here: the
    # load generator shares the stack's two cores, bench/README.md).
    shards = max(1, -(-n // ROLLOUTS_PER_CLIENT))
    per_client = 2 * ROLLOUTS_PER_CLIENT + 4
    async with AsyncExitStack() as stack:
        https = [
            await stack.enter_async_context(
                aiohttp.ClientSession(
                    base_url=base,
                    headers={"Authorization": f"Bearer {token}"},
                    timeout=aiohttp.ClientTimeout(total=180),
                    connector=aiohttp.TCPConnector(limit=per_client),
                )
            )
            for _ in range(shards)
        ]
        burst = Burst(https, load_items(), seed, counters)
        background = await asyncio.to_thread(background_load, 3.0)
        with profiled(profile_dir is not None, profile_dir or Path()) as profiles:
            cpu = CpuMeter(client)
            cpu.start()
            baseline_mb = mem_used_mb()
            wall = await burst.run(n, window_s)
            cpu_s = cpu.stop()
    views, steps = await fetch_records(base, token, [r.trace for r in burst.rollouts])
    return {
        "burst": burst,
        "wall_s": wall,
        "baseline_mb": baseline_mb,
        "views": views,
        "steps": steps,
        "cpu_s": cpu_s,
        "background_busy_cores": background,
        "profiles": {role: profile_summary(path) for role, path in profiles.items()},
    }


@contextmanager
def counting_final_sweep(found: dict[str, int]) -> Iterator[None]:
    """local_stack destroys whatever its deployment still has once the stack has exited:
    count those first (what the stack's own shutdown left) by wrapping that sweep."""
    original = collect_expired

    def sweep(backend: SandboxBackend, *, everything: bool = False, **kw: Any) -> GcReport:
        found["left_by_stack_shutdown"] = len(backend.list_owned())
        return original(backend, everything=everything, **kw)

    local.__dict__["collect_expired"] = sweep
    try:
        yield
    finally:
        local.__dict__["collect_expired"] = original


def rollout_sandboxes(client: docker.DockerClient, deployment: str) -> int:
    """Running sandboxes of the deployment that a rollout holds: not in a pool (Redis's
    pool members; a recycled one keeps its first rollout's labels)."""
    found = client.api.containers(filters={"label": labels.deployment_filter(deployment)})
    store = redis.Redis.from_url(Settings().redis_url, decode_responses=True)
    try:
        pooled = set(store.smembers(Keys.of(deployment).pool_members))
    finally:
        store.close()
    return sum(
        1
        for c in found
        if (c.get("Labels") or {}).get(labels.ROLLOUT) != POOL_LABEL
        and (c.get("Labels") or {}).get(labels.SANDBOX) not in pooled
    )


_NO_LEVELS = {"ready": "?", "recycling": "?", "awaiting": "?"}


def _recycling_cell(b: dict[str, Any]) -> str:
    counts = b.get("recycling")
    if counts is None:
        return "?"
    shown = [f"{result} {count}" for result, count in sorted(counts.items()) if count]
    return ", ".join(shown) or "none"


def _waits_cell(b: dict[str, Any]) -> str:
    waits = b.get("recycle_waits")
    if waits is None:
        return "?"
    shown = [
        f"{result} {w['count']} ({w['mean_s']:g} s)"
        for result, w in sorted(waits.items())
        if w["count"]
    ]
    return ", ".join(shown) or "none"


def pool_levels(settings: Settings, codebase: str) -> dict[str, int]:
    """The bench pool now: its ready sandboxes, those being reset for it (recycling), and
    the new rollouts waiting for one of those."""
    keys = Keys.of(settings.deployment)
    name = pool_name(ENVIRONMENT, codebase)
    store = redis.Redis.from_url(settings.redis_url)
    try:
        pipe = store.pipeline(transaction=False)
        pipe.llen(keys.pool(name, "ready"))
        pipe.zcount(keys.pool(name, "recycling"), time.time(), "+inf")
        pipe.get(keys.pool(name, "awaiting"))
        ready, recycling, awaiting = pipe.execute()
    finally:
        store.close()
    return {"ready": int(ready), "recycling": int(recycling), "awaiting": int(awaiting or 0)}


def recycled_so_far(settings: Settings) -> dict[str, float]:
    """The worker's orchestrator_sandboxes_recycled_total by result (its /metrics;
    queue/handlers.RecycleResult)."""
    counts: dict[str, float] = {}
    try:
        text = httpx.get(f"http://127.0.0.1:{settings.worker_metrics_port}/metrics").text
    except httpx.HTTPError:
        return counts
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "orchestrator_sandboxes_recycled_total":
                counts[sample.labels["result"]] = sample.value
    return counts


def recycle_waits_so_far(base: str, token: str) -> dict[str, list[float]]:
    """The API's orchestrator_pool_recycle_wait_seconds by result: [count, sum of s]."""
    waits: dict[str, list[float]] = {}
    try:
        text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {token}"}).text
    except httpx.HTTPError:
        return waits
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removeprefix("orchestrator_pool_recycle_wait_seconds")
            if name in ("_count", "_sum"):
                got = waits.setdefault(sample.labels["result"], [0.0, 0.0])
                got[name == "_sum"] += sample.value
    return waits


def waits_between(
    before: dict[str, list[float]], after: dict[str, list[float]]
) -> dict[str, dict[str, float]]:
    """The waits for a reset between two reads of :func:`recycle_waits_so_far`: their
    count and mean, by result."""
    waits = {}
    for result, (count, total) in after.items():
        count_before, total_before = before.get(result, [0.0, 0.0])
        n = int(count - count_before)
        waits[result] = {"count": n, "mean_s": round((total - total_before) / max(1, n), 2)}
    return waits


def wait_for_reaper(client: docker.DockerClient, timeout_s: float) -> dict[str, Any]:
    """After grading, the reaper closes rollouts past their grace: wait until no rollout
    holds a sandbox (the warm pools, demand-sized or not, stay)."""
    started = time.monotonic()
    count = rollout_sandboxes(client, DEPLOYMENT)
    while count > 0 and time.monotonic() - started < timeout_s:
        time.sleep(1)
        count = rollout_sandboxes(client, DEPLOYMENT)
    return {
        "running": count,
        "pooled": running_sandboxes(client, DEPLOYMENT) - count,
        "waited_s": round(time.monotonic() - started, 1),
    }


# -- analysis ----------------------------------------------------------------------------------


def analyse(raw: dict[str, Any], n: int, pool: dict[str, Any]) -> dict[str, Any]:
    burst: Burst = raw["burst"]
    views: dict[str, dict[str, Any]] = raw["views"]
    steps: dict[str, list[dict[str, Any]]] = raw["steps"]
    step_of = {
        (trace, s["call_id"]): s for trace, trace_steps in steps.items() for s in trace_steps
    }
    # 200s: ok or agent_error, from what the orchestrator recorded for that call.
    for attempt in burst.attempts:
        if attempt.kind == "tool" and attempt.outcome == OK:
            step = step_of.get((attempt.trace, attempt.call_id))
            if step is None:
                attempt.outcome = UNRECORDED
            elif step["outcome"] != "ok":
                attempt.outcome = AGENT_ERROR
    outcomes = {
        kind: dict(Counter(a.outcome for a in burst.attempts if a.kind == kind))
        for kind in ("tool", "grade")
    }
    errors = sum(1 for a in burst.attempts if a.outcome not in (OK, GRADE_OK))
    retries = sum(1 for a in burst.attempts if a.attempt > 0)
    rollouts = burst.rollouts
    wrong_scores = sum(1 for r in rollouts if r.graded and r.score != 1.0)

    # Acquisition: the record's created -> sandbox ready, split by pool hit.
    hit_ms: list[float] = []
    cold_ms: list[float] = []
    for view in views.values():
        ready = (view.get("timings") or {}).get("sandbox_ready_ms")
        if ready is None:
            continue
        pool_hit = view.get("pool_hit", (view.get("timings") or {}).get("pool_hit"))
        (hit_ms if pool_hit else cold_ms).append(float(ready))
    # The client's view: the first call (retries included) minus its exec in the worker.
    client_ms: list[float] = []
    first_call_ms: list[float] = []
    per_rollout: list[dict[str, Any]] = []
    for r in rollouts:
        first = next((c for c in r.calls if c.step == 0 and c.succeeded), None)
        view = views.get(r.trace) or {}
        timings = view.get("timings") or {}
        row: dict[str, Any] = {
            "trace": r.trace,
            "item": r.item,
            "launched_s": round(r.launched_s, 3),
            "pool_hit": view.get("pool_hit", timings.get("pool_hit")),
            "sandbox_ready_ms": timings.get("sandbox_ready_ms"),
            "discarded": r.discarded,
            "score": r.score,
        }
        per_rollout.append(row)
        if first is None:
            continue
        first_call_ms.append(first.total_ms)
        step = step_of.get((r.trace, first.call_id)) or {}
        client_ms.append(max(0.0, first.total_ms - float(step.get("exec_ms") or 0.0)))
        row |= {
            "first_call_ms": round(first.total_ms, 1),
            "first_call_attempts": first.attempts,
            "first_call_server_ms": step.get("duration_ms"),
            "first_call_exec_ms": step.get("exec_ms"),
        }

    calls: list[list[Any]] = []
    for r in rollouts:
        for c in r.calls:
            step = step_of.get((r.trace, c.call_id)) or {}
            calls.append(
                [
                    round(c.sent_s, 3),
                    c.label,
                    c.step,
                    round(c.total_ms, 1),
                    c.attempts,
                    c.succeeded,
                    step.get("duration_ms"),
                    step.get("queue_ms"),
                    step.get("exec_ms"),
                ]
            )
    later = [c for r in rollouts for c in r.calls if c.step > 0 and c.label != "grade"]
    tool_ms = [c.total_ms for c in later if c.succeeded]
    by_label: dict[str, list[float]] = {}
    for c in later:
        if c.succeeded:
            by_label.setdefault(c.label + (" (parallel pair)" if c.parallel else ""), []).append(
                c.total_ms
            )
    grade_ms = [c.total_ms for r in rollouts for c in r.calls if c.label == "grade" and c.succeeded]
    server = [s for trace_steps in steps.values() for s in trace_steps if s["seq"] > 1]
    samples: list[Sample] = raw["samples"]
    over = raw["marks"].get("burst over", float("inf"))
    in_burst = [s for s in samples if 0 < s.t <= over]
    peak_mb = max((s.mem_mb for s in in_burst), default=float("nan"))
    launches = [r.launched_s for r in rollouts]
    first_sent = [
        min((a.sent_s for a in burst.attempts if a.trace == r.trace), default=0.0) for r in rollouts
    ]
    return {
        "rollouts": n,
        "pool": pool,
        "wall_s": round(raw["wall_s"], 2),
        "launch_spread_s": round(max(first_sent) - min(first_sent), 3) if first_sent else None,
        "launch_window_s": round(max(launches) - min(launches), 3) if launches else None,
        "outcomes": outcomes,
        "errors": errors,
        "retries": retries,
        "discarded_rollouts": sum(1 for r in rollouts if r.discarded),
        "graded_rollouts": sum(1 for r in rollouts if r.graded),
        "wrong_scores": wrong_scores,
        "acquisition_ms": {
            "pool hit (created → ready)": summary(hit_ms),
            "cold (created → ready)": summary(cold_ms),
            "all (created → ready)": summary(hit_ms + cold_ms),
            "client: first call − its exec": summary(client_ms),
            "client: first call": summary(first_call_ms),
            "group: its last rollout's first call, from launch": summary(
                group_seated_ms(per_rollout)
            ),
        },
        "pool_hits": len(hit_ms),
        "pool_at_launch": raw.get("pool_at_launch"),
        "recycling": raw.get("recycling"),
        "recycle_waits": raw.get("recycle_waits"),
        "pool_hit_field": any(
            "pool_hit" in v or "pool_hit" in (v.get("timings") or {}) for v in views.values()
        ),
        "tool_call_ms": {"all calls after the first": summary(tool_ms)}
        | {label: summary(v) for label, v in sorted(by_label.items())},
        "grade_ms": summary(grade_ms),
        "server_ms": {
            "total (API receipt → reply)": summary([float(s["duration_ms"]) for s in server]),
            "queue (waiting for a worker)": summary(
                [float(s["queue_ms"]) for s in server if s.get("queue_ms") is not None]
            ),
            "exec (in the worker)": summary(
                [float(s["exec_ms"]) for s in server if s.get("exec_ms") is not None]
            ),
        },
        "memory_mb": {
            "baseline": round(raw["baseline_mb"], 1),
            "peak": round(peak_mb, 1),
            "peak_over_baseline": round(peak_mb - raw["baseline_mb"], 1),
        },
        "peak_sandboxes": max((s.sandboxes or 0 for s in in_burst), default=0),
        "peak_inflight": max((s.inflight for s in in_burst), default=0),
        "client_loop_lag_ms": summary([s.client_loop_lag_ms for s in in_burst]),
        "marks": raw["marks"],
        "cpu_s": raw["cpu_s"],
        "background_busy_cores": raw["background_busy_cores"],
        "profiles": raw["profiles"],
        "series": {
            "tool_ms": tool_ms,
            "acquire_hit_ms": hit_ms,
            "acquire_cold_ms": cold_ms,
            "acquire_client_ms": client_ms,
        },
        "timeline": [asdict(s) for s in samples],
        "per_rollout": per_rollout,
        "calls": {
            "columns": [
                "sent_s",
                "label",
                "step",
                "client_ms",
                "attempts",
                "succeeded",
                "server_ms",
                "queue_ms",
                "exec_ms",
            ],
            "rows": calls,
        },
    }


# -- rendering ---------------------------------------------------------------------------------


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


def _row(name: str, s: dict[str, float]) -> str:
    return f"| {name} | {s['n']} | {s['p50']:.1f} | {s['p90']:.1f} | {s['p99']:.1f} |"


def render(report: dict[str, Any]) -> str:
    bursts: list[dict[str, Any]] = report["bursts"]
    lines: list[str] = []
    for number, b in enumerate(bursts, 1):
        lines += render_burst(b, number if len(bursts) > 1 else 0)
    if len(bursts) > 1:
        lines += ["", *side_by_side(bursts)]
    idle = report.get("idle")
    lines += ["", "| stack | value |", "|---|---|"]
    if "after_reaper" in report:  # else no stack ran (--bursts 0)
        reaped, left = report["after_reaper"], report["left"]
        lines += [
            f"| rollouts' sandboxes running once the reaper ran / pools' ready ones | "
            f"{reaped['running']} / {reaped.get('pooled', '?')} after {reaped['waited_s']} s |",
            f"| the stack's teardown (Ctrl-C on `orchestrator up`: rollouts ended, sandboxes "
            f"destroyed) | {left.get('teardown_s', '?')} s |",
            f"| sandboxes the stack's own teardown left (local_stack then sweeps them) | "
            f"{left.get('left_by_stack_shutdown', '?')} |",
            f"| containers / volumes left after teardown | {left['containers']} / "
            f"{left['volumes']} |",
        ]
    if idle:
        lines.append(
            f"| idle phase: sandboxes created / answering | {idle['created']} / "
            f"{idle['answering']} of {idle['requested']}, created in {idle['create_s']} s |"
        )
        lines.append(
            f"| idle phase: host memory | {idle['host_used_mb_total']} MiB MemAvailable "
            f"delta ({idle['host_mb_per_sandbox']} MiB each); cgroups {idle['cgroups_mb_total']}"
            f" MiB + shims {idle['shims_pss_mb_total']} MiB = "
            f"{idle['accounted_mb_per_sandbox']} MiB each |"
        )
    lines += ["", "| target | goal | measured | met |", "|---|---|---|---|"]
    for name, goal, measured, met in targets(report):
        lines.append(f"| {name} | {goal} | {measured} | {'yes' if met else 'no'} |")
    return "\n".join(lines) + "\n"


def side_by_side(bursts: list[dict[str, Any]]) -> list[str]:
    """The bursts' headline figures in one table, one column each."""
    head = " | ".join(f"burst {n}" for n in range(1, len(bursts) + 1))
    lines = ["## The bursts side by side", "", f"| | {head} |", "|---" * (len(bursts) + 1) + "|"]

    def row(name: str, value: Any) -> None:
        lines.append(f"| {name} | " + " | ".join(str(value(b)) for b in bursts) + " |")

    for q in ("p50", "p99"):
        row(
            f"acquisition {q}, created → ready (ms)",
            lambda b, q=q: round(b["acquisition_ms"]["all (created → ready)"][q], 1),
        )
    row("pool hits", lambda b: b["pool_hits"])
    row(
        "pool at launch: ready / being reset",
        lambda b: "{ready} / {recycling}".format(**(b.get("pool_at_launch") or _NO_LEVELS)),
    )
    row("sandboxes sent for recycling during the burst, by result", _recycling_cell)
    row("waits for a sandbox being reset: count (mean s), by result", _waits_cell)
    for q in ("p50", "p99"):
        row(
            f"later tool calls {q} (ms)",
            lambda b, q=q: round(b["tool_call_ms"]["all calls after the first"][q], 1),
        )
    row("errors / discarded rollouts", lambda b: f"{b['errors']} / {b['discarded_rollouts']}")
    row("peak sandboxes running", lambda b: b["peak_sandboxes"])
    row("peak host memory (MiB)", lambda b: b["memory_mb"]["peak"])
    row("wall (s)", lambda b: b["wall_s"])
    return lines


def render_burst(b: dict[str, Any], number: int) -> list[str]:
    """One burst's tables; ``number`` 0 when there is only one."""
    pool = b["pool"]
    which = f" {number}" if number else ""
    lines = [
        f"## Burst{which}: {b['rollouts']} Agent RFT rollouts launched within "
        f"{b['launch_spread_s']} s, 6 tool calls each + grade; pool {pool['size']} "
        f"({pool['warm']} warm at launch)",
        "",
        "| latency, ms | n | p50 | p90 | p99 |",
        "|---|---|---|---|---|",
    ]
    for name, s in b["acquisition_ms"].items():
        lines.append(_row(f"acquisition, {name}", s))
    for name, s in b["tool_call_ms"].items():
        lines.append(_row(f"tool call, {name}", s))
    lines.append(_row("grade", b["grade_ms"]))
    for name, s in b["server_ms"].items():
        lines.append(_row(f"server side (calls after the first), {name}", s))
    lines += [
        "",
        "Created → ready is the rollout record's: it is written once the pool sandbox is "
        "claimed and probed, or once admission gave a host slot for a cold one; the client's "
        "view includes those waits (and the first call's own queueing).",
        "",
        "| outcome | tool responses | grade responses |",
        "|---|---|---|",
    ]
    for outcome in [*OUTCOMES, GRADE_OK]:
        tool = b["outcomes"]["tool"].get(outcome, 0)
        grade = b["outcomes"]["grade"].get(outcome, 0)
        if outcome in (OK, GRADE_OK) or tool or grade:
            lines.append(f"| {outcome} | {tool} | {grade} |")
    cpu = b["cpu_s"]
    lines += [
        "",
        f"Retries: {b['retries']}; rollouts discarded: {b['discarded_rollouts']}; graded: "
        f"{b['graded_rollouts']} (wrong scores: {b['wrong_scores']}); burst wall time "
        f"{b['wall_s']} s.",
        "",
        "| host | value |",
        "|---|---|",
        f"| peak host memory (MemTotal − MemAvailable) | {b['memory_mb']['peak']} MiB "
        f"(+{b['memory_mb']['peak_over_baseline']} MiB over the pre-burst baseline) |",
        f"| peak sandboxes running / calls in flight | {b['peak_sandboxes']} / "
        f"{b['peak_inflight']} |",
        f"| CPU seconds during the burst ({cpu['wall']} s wall, {_cpus()} cores) | "
        + ", ".join(f"{k} {v}" for k, v in cpu.items() if k != "wall")
        + " |",
        f"| load generator's event-loop lag (worst per 0.2 s: p50 / p99 / max) | "
        f"{b['client_loop_lag_ms']['p50']} / {b['client_loop_lag_ms']['p99']} / "
        f"{max([s['client_loop_lag_ms'] for s in b['timeline']], default=0)} ms |",
        f"| host busy before the burst (stack idle: other tenants) | "
        f"{b['background_busy_cores']} cores |",
    ]
    return lines


def targets(report: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """Issue 13's: the first burst on a fresh stack, and any burst after it."""
    rows = []
    bursts: list[dict[str, Any]] = report["bursts"]
    for number, b in enumerate(bursts, 1):
        later = number > 1
        name = f"burst {number}" if len(bursts) > 1 else "burst"
        acq_goal = ACQUIRE_P99_MS[later]
        tool_goal = TOOL_P99_MS[later]
        acq = b["acquisition_ms"]["all (created → ready)"]["p99"]
        client_acq = b["acquisition_ms"]["client: first call − its exec"]["p99"]
        tool = b["tool_call_ms"]["all calls after the first"]["p99"]
        rows += [
            (
                f"{name}: errors",
                "0",
                f"{b['errors']} (+{b['wrong_scores']} wrong scores)",
                b["errors"] == 0 and b["wrong_scores"] == 0,
            ),
            (
                f"{name}: acquisition p99, pool of {b['pool']['size']}",
                f"≤ {acq_goal / 1000:g} s",
                f"{acq / 1000:.2f} s (client view {client_acq / 1000:.2f} s)",
                acq <= acq_goal,
            ),
            (
                f"{name}: later tool call p99",
                f"≤ {tool_goal:g} ms",
                f"{tool:.1f} ms",
                tool <= tool_goal,
            ),
        ]
    idle = report.get("idle")
    if idle:
        per_mb = max(idle["host_mb_per_sandbox"], idle["accounted_mb_per_sandbox"])
        rows.append(
            (
                "concurrent idle sandboxes",
                f"≥ {IDLE_SANDBOXES} fit in {IDLE_MEMORY_MB // 1024} GiB",
                f"{idle['answering']} of {idle['requested']} started and answer, "
                f"{per_mb:.2f} MiB each",
                bool(idle["fit"])
                and idle["requested"] >= IDLE_SANDBOXES
                and per_mb * IDLE_SANDBOXES <= IDLE_MEMORY_MB,
            )
        )
    if "left" in report:
        left = report["left"]["containers"]
        rows.append(("containers left after teardown", "0", str(left), left == 0))
    return rows


def plot(report: dict[str, Any]) -> list[Path]:
    """Each burst's latency CDFs and timeline: burst-*.png, then burst2-*.png, ..."""
    if not plots.available():
        print("matplotlib is not installed (pip install -e '.[bench]'): no plots")
        return []
    paths: list[Path] = []
    for number, b in enumerate(report["bursts"], 1):
        paths += plot_burst(b, "burst" if number == 1 else f"burst{number}", number > 1)
    return paths


def plot_burst(b: dict[str, Any], name: str, later: bool) -> list[Path]:
    series = b["series"]
    title = f"{b['rollouts']} rollouts, pool {b['pool']['size']}"
    tool_goal, acq_goal = TOOL_P99_MS[later], ACQUIRE_P99_MS[later]
    cdf = plots.latency_cdfs(
        RESULTS / f"{name}-latency-cdf.png",
        [
            plots.Panel(
                "Tool call latency (calls after the first)",
                "ms (client round trip, retries included)",
                series={"all": series["tool_ms"]},
                targets={f"{tool_goal:g} ms target": tool_goal},
                log_x=True,
            ),
            plots.Panel(
                "Sandbox acquisition",
                "ms",
                series={
                    "pool hit (created → ready)": series["acquire_hit_ms"],
                    "cold (created → ready)": series["acquire_cold_ms"],
                    "client: first call − its exec": series["acquire_client_ms"],
                },
                targets={f"{acq_goal / 1000:g} s target": acq_goal},
                log_x=True,
            ),
        ],
        suptitle=f"Burst: {title}",
    )
    timeline = b["timeline"]
    rows = b["calls"]["rows"]
    t = [s["t"] for s in timeline]
    counted = [s for s in timeline if s["sandboxes"] is not None]
    line = plots.timeline(
        RESULTS / f"{name}-timeline.png",
        [
            plots.Track(
                "sandboxes / rollouts",
                {
                    "sandboxes running (docker)": (
                        [s["t"] for s in counted],
                        [s["sandboxes"] for s in counted],
                    ),
                    "rollouts active (client)": (t, [s["active_rollouts"] for s in timeline]),
                },
                hlines={"pool size": b["pool"]["size"]} if b["pool"]["size"] else {},
            ),
            plots.Track(
                "calls in flight", {"in flight (client)": (t, [s["inflight"] for s in timeline])}
            ),
            plots.Track(
                "call latency, ms (log)",
                {
                    "tool call, client (first calls)": (
                        [c[0] for c in rows if c[2] == 0 and c[1] != "grade"],
                        [c[3] for c in rows if c[2] == 0 and c[1] != "grade"],
                    ),
                    "tool call, client (later calls)": (
                        [c[0] for c in rows if c[2] > 0 and c[1] != "grade"],
                        [c[3] for c in rows if c[2] > 0 and c[1] != "grade"],
                    ),
                    "tool call, server queue wait": (
                        [c[0] for c in rows if c[7] is not None],
                        [max(0.1, c[7]) for c in rows if c[7] is not None],
                    ),
                },
                points=True,
                log_y=True,
            ),
            plots.Track(
                "host memory used, MiB",
                {"MemTotal − MemAvailable": (t, [s["mem_mb"] for s in timeline])},
            ),
        ],
        xlabel="seconds since the burst started",
        marks=b["marks"],
        suptitle=f"Burst timeline: {title}",
    )
    return [cdf, line]


# -- main --------------------------------------------------------------------------------------


def stack_phase(
    args: argparse.Namespace,
    settings: Settings,
    token: str,
    codebase: str,
    client: docker.DockerClient,
    state: Path,
    report: dict[str, Any],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start the stack, run ``args.bursts`` bursts on it, stop it; (the pool at launch, each
    burst's raw record). Fills ``report``'s after_reaper and left."""
    raws: list[dict[str, Any]] = []
    try:
        swept: dict[str, int] = {}
        with (
            counting_final_sweep(swept),
            local_stack(settings, log=state / "stack.log") as base,
        ):
            pool = wait_for_pool(client, args.pool)
            print(f"pool: {pool}", flush=True)
            for number in range(1, args.bursts + 1):
                counters = Counters()
                at_launch = pool_levels(settings, codebase)
                recycled_before = recycled_so_far(settings)
                waits_before = recycle_waits_so_far(base, token)
                with Sampler(counters, client, DEPLOYMENT) as sampler:
                    raw = asyncio.run(
                        burst_phase(
                            base,
                            token,
                            args.rollouts,
                            args.launch_window,
                            args.seed + number - 1,
                            counters,
                            client,
                            state if args.profile else None,
                        )
                    )
                    print(f"burst {number} over in {raw['wall_s']:.1f} s", flush=True)
                    raw["pool_at_launch"] = at_launch
                    recycled_after = recycled_so_far(settings)
                    raw["recycling"] = {
                        result: int(recycled_after[result] - recycled_before.get(result, 0.0))
                        for result in recycled_after
                    }
                    waits_after = recycle_waits_so_far(base, token)
                    raw["recycle_waits"] = waits_between(waits_before, waits_after)
                    if number == args.bursts:
                        print("waiting for the reaper", flush=True)
                        report["after_reaper"] = wait_for_reaper(client, timeout_s=180)
                        counters.mark("reaped")
                raw["samples"], raw["marks"] = sampler.samples, counters.marks
                raws.append(raw)
            stopping = time.monotonic()
        # The stack has stopped: `orchestrator up` ended its rollouts and destroyed its
        # sandboxes; local_stack's exit then destroys anything it left.
        containers, volumes = owned_resources(client, DEPLOYMENT)
        teardown_s = round(time.monotonic() - stopping, 1)
        report["left"] = {
            "containers": containers,
            "volumes": volumes,
            "teardown_s": teardown_s,
            **swept,
        }
    finally:
        forget_deployment(settings.redis_url, DEPLOYMENT)
    return pool, raws


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=256)
    parser.add_argument("--pool", type=int, default=64, help="warm sandboxes (0: none)")
    parser.add_argument(
        "--bursts", type=int, default=1, help="bursts in a row, each as soon as the last is over"
    )
    parser.add_argument(
        "--idle-sandboxes",
        type=int,
        default=IDLE_SANDBOXES,
        help="idle-capacity phase size (0: skip)",
    )
    parser.add_argument("--launch-window", type=float, default=1.0, help="seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="py-spy record the API and the worker during the burst (costs CPU: its own "
        "share is in the CPU row; collapsed stacks are left in the run's state directory)",
    )
    parser.add_argument(
        "--from-json",
        type=Path,
        help="render the tables and plots of a saved bench/results/burst.json; run nothing",
    )
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        saved.setdefault("bursts", [saved.get("burst")])  # a report of one burst, from before
        raw_path = args.from_json.with_name(RAW_FILE)
        if raw_path.exists():
            bulk = json.loads(raw_path.read_text())
            for burst, raw in zip(
                saved["bursts"], bulk if isinstance(bulk, list) else [bulk], strict=True
            ):
                burst |= raw
        markdown = render(saved)
        print(markdown)
        (RESULTS / "burst.md").write_text(markdown)
        for path in plot(saved):
            print(f"wrote {path}")
        return

    token = secrets.token_urlsafe(16)
    state = Path(tempfile.mkdtemp(prefix="orch-bench-burst-"))
    base_settings = Settings(
        deployment=DEPLOYMENT,
        state_dir=state,
        host_id=f"bench-{uuid.uuid4().hex[:6]}",
        log_level="WARNING",
    )
    codebase = "requests"
    image = ensure_requests_codebase(base_settings, codebase)
    environments = state / "environments.yaml"
    environments.write_text(environments_yaml(codebase, args.pool))
    settings = base_settings.model_copy(
        update={
            "api_port": free_port(),
            "api_tokens": token,
            "environments_file": environments,
            "default_environment": ENVIRONMENT,
            "host_max_sandboxes": max(512, args.rollouts + args.pool + 16),
        }
    )
    client = docker.from_env()
    print(f"deployment {DEPLOYMENT}; stack log: {state / 'stack.log'}", flush=True)
    report: dict[str, Any] = {
        "config": vars(args) | {"codebase_image": image, "deployment": DEPLOYMENT}
    }
    pool: dict[str, Any] = {"size": 0, "warm": 0, "waited_s": 0.0}
    raws: list[dict[str, Any]] = []
    if args.bursts:  # else the idle phase alone: no stack
        pool, raws = stack_phase(args, settings, token, codebase, client, state, report)
    report["bursts"] = [analyse(raw, args.rollouts, pool) for raw in raws]
    if args.idle_sandboxes:
        idle_settings = settings.model_copy(update={"deployment": IDLE_DEPLOYMENT})
        report["idle"] = idle_phase(idle_settings, image, args.idle_sandboxes)
    report["targets"] = [
        {"target": n, "goal": g, "measured": m, "met": met} for n, g, m, met in targets(report)
    ]
    markdown = render(report)
    print(markdown)
    if not args.bursts:  # the idle phase alone: a report of its own, burst.json stays
        print(f"wrote {write_report('burst-idle', report, markdown)}")
        return
    for path in plot(report):
        print(f"wrote {path}")
    # The samples behind the plots (timeline, every call, every rollout) go to a compact file
    # of their own; burst.json keeps the summaries.
    bulky = [{key: b.pop(key) for key in RAW_KEYS} for b in report["bursts"]]
    (RESULTS / RAW_FILE).write_text(json.dumps(bulky, separators=(",", ":")) + "\n")
    print(f"wrote {write_report('burst', report, markdown)} and {RESULTS / RAW_FILE}")
    if args.profile:
        print(json.dumps([b["profiles"] for b in report["bursts"]], indent=1))


if __name__ == "__main__":
    main()


def _error_code(response: Reply | None) -> str | None:
    """The error body's code (``at_capacity``, ``infra_error``, ...): every 503 carries
    Retry-After, so the header alone does not tell capacity from a fault."""
    body = response.body if response is not None else None
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None
