"""The deployment's state as Prometheus gauges, read from Redis at scrape time.

Redis is the one source of truth for hosts, rollouts, pools, admission and queues, so
every API process reports the same values whatever the number of processes (Prometheus
aggregates API replicas with ``max()``). A scrape costs three round trips: the hosts
set and the pools' demand; heartbeats, slot counts, the live set, queue lengths and pool
lists in one pipeline; then one pipelined HMGET per live rollout for its host and
environment (cost measured in docs/metrics.md). Redis down: ``orchestrator_redis_up 0``
and no other state gauge, never an error.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Iterator

import redis
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from orchestrator.config import Settings
from orchestrator.environments.loader import EnvironmentRegistry
from orchestrator.observability.logging import get_logger
from orchestrator.sandbox.backend import SandboxHandle
from orchestrator.state.heartbeat import Heartbeat
from orchestrator.state.keys import Keys, queue_depth_keys
from orchestrator.state.pools import (
    PoolDemand,
    parse_demand,
    pool_name,
    pool_size,
    pooled_codebases,
)

log = get_logger(__name__)

# A Redis that does not answer within this is reported down rather than stalling a scrape.
_REDIS_TIMEOUT_S = 2.0


class StateCollector(Collector):
    """A prometheus_client custom collector of the contract's state gauges."""

    def __init__(
        self,
        settings: Settings,
        environments: EnvironmentRegistry,
        client: redis.Redis | None = None,
    ) -> None:
        self.settings = settings
        self.environments = environments
        self.keys = Keys.of(settings.deployment)
        self.client = client or redis.Redis.from_url(
            settings.redis_url,
            socket_timeout=_REDIS_TIMEOUT_S,
            socket_connect_timeout=_REDIS_TIMEOUT_S,
            decode_responses=True,
            client_name=self.keys.client_name("metrics"),
        )

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("orchestrator_redis_up", "1 when the collector could read Redis.")
        try:
            families = self._read()
        except Exception as exc:  # noqa: BLE001 - a scrape must never fail on Redis
            log.warning("metrics.state_unavailable", error=repr(exc))
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def close(self) -> None:
        self.client.close()

    # -- reading -----------------------------------------------------------------------------

    def _read(self) -> list[Metric]:
        keys = self.keys
        first = self.client.pipeline(transaction=False)
        first.smembers(keys.hosts)
        first.hgetall(keys.pool_demand)
        members, demand = first.execute()
        hosts = sorted(str(h) for h in members)
        pools = self._pools(parse_demand(demand))
        queues = [keys.shared_queue, *(keys.host_queue(h) for h in hosts)]
        pipe = self.client.pipeline(transaction=False)
        for host in hosts:
            pipe.get(keys.heartbeat(host))
        pipe.hgetall(keys.load)
        pipe.zcount(keys.waiting, time.time(), "+inf")
        pipe.zrange(keys.live, 0, -1)
        for queue in queues:
            for key in queue_depth_keys(queue):
                pipe.llen(key)
        for _, pool, _ in pools:
            pipe.lrange(keys.pool(pool, "ready"), 0, -1)
        replies = iter(pipe.execute())
        raw_beats = [next(replies) for _ in hosts]
        beats = [Heartbeat.model_validate_json(raw) for raw in raw_beats if raw]
        loads: dict[str, str] = next(replies)
        waiting = int(next(replies))
        live: list[str] = next(replies)
        depths = {q: sum(int(next(replies)) for _ in queue_depth_keys(q)) for q in queues}
        ready = {pool: list(next(replies)) for _, pool, _ in pools}
        return [
            *self._hosts(beats),
            *self._capacity(beats, loads, waiting),
            *self._sandboxes(live, pools, ready),
            _gauge("orchestrator_rollouts_live", "Live rollouts (not closed).", len(live)),
            _labelled(
                "orchestrator_queue_depth",
                "Celery messages waiting in each queue (priority sub-queues included).",
                ["queue"],
                {(q,): n for q, n in depths.items()},
            ),
        ]

    def _pools(self, demand: dict[str, PoolDemand]) -> list[tuple[str, str, int]]:
        """(environment, pool, size now) of every warm pool, demand-sized ones included."""
        pools = []
        for name in self.environments.names():
            env = self.environments.get(name)
            for codebase in pooled_codebases(env, self.settings, demand):
                pool = pool_name(name, codebase)
                pools.append((name, pool, pool_size(env, self.settings, demand.get(pool))))
        return pools

    def _hosts(self, beats: list[Heartbeat]) -> list[Metric]:
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
        ]

    def _capacity(
        self, beats: list[Heartbeat], loads: dict[str, str], waiting: int
    ) -> list[Metric]:
        total = sum(b.capacity or self.settings.host_max_sandboxes for b in beats)
        used = sum(max(0, int(loads.get(b.host, 0))) for b in beats)
        return [
            _gauge("orchestrator_admission_waiting", "New rollouts waiting for a slot.", waiting),
            _labelled(
                "orchestrator_capacity_slots",
                "Sandbox slots of the live hosts: used (taken) and total (their capacity).",
                ["state"],
                {("used",): used, ("total",): total},
            ),
        ]

    def _sandboxes(
        self, live: list[str], pools: list[tuple[str, str, int]], ready: dict[str, list[str]]
    ) -> list[Metric]:
        pipe = self.client.pipeline(transaction=False)
        for rollout_id in live:
            pipe.hmget(self.keys.rollout(rollout_id), ["host", "environment", "sandbox"])
        active: Tally[tuple[str, ...]] = Tally()
        for host, environment, sandbox in pipe.execute() if live else []:
            # A live rollout holds a sandbox from its creation until it is closed.
            if host and sandbox and sandbox != "null":
                active[(host, environment or "")] += 1
        pool_ready: Tally[tuple[str, ...]] = Tally()
        pool_target: Tally[tuple[str, ...]] = Tally()
        for environment, pool, size in pools:
            pool_target[(environment,)] += size
            pool_ready[(environment,)] += len(ready[pool])
            for raw in ready[pool]:
                active[(SandboxHandle.model_validate_json(raw).host, environment)] += 1
        return [
            _labelled(
                "orchestrator_sandboxes_active",
                "Sandboxes held by live rollouts or ready in a warm pool, by host and environment.",
                ["host", "environment"],
                dict(active),
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
        ]


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _labelled(
    name: str, documentation: str, labels: list[str], values: dict[tuple[str, ...], int]
) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key), value)
    return family
