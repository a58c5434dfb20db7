"""The steady-state tool call's Redis round trips, counted on real Redis with MONITOR.

Every connection names its role (state/keys.Keys.client_name), so each command MONITOR
sees is attributed to the API, the worker or Celery's broker connection of this stack.
A round trip is one command sent, except that a MULTI ... EXEC block is one and the
commands a Lua script runs (MONITOR shows them as from "lua") are part of its EVALSHA.

Budget (issue: the hot path): the API side at most 3 per call (start, wait, settle), the
worker side at most 2 (claim, finish with its reply). Celery's own delivery to the worker
is counted apart and reported.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import redis

from orchestrator.client import RolloutClient
from orchestrator.state.keys import Keys
from tests.stacks import TOKEN, Stack

CALLS = 5
API_BUDGET = 3
WORKER_BUDGET = 2
CONNECTION_SETUP = frozenset({"CLIENT", "HELLO", "AUTH", "SELECT"})
"""What a new connection sends once. The worker's call path keeps a connection per thread
(state/resp.SyncConnection), opened on its first call: a measured call that lands on a
Celery thread the warm-up calls did not reach opens one (seen once in five fresh-clone runs:
the worker's CLIENT SETNAME made 2.2 round trips a call)."""


@dataclass
class Seen:
    commands: list[dict[str, Any]] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=dict)

    def by_role(self, keys: Keys) -> dict[str, list[str]]:
        """Round trips per role of this deployment's connections, as command names."""
        roles: dict[str, list[str]] = {}
        in_multi: set[str] = set()
        # The worker's host probe reads the deployment's state mark every heartbeat
        # interval (a SET NX and a GET in one pipeline: queue/worker.with_state_check),
        # whatever calls run: seen once in a fresh-clone run as 2.4 round trips a call.
        keys_of_no_call = {keys.state_mark}
        for command in self.commands:
            if command.get("client_type") == "lua":
                continue
            address = f"{command['client_address']}:{command['client_port']}"
            name = self.names.get(address, "")
            if not name.startswith(keys.client_name("")):
                continue
            verb, *args = str(command["command"]).split(" ", 2)
            verb = verb.upper()
            if verb in CONNECTION_SETUP:
                continue  # a connection's, once: not the steady call's
            if args and args[0].strip('"') in keys_of_no_call:
                continue  # the host's own periodic work, not the steady call's
            if address in in_multi:
                if verb == "EXEC":
                    in_multi.discard(address)
                continue  # inside a transaction: part of its MULTI's round trip
            if verb == "MULTI":
                in_multi.add(address)
            roles.setdefault(name.removeprefix(keys.client_name("")), []).append(verb)
        return roles


@contextmanager
def monitored(redis_url: str) -> Iterator[Seen]:
    """Every command Redis runs while the block runs, and who sent it."""
    seen = Seen()
    stop = threading.Event()
    started = threading.Event()
    client = redis.Redis.from_url(redis_url, decode_responses=True)

    def record() -> None:
        with client.monitor() as monitor:  # type: ignore[no-untyped-call]
            started.set()
            while not stop.is_set():
                seen.commands.append(monitor.next_command())

    thread = threading.Thread(target=record, daemon=True)
    thread.start()
    assert started.wait(10)
    poke = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        yield seen
        seen.names = {c["addr"]: c["name"] for c in poke.client_list()}
    finally:
        stop.set()
        poke.ping()  # wakes the monitor for its last read
        thread.join(10)
        poke.close()
        client.close()


def test_a_steady_call_costs_three_round_trips_in_the_api_and_two_in_the_worker(
    stack: Stack, planning_item: dict[str, Any]
) -> None:
    keys = Keys.of(stack.settings.deployment)
    with (
        RolloutClient(stack.base_url, TOKEN) as client,
        client.rollout(
            environment="codebase-planning", codebase=stack.codebase, item=planning_item
        ) as rollout,
    ):
        # Warm: scripts loaded, the environment's snapshot read, connections open.
        for _ in range(2):
            assert rollout.call("shell", {"command": "true"}).outcome == "ok"
        with monitored(stack.settings.redis_url) as seen:
            for _ in range(CALLS):
                assert rollout.call("shell", {"command": "true"}).outcome == "ok"
    roles = seen.by_role(keys)
    per_call = {role: len(verbs) / CALLS for role, verbs in roles.items()}
    evidence = {role: dict(Counter(verbs)) for role, verbs in roles.items()}
    assert per_call.get("api", 0) <= API_BUDGET, evidence
    assert per_call.get("worker", 0) <= WORKER_BUDGET, evidence
    assert per_call.get("api", 0) > 0 and per_call.get("worker", 0) > 0, evidence
