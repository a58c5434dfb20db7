"""The one metrics registry: Prometheus metrics the API exports at /metrics.

Names start with ``orchestrator_``. Per-process for now (one API process by default);
several API or worker processes need prometheus_client's multiprocess mode (issue 7).
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

TOOL_CALLS = Counter(
    "orchestrator_tool_calls_total",
    "Tool calls answered, by tool and outcome.",
    ["tool", "outcome"],
)
TOOL_CALL_SECONDS = Histogram(
    "orchestrator_tool_call_seconds",
    "Tool call latency, from the API's receipt to its reply, by phase.",
    ["phase"],
    buckets=(0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 600),
)
INFRA_ERRORS = Counter(
    "orchestrator_infra_errors_total", "Rollouts marked infra_failed, by cause.", ["cause"]
)
ROLLOUTS_STARTED = Counter("orchestrator_rollouts_started_total", "Rollouts started.", ["source"])
ROLLOUTS_GRADED = Counter("orchestrator_rollouts_graded_total", "Rollouts graded.")
GRADE_SCORE = Histogram(
    "orchestrator_grade_score",
    "Scores given.",
    buckets=(0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
)
SANDBOX_CREATE_SECONDS = Histogram(
    "orchestrator_sandbox_create_seconds",
    "Time to a ready sandbox, as the API sees it (queue included).",
    buckets=(0.1, 0.2, 0.3, 0.5, 1, 2, 5, 10, 30, 60),
)
