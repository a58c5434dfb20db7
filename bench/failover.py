"""What Redis behind Sentinel costs a tool call, and how long a failover stops the calls.

    python -m bench.failover [--calls 2000] [--rounds 3] [--kills 5]

On a primary with two replicas and three Sentinels of its own (tests/redis_ha.py, loopback
ports, Debian's redis-server; down-after 1,000 ms as in the tests, the chart's is 5,000):

1. **The worker's two writes per call** (state/calls.WorkerCalls: the claim of a call's
   ticket before its command runs, the result after), the real scripts on a worker's lean
   connection, per call: through the Sentinels with no WAIT (``replicas=0``), and with
   ``WAIT 1`` in the same round trip (``replicas=1``, what ``ORCH_REDIS_REPLICAS_TO_WAIT=1``
   does), and on the primary directly for reference. Variants interleaved call by call;
   wall and this process's CPU per call (claim + finish), medians of the rounds' medians.
2. **Time to resume**: the primary SIGKILLed while a worker thread claims and finishes
   calls back to back with ``replicas=1``; the time from the kill to the first call done
   after it, and the calls that failed meanwhile (none should: the retries ride it out).
   The killed node comes back as a replica before the next kill.

Writes bench/results/failover.json and .md. Why: docs/failure-model.md, "Redis failover".
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import percentile, write_report
from orchestrator.state.calls import WorkerCalls
from orchestrator.state.resp import SyncConnection
from tests.redis_ha import DOWN_AFTER_MS, Sentinels

# A ticket as ApiCalls.begin leaves it: queued, for this attempt.
ATTEMPT = "a1"
RESULT = '{"kind":"exec_ran","exit_code":0,"stdout":"","stderr":""}'


def _queue(admin: SyncConnection, key: str) -> None:
    # On a replica too, and retried through a failover: the bench's own set-up must not be
    # what a failover loses.
    admin.call(
        "HSET", key, "state", "queued", "attempt", ATTEMPT, "reply_to", "",
        retry=True, replicas=1 if admin.endpoint.sentinel else 0,
    )  # fmt: skip


def _one_call(calls: WorkerCalls, admin: SyncConnection) -> tuple[float, float]:
    """(wall, CPU) seconds of one call's claim and finish."""
    key = f"orch:bench-failover:ticket:{uuid.uuid4().hex}"
    _queue(admin, key)
    started, cpu = time.perf_counter(), time.process_time()
    assert calls.claim(key, ATTEMPT, "worker-1", time.time(), uuid.uuid4().hex) == "running"
    state, _ = calls.finish(key, "worker-1", RESULT, time.time())
    assert state == "done"
    took = time.perf_counter() - started, time.process_time() - cpu
    admin.call("DEL", key, retry=True)
    return took


def per_call(sentinels: Sentinels, calls: int, rounds: int) -> dict[str, Any]:
    primary = f"redis://127.0.0.1:{sentinels.primary().port}/0"
    admin = SyncConnection(primary, "bench-admin")
    variants = {
        "primary, no WAIT": WorkerCalls(SyncConnection(primary, "bench")),
        "Sentinel, no WAIT": WorkerCalls(SyncConnection(sentinels.url, "bench")),
        "Sentinel, WAIT 1": WorkerCalls(SyncConnection(sentinels.url, "bench"), replicas=1),
    }
    medians: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in variants}
    for _ in range(rounds):
        samples: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in variants}
        for _ in range(calls):
            for name, worker in variants.items():
                wall, cpu = _one_call(worker, admin)
                samples[name]["wall"].append(wall)
                samples[name]["cpu"].append(cpu)
        for name, got in samples.items():
            medians[name]["wall"].append(statistics.median(got["wall"]))
            medians[name]["cpu"].append(statistics.median(got["cpu"]))
            medians[name].setdefault("p99", []).append(percentile(got["wall"], 99))
    return {
        name: {
            "wall_us": statistics.median(m["wall"]) * 1e6,
            "p99_us": statistics.median(m["p99"]) * 1e6,
            "cpu_us": statistics.median(m["cpu"]) * 1e6,
        }
        for name, m in medians.items()
    }


def _calls_until(
    calls: WorkerCalls,
    admin: SyncConnection,
    done: list[float],
    failed: list[str],
    stop: threading.Event,
) -> None:
    """Calls back to back until ``stop``: when each was done, and each failure."""
    while not stop.is_set():
        try:
            _one_call(calls, admin)
            done.append(time.monotonic())
        except Exception as exc:  # noqa: BLE001 - counted, the loop goes on
            failed.append(repr(exc))


def resume_after_kill(sentinels: Sentinels, kills: int) -> list[dict[str, Any]]:
    calls = WorkerCalls(SyncConnection(sentinels.url, "bench"), replicas=1)
    admin = SyncConnection(sentinels.url, "bench-admin")
    rows = []
    for _ in range(kills):
        done: list[float] = []
        failed: list[str] = []
        stop = threading.Event()

        thread = threading.Thread(target=_calls_until, args=(calls, admin, done, failed, stop))
        thread.start()
        time.sleep(0.5)
        primary = sentinels.primary()
        killed_at = time.monotonic()
        primary.kill()
        while not [t for t in done if t > killed_at]:
            time.sleep(0.01)
        resumed = min(t for t in done if t > killed_at) - killed_at
        stop.set()
        thread.join()
        rows.append({"resumed_s": resumed, "failed_calls": len(failed), "failures": failed})
        sentinels.restore()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kills", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="orch-bench-failover-", dir="/tmp"))
    sentinels = Sentinels(root)
    try:
        sentinels.start()
        costs = per_call(sentinels, args.calls, args.rounds)
        resumes = resume_after_kill(sentinels, args.kills)
    finally:
        sentinels.close()
        shutil.rmtree(root, ignore_errors=True)
    base = costs["Sentinel, no WAIT"]
    lines = [
        "# Redis behind Sentinel: a call's two worker writes, and a failover",
        "",
        f"{args.calls} calls × {args.rounds} rounds, variants interleaved call by call; "
        "medians of the rounds' medians (claim + finish of one call).",
        "",
        "| variant | wall per call (µs) | p99 (µs) | CPU per call (µs) | wall vs no WAIT |",
        "|---|---|---|---|---|",
    ]
    for name, cost in costs.items():
        lines.append(
            f"| {name} | {cost['wall_us']:.0f} | {cost['p99_us']:.0f} | {cost['cpu_us']:.0f} "
            f"| {cost['wall_us'] / base['wall_us']:.2f}× |"
        )
    waits = sorted(r["resumed_s"] for r in resumes)
    lines += [
        "",
        f"Primary SIGKILLed {len(resumes)} times during back-to-back calls (WAIT 1, "
        f"down-after {DOWN_AFTER_MS} ms): first call done after the kill in "
        f"{', '.join(f'{w:.2f}' for w in waits)} s (median {statistics.median(waits):.2f} s); "
        f"calls failed meanwhile: {sum(int(r['failed_calls']) for r in resumes)}.",
    ]
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    write_report(
        "failover",
        {"calls": args.calls, "rounds": args.rounds, "per_call": costs, "resumes": resumes},
        markdown,
    )


if __name__ == "__main__":
    main()
