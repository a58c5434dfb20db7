"""The deployment's state as Prometheus gauges, read from Redis at scrape time.

Redis is the one source of truth for hosts, rollouts, pools, admission and queues, so
every API process reports the same values whatever the number of processes (Prometheus
aggregates API replicas with ``max()``). A scrape is one read of the deployment's state
(state/snapshot.py: three round trips, the read model ``orchestrator status`` shows too),
turned into gauges by :func:`gauges` (cost measured in docs/metrics.md), and Redis's own
replication (one INFO, and behind Sentinel one question to a Sentinel). Redis down:
``orchestrator_redis_up 0`` and no other state gauge, never an error.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from orchestrator.config import Settings
from orchestrator.environments.loader import EnvironmentRegistry
from orchestrator.observability.logging import get_logger
from orchestrator.state.sentinel import SentinelUrl, is_sentinel, online_replicas
from orchestrator.state.snapshot import DeploymentState, StateReader

log = get_logger(__name__)


class StateCollector(Collector):
    """A prometheus_client custom collector of the contract's state gauges."""

    def __init__(
        self,
        settings: Settings,
        environments: EnvironmentRegistry,
        client: redis.Redis | None = None,
    ) -> None:
        self.reader = StateReader(settings, environments, role="metrics", client=client)
        self.required = settings.redis_replicas_to_wait
        self.sentinel = (
            SentinelUrl.parse(settings.redis_url) if is_sentinel(settings.redis_url) else None
        )
        # The primary's replication id at the last scrape, and how many times this process
        # saw it change (a promotion: docs/failure-model.md, "Redis failover").
        self._epoch: str | None = None
        self._failovers = 0

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("orchestrator_redis_up", "1 when the collector could read Redis.")
        try:
            state = self.reader.read()
            replication = self._replication()
        except Exception as exc:  # noqa: BLE001 - a scrape must never fail on Redis
            log.warning("metrics.state_unavailable", error=repr(exc))
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from gauges(state)
        yield from replication

    def _replication(self) -> list[Metric]:
        """The primary's replicas as the primary sees them (online: past their first sync)
        and, behind Sentinel, those the Sentinels know but find down; the replicas a call
        waits for; the failovers this process has seen."""
        info = self.reader.client.info("replication")
        online = online_replicas(info)
        down = 0
        if self.sentinel is not None:
            epoch = str(info["master_replid"])
            if self._epoch is not None and epoch != self._epoch:
                self._failovers += 1
            self._epoch = epoch
            down = sum(1 for replica in self._sentinel_replicas() if _is_down(replica))
        failovers = CounterMetricFamily(
            "orchestrator_redis_failovers",
            "Times this process saw the Redis primary change (a Sentinel failover).",
            value=self._failovers,
        )
        return [
            _labelled(
                "orchestrator_redis_replicas",
                "Redis replicas: online with the primary; down (known to the Sentinels, "
                "not answering; 0 without Sentinel).",
                ["state"],
                {("online",): online, ("down",): down},
            ),
            _gauge(
                "orchestrator_redis_replicas_required",
                "Replicas a worker's claim and result wait for (ORCH_REDIS_REPLICAS_TO_WAIT).",
                self.required,
            ),
            failovers,
        ]

    def _sentinel_replicas(self) -> list[dict[str, Any]]:
        """The replicas the first Sentinel that answers knows of."""
        assert self.sentinel is not None
        error: Exception | None = None
        for host, port in self.sentinel.sentinels:
            client = redis.Redis(
                host=host,
                port=port,
                socket_timeout=2,
                decode_responses=True,
                **self.sentinel.auth(),
            )
            try:
                return list(client.sentinel_slaves(self.sentinel.service))
            except redis.RedisError as exc:
                error = exc
            finally:
                client.close()
        raise redis.ConnectionError(f"no Sentinel answered: {error}")

    def close(self) -> None:
        self.reader.close()


def gauges(state: DeploymentState) -> list[Metric]:
    """The state gauges of one snapshot (all but ``orchestrator_redis_up``)."""
    beats = state.beating
    pool_ready: Counter[tuple[str, ...]] = Counter()
    pool_target: Counter[tuple[str, ...]] = Counter()
    for pool in state.pools:
        pool_ready[(pool.environment,)] += len(pool.ready)
        pool_target[(pool.environment,)] += pool.target
    return [
        _gauge("orchestrator_workers_up", "Hosts with a live heartbeat.", len(beats)),
        _labelled(
            "orchestrator_host_schedulable",
            "1 when the host takes new sandboxes (alive, healthy, room, not draining).",
            ["host"],
            {(b.host,): int(b.schedulable) for b in beats},
        ),
        _labelled(
            "orchestrator_host_healthy",
            "1 when the host's daemon probe succeeded.",
            ["host"],
            {(b.host,): int(b.backend_ok) for b in beats},
        ),
        _gauge(
            "orchestrator_admission_waiting",
            "New rollouts waiting for a slot.",
            state.admission_waiting,
        ),
        _labelled(
            "orchestrator_tenant_sandboxes",
            "Sandboxes each tenant's rollouts hold or are making (docs/tenancy.md).",
            ["tenant"],
            {(tenant,): held for tenant, held in state.tenant_sandboxes.items()},
        ),
        _labelled(
            "orchestrator_capacity_slots",
            "Sandbox slots of the live hosts: used (taken) and total (their capacity).",
            ["state"],
            {("used",): state.slots_used, ("total",): state.slots_total},
        ),
        _labelled(
            "orchestrator_sandboxes_active",
            "Sandboxes held by live rollouts or ready in a warm pool, by host and environment.",
            ["host", "environment"],
            {(host, env): n for (host, env), n in state.sandboxes_held().items()},
        ),
        _labelled(
            "orchestrator_pool_ready",
            "Ready sandboxes in the environment's warm pools.",
            ["environment"],
            dict(pool_ready),
        ),
        _labelled(
            "orchestrator_pool_target",
            "Configured warm-pool size of the environment (all its pools).",
            ["environment"],
            dict(pool_target),
        ),
        _gauge("orchestrator_rollouts_live", "Live rollouts (not closed).", state.live.count),
        _gauge(
            "orchestrator_reaper_last_pass_timestamp_seconds",
            "When beat's reaper last finished a pass (Unix seconds; 0: never).",
            state.reaper_last_pass or 0.0,
        ),
        _labelled(
            "orchestrator_queue_depth",
            "Celery messages waiting in each queue (priority sub-queues included).",
            ["queue"],
            {(q,): n for q, n in state.queues.items()},
        ),
    ]


def _is_down(replica: dict[str, Any]) -> bool:
    flags = str(replica.get("flags", ""))
    return any(flag in flags for flag in ("s_down", "o_down", "disconnected"))


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _labelled(
    name: str, documentation: str, labels: list[str], values: dict[tuple[str, ...], int]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key), value)
    return family
