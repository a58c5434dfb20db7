"""Where the control plane's time goes under load: py-spy profiles of the API and the
worker while N sessions call `true` back to back through the Agent RFT endpoint.

    python -m bench.profile [--sessions 32] [--seconds 20] [--rate 100]

Starts its own deployment (orchestrator.local.local_stack), warms N rollouts, then samples
the API process and the worker process for the same window (py-spy, non-blocking, so the
sampled processes are not paused; only the thread holding the GIL, so the samples are the
Python code running, not threads waiting in epoll or on a queue, which py-spy's own idle
detection counted as busy here: the kombu loop's epoll and the idle pool threads were a
third of the worker's samples; a system call made without the GIL is not in them).
Writes each profile's collapsed stacks (bench/results/profile-api.txt, profile-worker.txt:
flamegraph.pl or speedscope read them) and a table of the functions holding most samples,
inclusive and self (bench/results/profile.json and .md), with the window's calls/s and CPU
per call.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.common import (
    BENCH_CODEBASE,
    RESULTS,
    STACK_ENVIRONMENTS,
    ensure_bench_codebase,
    function_call,
    throwaway_stack_settings,
    write_report,
)
from orchestrator.images.base import build_base_image
from orchestrator.local import local_stack

TOP = 25
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _processes_of(deployment: str) -> dict[str, int]:
    """The API's and the worker's pids of ``deployment`` (from /proc: their environment
    names the deployment, their command line what they are)."""
    found: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if f"ORCH_DEPLOYMENT={deployment}".encode() not in environ:
            continue
        if b"orchestrator.observability.api_process" in cmdline:
            found["api"] = int(entry)
        elif b"celery" in cmdline and b" worker" in cmdline:
            found["worker"] = int(entry)
    return found


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _top(collapsed: Path) -> dict[str, list[tuple[str, float]]]:
    """The functions holding most samples: inclusive (on the stack) and self (on top)."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        total += count
        frames = [f for f in stack.split(";") if f]
        # py-spy names the thread first: "process 123:\"...\";thread (0x...)": not code.
        code = [f for f in frames if not f.startswith(("process ", "thread "))]
        for frame in set(code):
            inclusive[frame] += count
        if code:
            own[code[-1]] += count
    if total == 0:
        return {"inclusive": [], "self": []}
    share = 100.0 / total
    return {
        "inclusive": [(f, round(n * share, 1)) for f, n in inclusive.most_common(TOP)],
        "self": [(f, round(n * share, 1)) for f, n in own.most_common(TOP)],
    }


async def _load(
    base: str, token: str, sessions: int, seconds: float, started: asyncio.Event
) -> int:
    """N sessions calling `true` back to back for ``seconds``; returns the calls made."""
    limits = httpx.Limits(max_connections=sessions + 4, max_keepalive_connections=sessions + 4)
    async with httpx.AsyncClient(
        base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=120, limits=limits
    ) as http:
        traces = [f"trace_{uuid.uuid4().hex}" for _ in range(sessions)]
        seq = dict.fromkeys(traces, 0)

        async def call(trace: str) -> None:
            seq[trace] += 1
            body = function_call(
                trace, str(seq[trace]), "shell", {"command": "true"}, {"codebase": BENCH_CODEBASE}
            )
            response = await http.post("/agent-rft/tools", json=body)
            response.raise_for_status()

        gate = asyncio.Semaphore(8)

        async def start(trace: str) -> None:
            async with gate:
                await call(trace)

        await asyncio.gather(*(start(t) for t in traces))
        for _ in range(3):  # warm: every session's path has run
            await asyncio.gather(*(call(t) for t in traces))
        made = 0
        stop = time.monotonic() + seconds

        async def session(trace: str) -> None:
            nonlocal made
            while time.monotonic() < stop:
                await call(trace)
                made += 1

        started.set()
        await asyncio.gather(*(session(t) for t in traces))
        for trace in traces:
            await http.delete(f"/v1/rollouts/{trace}")
        return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    args = parser.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    stack = throwaway_stack_settings("bench-profile", STACK_ENVIRONMENTS)
    build_base_image(stack)
    ensure_bench_codebase(stack)
    RESULTS.mkdir(parents=True, exist_ok=True)
    outputs = {role: RESULTS / f"profile-{role}.txt" for role in ("api", "worker")}
    with local_stack(stack, log=stack.state_dir / "stack.log", forget=True) as base:
        pids = _processes_of(stack.deployment)
        assert set(pids) == {"api", "worker"}, f"found {pids}"

        async def run() -> tuple[int, dict[str, float], float]:
            started = asyncio.Event()
            task = asyncio.create_task(
                _load(base, stack.api_tokens, args.sessions, args.seconds, started)
            )
            await started.wait()
            before = {role: _cpu_s(pid) for role, pid in pids.items()}
            window = time.monotonic()
            spies = [
                await asyncio.create_subprocess_exec(
                    *_spy_command(spy, pid, args, outputs[role]),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for role, pid in pids.items()
            ]
            made = await task
            elapsed = time.monotonic() - window
            cpu = {role: _cpu_s(pid) - before[role] for role, pid in pids.items()}
            for proc in spies:
                await asyncio.wait_for(proc.wait(), timeout=60)
            return made, cpu, elapsed

        made, cpu, elapsed = asyncio.run(run())
    report: dict[str, Any] = {
        "parameters": {"sessions": args.sessions, "seconds": args.seconds, "rate": args.rate},
        "calls": made,
        "calls_per_s": round(made / elapsed, 1),
        "cpu_ms_per_call": {role: round(s * 1000 / max(made, 1), 2) for role, s in cpu.items()},
        "top": {role: _top(path) for role, path in outputs.items()},
    }
    markdown = render(report)
    print(markdown)
    print(f"wrote {write_report('profile', report, markdown)}")
    shutil.rmtree(stack.state_dir, ignore_errors=True)


def _spy_command(spy: str, pid: int, args: argparse.Namespace, output: Path) -> list[str]:
    return [
        spy, "record", "--pid", str(pid), "--duration", str(int(args.seconds)),
        "--rate", str(args.rate), "--format", "raw", "--nonblocking", "--gil",
        "--output", str(output),
    ]  # fmt: skip


def render(report: dict[str, Any]) -> str:
    lines = [
        f"## Control-plane profile: {report['parameters']['sessions']} sessions calling `true`",
        "",
        f"{report['calls']} calls, {report['calls_per_s']} calls/s; CPU per call: "
        + ", ".join(f"{role} {ms} ms" for role, ms in report["cpu_ms_per_call"].items()),
        "",
    ]
    for role, top in report["top"].items():
        for kind in ("inclusive", "self"):
            lines += [
                f"### {role}: {kind} (% of samples)",
                "",
                "| % | function |",
                "|---|---|",
                *[f"| {share} | `{frame}` |" for frame, share in top[kind]],
                "",
            ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
