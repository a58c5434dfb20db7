"""What a task's publish costs the API: Celery's own ``send_task`` against the message the
orchestrator builds itself (state/broker.task_message) and pushes with one LPUSH, side by
side in one run, on the host's real Redis.

    python -m bench.publish [--messages 2000] [--rounds 3]

Each round publishes ``--messages`` tool calls (a real RunOp payload) with each variant
in turn, to a queue of a throwaway deployment that is deleted after:

- ``send_task``: ``Celery.send_task`` by name with an expiry, the result ignored: kombu's
  producer from its pool, Celery's message made whole (``as_task_v2``) each time;
- ``task_message + LPUSH``: the message built by state/broker.task_message (Celery's
  protocol-2 headers made once per task and process) and pushed by redis-py, as the API's
  publishes that are not part of a script are;
- ``task_message``: building the message alone (what the Lua script of
  state/calls.ApiCalls.begin pushes in the same step as the call's state change).

Reports this process's CPU (time.process_time) and wall time per publish, medians over the
rounds. Writes bench/results/publish.json and .md. Why this matters: docs/architecture.md
("Celery as the router").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import redis

from bench.common import write_report
from orchestrator.config import Settings
from orchestrator.sandbox.backend import ExecOp, SandboxHandle
from orchestrator.state.broker import make_celery, task_message
from orchestrator.state.keys import Keys
from orchestrator.state.wire import RunOp, TaskName


def _tool_call() -> RunOp:
    now = datetime.now(UTC)
    return RunOp(
        rollout_id=f"r-{uuid.uuid4().hex}",
        call_id=f"c-{uuid.uuid4().hex}",
        ticket=f"orch:bench:ticket:{uuid.uuid4().hex}",
        attempt=uuid.uuid4().hex,
        handle=SandboxHandle(
            sandbox_id=f"sbx-{uuid.uuid4().hex[:12]}",
            backend="docker",
            native_id=uuid.uuid4().hex + uuid.uuid4().hex,
            rollout_id="r",
            host="bench",
            image="orchestrator/sandbox-base:latest",
            runtime="runc",
            created_at=now,
            expires_at=now + timedelta(hours=1),
        ),
        op=ExecOp(command="true", timeout_s=30.0, output_budget_bytes=16384),
        enqueued_at=time.time(),
    )


def _measure(n: int, publish: Callable[[], None]) -> tuple[float, float]:
    """(CPU us, wall us) per publish of ``n``."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        publish()
    return (
        (time.process_time() - cpu) / n * 1e6,
        (time.perf_counter() - wall) / n * 1e6,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    deployment = f"bench-publish-{uuid.uuid4().hex[:6]}"
    settings = Settings(deployment=deployment)
    keys = Keys.of(deployment)
    queue = keys.host_queue("bench")
    app = make_celery(settings)
    client = redis.Redis.from_url(settings.redis_url)
    payload = _tool_call().model_dump(mode="json")
    payload_json = json.dumps(payload, separators=(",", ":"))
    name = TaskName.RUN_OP

    def send_task() -> None:
        app.send_task(name.value, args=[payload], queue=queue, expires=60, ignore_result=True)

    def built_and_pushed() -> None:
        client.lpush(queue, task_message(app, name, payload_json, queue=queue, expires_s=60))

    def built() -> None:
        task_message(app, name, payload_json, queue=queue, expires_s=60)

    variants: dict[str, Callable[[], None]] = {
        "send_task": send_task,
        "task_message + LPUSH": built_and_pushed,
        "task_message": built,
    }
    samples: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    try:
        for variant in variants.values():  # warm: connections, the headers' cache
            _measure(50, variant)
        client.delete(queue)
        for _ in range(args.rounds):
            for label, variant in variants.items():
                samples[label].append(_measure(args.messages, variant))
                client.delete(queue)
        # What each variant's message looks like on the list, to check both are one push.
        send_task()
        built_and_pushed()
        lengths = client.llen(queue)
    finally:
        client.delete(queue)
        for key in client.scan_iter(f"*{deployment}*"):
            client.delete(key)
        client.close()

    rows: dict[str, dict[str, float]] = {}
    for label, values in samples.items():
        rows[label] = {
            "cpu_us": round(statistics.median(c for c, _ in values), 1),
            "wall_us": round(statistics.median(w for _, w in values), 1),
        }
    lines = [
        f"## Publishing a tool call's task ({args.messages} messages x {args.rounds} rounds, "
        "variants interleaved; medians of the rounds)",
        "",
        "| variant | CPU us / publish | wall us / publish |",
        "|---|---|---|",
        *(f"| {label} | {row['cpu_us']} | {row['wall_us']} |" for label, row in rows.items()),
        "",
        f"Payload: a RunOp of {len(payload_json)} bytes of JSON. Both pushes left "
        f"{lengths} messages on the queue (one each).",
    ]
    markdown = "\n".join(lines) + "\n"
    report: dict[str, Any] = {
        "messages": args.messages,
        "rounds": args.rounds,
        "payload_bytes": len(payload_json),
        "variants": rows,
        "samples": {k: [list(s) for s in v] for k, v in samples.items()},
    }
    write_report("publish", report, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
