"""Call rates, latency and the infra-error ratio from two scrapes of the API's /metrics.

Counters only grow, so the difference of two scrapes is what happened between them; a
latency quantile comes from the histogram's bucket counts in that window, interpolated
within the bucket it falls in (as Prometheus's ``histogram_quantile`` does). A counter
that went down (the API restarted) restarts the window from zero.
"""

from __future__ import annotations

import math
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from orchestrator.outcomes import Outcome
from orchestrator.tls import tls
from orchestrator.views.models import CallStats, PhaseLatency

TOOL_CALLS = "orchestrator_tool_calls_total"
CALL_SECONDS_BUCKET = "orchestrator_tool_call_seconds_bucket"
INFRA_ERRORS = "orchestrator_infra_errors_total"
PHASES = ("queue", "exec", "total")


class Sample(BaseModel):
    """One sample line of a scrape."""

    name: str
    labels: dict[str, str]
    value: float


class Scrape(BaseModel):
    """One read of /metrics: when, and the samples this view uses."""

    at: float
    samples: list[Sample] = Field(default_factory=list)

    def values(self, name: str, *keys: str) -> dict[tuple[str, ...], float]:
        """The samples named ``name``, summed by the values of labels ``keys``."""
        out: dict[tuple[str, ...], float] = {}
        for sample in self.samples:
            if sample.name == name:
                key = tuple(sample.labels.get(k, "") for k in keys)
                out[key] = out.get(key, 0.0) + sample.value
        return out


WANTED = {TOOL_CALLS, CALL_SECONDS_BUCKET, INFRA_ERRORS}


def parse(text: str, at: float) -> Scrape:
    """The samples of a Prometheus text exposition this view uses."""
    samples = [
        Sample(name=s.name, labels=dict(s.labels), value=s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in WANTED
    ]
    return Scrape(at=at, samples=samples)


def fetch(api_url: str, timeout_s: float = 5.0, token: str | None = None) -> Scrape:
    """Scrape ``api_url``/metrics (the API's port, with an operator's ``token``, or the
    scraper's ``api_metrics_port``); httpx.HTTPError when it cannot be read."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = httpx.get(
        f"{api_url.rstrip('/')}/metrics", timeout=timeout_s, verify=tls(), headers=headers
    )
    response.raise_for_status()
    return parse(response.text, time.time())


def _delta(
    before: dict[tuple[str, ...], float], after: dict[tuple[str, ...], float]
) -> dict[tuple[str, ...], float]:
    reset = any(after.get(k, 0.0) < v for k, v in before.items())
    return {k: v - (0.0 if reset else before.get(k, 0.0)) for k, v in after.items()}


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of cumulative ``buckets`` ((upper bound, count) pairs, +Inf
    included); None when they hold no observation."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower  # past the highest finite bound: that bound is all we know
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


def call_stats(api_url: str, before: Scrape | None, after: Scrape) -> CallStats:
    """What happened between two scrapes (``before`` None: since the API started)."""
    empty = Scrape(at=after.at)
    base = before or empty
    calls = _delta(base.values(TOOL_CALLS, "outcome"), after.values(TOOL_CALLS, "outcome"))
    by_outcome = {k[0]: v for k, v in calls.items()}
    total = sum(by_outcome.values())
    window = max(0.0, after.at - base.at) if before is not None else 0.0
    buckets = _delta(
        base.values(CALL_SECONDS_BUCKET, "phase", "le"),
        after.values(CALL_SECONDS_BUCKET, "phase", "le"),
    )
    latency = []
    for phase in PHASES:
        phase_buckets = [(float(le), n) for (p, le), n in buckets.items() if p == phase]
        p50 = histogram_quantile(0.5, phase_buckets)
        p99 = histogram_quantile(0.99, phase_buckets)
        count = max((n for _, n in phase_buckets), default=0.0)
        latency.append(
            PhaseLatency(
                phase=phase,
                count=int(count),
                p50_ms=None if p50 is None else p50 * 1000,
                p99_ms=None if p99 is None else p99 * 1000,
            )
        )
    causes = _delta(base.values(INFRA_ERRORS, "cause"), after.values(INFRA_ERRORS, "cause"))
    return CallStats(
        api_url=api_url,
        window_s=window,
        calls=total,
        rate_per_s=total / window if window > 0 else 0.0,
        by_outcome=by_outcome,
        infra_error_ratio=by_outcome.get(Outcome.INFRA_ERROR.value, 0.0) / total if total else None,
        latency=latency,
        infra_errors_by_cause={k[0]: v for k, v in causes.items() if v},
        calls_since_start=sum(after.values(TOOL_CALLS, "outcome").values()),
    )
