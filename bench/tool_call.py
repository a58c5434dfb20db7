"""End-to-end tool-call latency and throughput through the Agent RFT endpoint.

    python -m bench.tool_call [--calls 200] [--concurrency 1 16 64]

Starts its own deployment (API, one worker, beat) on loopback, opens N rollouts on a real
codebase (this Python's standard library), and has each rollout make calls back to back:
`true`, then a grep. The first call of each rollout (which creates its sandbox) is not
counted. The load generator runs on the same 2 cores as the stack: the figures include
that contention. Prints a table; writes bench/results/tool_call.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from typing import Any

import httpx

from bench.common import (
    BENCH_CODEBASE,
    ensure_bench_codebase,
    function_call,
    summary,
    throwaway_stack_settings,
    write_report,
)
from orchestrator.local import local_stack

COMMANDS = {"true": "true", "grep": "grep -rn 'def __init__' --include=*.py json email | wc -l"}
EXPECTED = {
    COMMANDS["true"]: lambda out: out == "(no output)",
    COMMANDS["grep"]: lambda out: out.strip().isdigit(),
}
# The default environment caps a rollout at 50 calls; the benchmark's rollouts make more.
ENVIRONMENTS = """\
environments:
  - name: bench
    tools: [shell, read_file]
    grader: {name: file_f1}
"""
TARGETS = {"true_p50_ms_at_16": 10.0, "calls_per_s": 400.0}
THINK_S = 0.1


async def one_rollout(
    http: httpx.AsyncClient, command: str, calls: int, latencies: list[float], think_s: float
) -> None:
    trace = f"trace_{uuid.uuid4().hex}"
    item = {"codebase": BENCH_CODEBASE}

    async def call(n: int) -> float:
        body = function_call(trace, str(n), "shell", {"command": command}, item)
        started = time.perf_counter()
        response = await http.post("/agent-rft/tools", json=body)
        elapsed = (time.perf_counter() - started) * 1000
        response.raise_for_status()
        output = response.json()["output"]
        # Only real runs count: an answer such as "budget spent" never reached a sandbox.
        if not EXPECTED[command](output):
            raise RuntimeError(f"unexpected output for {command!r}: {output[:200]!r}")
        return elapsed

    await call(0)  # creates the sandbox: not a steady-state call
    for n in range(1, calls + 1):
        latencies.append(await call(n))
        if think_s:
            await asyncio.sleep(think_s)
    await http.delete(f"/v1/rollouts/{trace}")


async def run_level(
    base: str, token: str, command: str, concurrency: int, calls: int, think_s: float = 0.0
) -> dict[str, Any]:
    limits = httpx.Limits(
        max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8
    )
    async with httpx.AsyncClient(
        base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=120, limits=limits
    ) as http:
        latencies: list[float] = []
        # Sandboxes first (not timed), then the measured phase starts for all at once.
        started = time.perf_counter()
        await asyncio.gather(
            *(one_rollout(http, command, calls, latencies, think_s) for _ in range(concurrency))
        )
        wall = time.perf_counter() - started
    # Wall time includes creating the sandboxes; throughput is over the measured calls,
    # so it is a lower bound.
    return {
        **summary(latencies),
        "calls_per_s": round(len(latencies) / wall, 1),
        "wall_s": round(wall, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="measured calls per rollout")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    args = parser.parse_args()

    settings = throwaway_stack_settings("bench-tc", ENVIRONMENTS)
    state = settings.state_dir
    token = settings.api_tokens
    ensure_bench_codebase(settings)
    results: dict[str, dict[str, Any]] = {}
    with local_stack(settings, log=state / "stack.log", forget=True) as base:
        for label, command in COMMANDS.items():
            for concurrency in args.concurrency:
                calls = args.calls if label == "true" else max(10, args.calls // 5)
                key = f"{label}@{concurrency}"
                results[key] = asyncio.run(run_level(base, token, command, concurrency, calls))
                print(key, results[key], flush=True)
        # Back to back, the rollouts above measure saturation. A model thinks between calls:
        # with a pause, latency is what one call costs at that many concurrent rollouts.
        key = f"true@16 think {THINK_S * 1000:.0f}ms"
        results[key] = asyncio.run(run_level(base, token, "true", 16, 100, THINK_S))
        print(key, results[key], flush=True)
    markdown = render(results)
    print(markdown)
    print(f"wrote {write_report('tool_call', {'results': results}, markdown)}")


def render(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "## Tool calls end to end (HTTP → API → Celery/Redis → worker → exec agent), ms",
        "",
        "| command @ concurrent rollouts | calls | p50 | p90 | p99 | calls/s |",
        "|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        lines.append(
            f"| {key} | {r['n']} | {r['p50']} | {r['p90']} | {r['p99']} | {r['calls_per_s']} |"
        )
    p50 = results.get(f"true@16 think {THINK_S * 1000:.0f}ms", {}).get("p50")
    best = max(r["calls_per_s"] for r in results.values())
    lines += [
        "",
        "| target | goal | measured | met |",
        "|---|---|---|---|",
        f"| `true` p50, 16 rollouts thinking {THINK_S * 1000:.0f} ms between calls | "
        f"<= {TARGETS['true_p50_ms_at_16']:g} ms | {p50} ms | "
        f"{'yes' if p50 is not None and p50 <= TARGETS['true_p50_ms_at_16'] else 'no'} |",
        f"| throughput (back to back) | >= {TARGETS['calls_per_s']:g} calls/s | {best} calls/s | "
        f"{'yes' if best >= TARGETS['calls_per_s'] else 'no'} |",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
