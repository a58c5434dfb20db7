"""The one metrics registry: the counters and histograms of every process (docs/metrics.md).

Names start with ``orchestrator_``. Each process updates its own; with
``PROMETHEUS_MULTIPROC_DIR`` set (the API under ``api_workers > 1``: see
:mod:`orchestrator.observability.multiproc`), prometheus_client writes them to per-process
files there and :func:`exposition` merges every process's files. There are no gauges here:
the state of the deployment (hosts, sandboxes, pools, queues) is read from Redis at scrape
time by :mod:`orchestrator.state.collector`, one source of truth for any number of
processes. Workers serve their own counters on ``worker_metrics_port``
(:func:`serve_worker_metrics`), the reaper its own on ``reaper_metrics_port``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from orchestrator.config import Settings
from orchestrator.observability.logging import get_logger

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Seconds, from a loopback tool call (a few ms) to a command at its 10-minute bound.
_LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 600)

TOOL_CALLS = Counter(
    "orchestrator_tool_calls_total",
    "Tool calls answered, by tool and outcome (ok, agent_error, infra_error, rejected).",
    ["tool", "outcome"],
)
TOOL_CALL_SECONDS = Histogram(
    "orchestrator_tool_call_seconds",
    "Tool call latency by phase: queue (enqueued to a worker's start), exec (the worker "
    "running it), total (the API's receipt to its reply).",
    ["phase"],
    buckets=_LATENCY_BUCKETS,
)
SANDBOX_CREATE_SECONDS = Histogram(
    "orchestrator_sandbox_create_seconds",
    "Time to a ready sandbox as the API sees it (admission and queue included), by source: "
    "pool (a warm sandbox, probed) or cold (created for the rollout).",
    ["source"],
    buckets=(0.01, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
)
ROLLOUTS_STARTED = Counter(
    "orchestrator_rollouts_started_total",
    "Rollouts whose sandbox became ready, by source (agent_rft or api).",
    ["source"],
)
ROLLOUTS_FINISHED = Counter(
    "orchestrator_rollouts_finished_total",
    "Rollouts closed, by final outcome (ok, agent_error, infra_error).",
    ["outcome"],
)
INFRA_ERRORS = Counter(
    "orchestrator_infra_errors_total", "Rollouts marked infra_failed, by cause.", ["cause"]
)
ROLLOUTS_GRADED = Counter("orchestrator_rollouts_graded_total", "Rollouts graded.")
GRADE_SCORE = Histogram(
    "orchestrator_grade_score",
    "Scores given, by environment.",
    ["environment"],
    buckets=(0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
)
GRADER_ERRORS = Counter(
    "orchestrator_grader_errors_total",
    "Grades that failed on our side (503 grader_failed), by environment and kind.",
    ["environment", "kind"],
)
JUDGE_VERDICTS = Counter(
    "orchestrator_judge_verdicts_total",
    "Verdicts asked of judge models (grader score_model), by environment and outcome: ok, "
    "cached, or why none came (judge_unavailable, judge_timeout, judge_unparseable, "
    "judge_refused, judge_busy).",
    ["environment", "outcome"],
)
JUDGE_LATENCY = Histogram(
    "orchestrator_judge_latency_seconds",
    "How long a judge model took to answer one request, by environment.",
    ["environment"],
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60),
)
LIMIT_HITS = Counter(
    "orchestrator_limit_hits_total",
    "Tool calls that hit a sandbox limit, by environment and kind (timeout, memory_limit, "
    "pids_limit, disk_limit, output_limit).",
    ["environment", "kind"],
)
TOOL_CALLS_PER_ROLLOUT = Histogram(
    "orchestrator_tool_calls_per_rollout",
    "Tool calls a rollout made (budget-counted calls), observed when it closes.",
    buckets=(0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
)
SANDBOXES_REAPED = Counter(
    "orchestrator_sandboxes_reaped_total",
    "Sandboxes the reaper or the label sweep destroyed, by reason (idle, graded, "
    "max_lifetime, infra_failed, stuck_creating, host_lost, host_unhealthy, expired, orphan).",
    ["reason"],
)
SANDBOXES_RECYCLED = Counter(
    "orchestrator_sandboxes_recycled_total",
    "Sandboxes of clean rollouts sent for recycling, by result: recycled (reset, audited "
    "clean, back in their pool), or destroyed because of spec_changed, pool_full, "
    "limit_hit, audit_failed or reset_failed (queue/handlers.RecycleResult).",
    ["result"],
)
BACKGROUND_YIELD_SECONDS = Histogram(
    "orchestrator_background_yield_seconds",
    "How long background work waited for the host's tool calls to pause before it ran "
    "(queue/worker.Host.yield_to_calls), by work: refill (a pool sandbox's creation), reset (a "
    "recycled sandbox's).",
    ["work"],
    buckets=(0.001, 0.05, 0.1, 0.3, 1, 2, 5, 10, 20, 30, 60),
)
SNAPSHOT_SECONDS = Histogram(
    "orchestrator_snapshot_seconds",
    "Time to take a sandbox's filesystem snapshot on its host (sandbox/docker/snapshots.py), by "
    "kind: named, fork, group, pause; and how long the sandbox was frozen for it (phase).",
    ["kind", "phase"],
    buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60),
)
ORPHANS_FOUND = Counter(
    "orchestrator_orphans_found_total",
    "Owned sandboxes found with no live rollout owning them (by the host sweep).",
)
HTTP_REQUESTS = Counter(
    "orchestrator_http_requests_total",
    "API requests answered, by route template, method and status.",
    ["route", "method", "status"],
)
HTTP_REQUEST_SECONDS = Histogram(
    "orchestrator_http_request_seconds",
    "API request latency by route template.",
    ["route"],
    buckets=_LATENCY_BUCKETS,
)
RECYCLE_WAITS = Histogram(
    "orchestrator_pool_recycle_wait_seconds",
    "How long a new rollout that found its pool empty waited for a sandbox being reset for "
    "it, by result: taken (it got one), none_left (the resets ended without one for it) or "
    "timed_out (pool_recycle_wait_s passed); the last two then take a cold sandbox "
    "(state/pools.RecycleWait).",
    ["result"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120),
)
QUOTA_REFUSED = Counter(
    "orchestrator_quota_refused_total",
    "Requests refused because a tenant was at one of its quotas (docs/tenancy.md), by "
    "tenant and quota: sandboxes, creations_per_s, calls_per_s; warm_sandboxes counts new "
    "rollouts given a cold sandbox instead of a warm one.",
    ["tenant", "quota"],
)
ADMISSION_REJECTED = Counter(
    "orchestrator_admission_rejected_total",
    "New rollouts refused for capacity, by reason: at_capacity (waited admission_wait_s), "
    "queue_full (the admission queue was full).",
    ["reason"],
)

log = get_logger(__name__)


def multiprocess_mode() -> bool:
    """Counters are kept in per-process files (several API processes)."""
    return bool(os.environ.get(MULTIPROC_ENV))


class _Union(Collector):
    """Several collectors' metrics as one, so a scrape renders them in one registry."""

    def __init__(self, sources: Iterable[Collector | CollectorRegistry]) -> None:
        self.sources = list(sources)

    def collect(self) -> Iterator[Metric]:
        for source in self.sources:
            yield from source.collect()


