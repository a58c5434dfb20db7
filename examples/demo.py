"""`make demo`: a scripted agent plans changes to a real codebase through the Agent RFT
endpoints, exactly as a trainer would drive a model, and each rollout is graded.

Starts its own deployment (API, worker, reaper) on a free loopback port, registers the
`requests` codebase, runs examples/codebase_planning/dataset.jsonl, prints a table, and
tears everything down.
"""

from __future__ import annotations

import json
import secrets
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from examples.codebase_planning.agent import localise
from orchestrator.config import Settings
from orchestrator.environments.examples import ensure_requests_codebase, planning_example_dir
from orchestrator.local import free_port, local_stack


def main() -> None:
    token = secrets.token_urlsafe(16)
    state = Path(tempfile.mkdtemp(prefix="orch-demo-"))
    settings = Settings(
        deployment="demo",
        api_port=free_port(),
        api_tokens=token,
        state_dir=state,
        host_id=f"demo-{uuid.uuid4().hex[:6]}",
    )
    print("registering codebase 'requests' (the real library's source, as a git repo) ...")
    ensure_requests_codebase(settings)
    rows = [json.loads(line) for line in (planning_example_dir() / "dataset.jsonl").open()]
    log = state / "stack.log"
    print(f"starting the orchestrator (log: {log}) ...")
    with (
        local_stack(settings, log=log) as base,
        httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=120
        ) as http,
    ):
        print(f"up at {base}\n")
        print(f"{'#':>2}  {'score':>5}  {'calls':>5}  {'p50 ms':>6}  answer  <-  request")
        scores = []
        for n, row in enumerate(rows, 1):
            trace = f"trace_{uuid.uuid4().hex}"
            latencies: list[float] = []

            def call(
                tool: str,
                arguments: dict[str, object],
                _row: dict[str, object] = row,
                _trace: str = trace,
                _lat: list[float] = latencies,
            ) -> str:
                started = time.perf_counter()
                response = http.post(
                    "/agent-rft/tools",
                    json={
                        "type": "function_call",
                        "id": f"fc_{uuid.uuid4().hex[:8]}",
                        "call_id": f"call_{uuid.uuid4().hex[:8]}",
                        "name": tool,
                        "arguments": json.dumps(arguments),
                        "trace_id": _trace,
                        "item": _row,
                    },
                )
                _lat.append((time.perf_counter() - started) * 1000)
                response.raise_for_status()
                output: str = response.json()["output"]
                return output

            answer, calls = localise(str(row["request"]), call)
            graded = http.post(
                "/agent-rft/grade",
                json={
                    "sample": {"output_text": json.dumps(answer)},
                    "item": row,
                    "trace_id": trace,
                },
            )
            graded.raise_for_status()
            score = graded.json()["score"]
            scores.append(score)
            http.delete(f"/v1/rollouts/{trace}")
            first_latency = latencies[0] if latencies else 0.0
            rest = statistics.median(latencies[1:]) if len(latencies) > 1 else first_latency
            print(
                f"{n:>2}  {score:5.2f}  {calls:>5}  {rest:6.1f}  {', '.join(answer) or '-'}"
                f"  <-  {row['request'][:60]}"
            )
        print(
            f"\nmean score {statistics.fmean(scores):.2f} over {len(scores)} rollouts "
            "(first call of each rollout includes creating its sandbox)"
        )


if __name__ == "__main__":
    main()