def exposition(*extra: Collector) -> bytes:
    """The Prometheus text of this process's metrics (every process's, merged from their
    files, in multiprocess mode) followed by ``extra`` collectors' (the API's Redis state)."""
    own: Collector
    if multiprocess_mode():
        merged = CollectorRegistry()
        MultiProcessCollector(merged)  # type: ignore[no-untyped-call]
        own = _Union([merged])
    else:
        own = _Union([REGISTRY])
    registry = CollectorRegistry()
    registry.register(_Union([own, *extra]))
    return generate_latest(registry)


def serve_worker_metrics(settings: Settings) -> bool:
    """Serve this worker process's metrics at ``/metrics`` on ``worker_metrics_port``
    (0: not at all)."""
    return serve_process_metrics("worker", settings.worker_metrics_port, settings)


def serve_process_metrics(role: str, port: int, settings: Settings) -> bool:
    """Serve this process's metrics (a worker's, the reaper's) at ``/metrics`` on ``port``
    (0: not at all), bound to ``worker_metrics_host``. A port taken (several workers on one
    machine) is a warning: the process carries on without its endpoint rather than
    failing to start."""
    if port == 0:
        return False
    try:
        start_http_server(port, addr=settings.worker_metrics_host)
    except OSError as exc:
        log.warning(f"{role}.metrics_port_unavailable", port=port, error=str(exc))
        return False
    log.info(f"{role}.metrics_serving", port=port)
    return True
