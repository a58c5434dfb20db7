"""Every Redis key and Celery queue name of a deployment, spelled once.

Everything a deployment keeps in Redis starts with its prefix (``orch:<deployment>:``), so
two deployments share one Redis without seeing each other, and ``SCAN orch:<d>:*`` finds
all of one. Nothing outside this module builds a key from parts: a new key is a method
here, with what it holds and who writes it.

Per rollout (``rollout:<id>`` and below):

=============================== ====== ===================================================
key                             type   holds
=============================== ====== ===================================================
``rollout:<id>``                hash   the record (state/records.py), fields JSON-encoded
``rollout:<id>:seq``            string its last trajectory sequence number
``rollout:<id>:traj``           list   its trajectory steps, in order
``rollout:<id>:call:<call>``    string the reply already given for ``call`` (idempotency)
``rollout:<id>:lock:call:<c>``  string the lease of the one request running ``call``
``rollout:<id>:run:<call>``     hash   the call's run ticket (state/calls.py)
``rollout:<id>:starting``       string the lease of the one request creating its sandbox
``rollout:<id>:grading``        string the lease of the one grade working in its sandbox
``rollout:<id>:e2b:pid``        string the E2B processes' pid counter
``rollout:<id>:e2b:processes``  hash   pid -> the E2B process record
``rollout:<id>:e2b:watchers``   hash   watcher id -> an E2B directory watcher
=============================== ====== ===================================================

Deployment-wide: the live set and the index of rollouts, recent infrastructure failures,
hosts and their heartbeats, slots, admission, pools, and the reply lists of queued tasks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from kombu.transport.redis import PRIORITY_STEPS, Channel


@dataclass(frozen=True)
class Keys:
    """The keys of the deployment whose keys start with ``prefix``."""

    prefix: str
    deployment: str

    @classmethod
    def of(cls, deployment: str) -> Keys:
        return cls(prefix=f"orch:{deployment}:", deployment=deployment)

    # A rollout's keys.

    def rollout(self, rollout_id: str) -> str:
        return f"{self.prefix}rollout:{rollout_id}"

    def seq(self, rollout_id: str) -> str:
        return f"{self.prefix}rollout:{rollout_id}:seq"

    def trajectory(self, rollout_id: str) -> str:
        return f"{self.prefix}rollout:{rollout_id}:traj"

    def call_reply(self, rollout_id: str, call_id: str) -> str:
        return f"{self.prefix}rollout:{rollout_id}:call:{call_id}"

    def call_lock(self, rollout_id: str, call_id: str) -> str:
        return f"{self.prefix}rollout:{rollout_id}:lock:call:{call_id}"

    def ticket(self, rollout_id: str, call_id: str) -> str:
        return f"{self.prefix}rollout:{rollout_id}:run:{call_id}"

    def closing(self, rollout_id: str) -> str:
        """String: held by the one close that ends the rollout (its sandbox destroyed or
        recycled, its slot released: once)."""
        return f"{self.prefix}rollout:{rollout_id}:closing"

    def starting(self, rollout_id: str) -> str:
        return f"{self.prefix}rollout:{rollout_id}:starting"

    def grading(self, rollout_id: str) -> str:
        return f"{self.prefix}rollout:{rollout_id}:grading"

    def e2b_pid(self, rollout_id: str) -> str:
        return f"{self.prefix}rollout:{rollout_id}:e2b:pid"

    def e2b_processes(self, rollout_id: str) -> str:
        return f"{self.prefix}rollout:{rollout_id}:e2b:processes"

    def e2b_watchers(self, rollout_id: str) -> str:
        """Hash: watcher id -> a directory watcher of the sandbox (state/e2b.E2BWatchers)."""
        return f"{self.prefix}rollout:{rollout_id}:e2b:watchers"

    # Rollouts, deployment-wide.

    @cached_property
    def live(self) -> str:
        """Sorted set: rollouts not ended yet (score: last activity, state/records.py)."""
        return f"{self.prefix}rollouts:live"

    @cached_property
    def index(self) -> str:
        """Sorted set: every rollout (score: its creation time), the listing's index."""
        return f"{self.prefix}rollouts:index"

    @cached_property
    def infra_failures(self) -> str:
        """List: the latest infrastructure failures, newest first, capped."""
        return f"{self.prefix}infra-failures"

    # Hosts.

    @cached_property
    def hosts(self) -> str:
        """Set: every worker host that ever beat in this deployment."""
        return f"{self.prefix}hosts"

    def heartbeat(self, host_id: str) -> str:
        """String: a host's latest heartbeat (state/heartbeat.py), expiring three beats on."""
        return f"{self.prefix}worker:{host_id}"

    @cached_property
    def silent_since(self) -> str:
        """Hash: host -> when the reaper first found it silent."""
        return f"{self.prefix}hosts:silent-since"

    # Slots and admission (state/admission.py).

    @cached_property
    def load(self) -> str:
        """Hash: host -> slots held (sandboxes, pool sandboxes included)."""
        return f"{self.prefix}host-rollouts"

    @cached_property
    def transit(self) -> str:
        """Sorted set: slots held by sandboxes no record or pool list shows yet."""
        return f"{self.prefix}slots-in-transit"

    @cached_property
    def waiting(self) -> str:
        """Sorted set: new rollouts waiting for a slot (scores: their deadlines)."""
        return f"{self.prefix}admission-waiting"

    @cached_property
    def waiting_groups(self) -> str:
        """Sorted set: groups with a rollout waiting for a slot (scores: the deadline of
        each one's first waiter, whose place its later waiters take)."""
        return f"{self.prefix}admission-waiting-groups"

    # Warm pools (state/pools.py).

    def pool(self, pool: str, part: str) -> str:
        """List ``ready`` (sandbox handles), string ``pending`` (creations reserved),
        string ``out`` (sandboxes its rollouts hold, which recycling may bring back), sorted
        set ``recycling`` (ids of sandboxes being reset for it, scored by when to stop
        counting them) or string ``awaiting`` (new rollouts waiting for one of those)."""
        return f"{self.prefix}pool:{pool}:{part}"

    @cached_property
    def pools_stocked(self) -> str:
        """Set: the names of the pools given a ready list (state/pools.py): the reaper and
        ``orchestrator status`` list pools from it instead of scanning the keyspace, which
        holds every retained rollout record."""
        return f"{self.prefix}pools-stocked"

    @cached_property
    def pools_indexed(self) -> str:
        """String: set once :attr:`pools_stocked` holds the pools made before it existed."""
        return f"{self.prefix}pools-indexed"

    @cached_property
    def pool_members(self) -> str:
        """Set: sandbox ids lying in a pool (the orphan sweep spares them)."""
        return f"{self.prefix}pool-members"

    def pool_claim(self, sandbox_id: str) -> str:
        """String: the rollout that took this pool sandbox."""
        return f"{self.prefix}pool-claim:{sandbox_id}"

    @cached_property
    def pool_demand(self) -> str:
        """Hash: pool name -> its recent demand (state/pool_sizing.PoolDemand JSON)."""
        return f"{self.prefix}pool-demand"

    @cached_property
    def pools_out_changes(self) -> str:
        """String: how many pool claims and returns there have been; the reaper's recount of
        what pools' rollouts hold applies only when none came during its pass."""
        return f"{self.prefix}pools-out-changes"

    @cached_property
    def reaper_pass(self) -> str:
        """String: when the reaper last finished a pass (Unix seconds): the reaper-down
        alert's source (state/collector.py)."""
        return f"{self.prefix}reaper-last-pass"

    @cached_property
    def state_mark(self) -> str:
        """String: a random id set once, by the first process that finds it missing, and
        never expired: while it is there, Redis holds the deployment's state. Missing, or
        another one than a worker last saw, means Redis lost its state (a restart without
        its files, a failover to an empty replica): the worker then ends what it holds
        that Redis no longer knows before it takes new sandboxes (queue/worker.py)."""
        return f"{self.prefix}state-mark"

    @cached_property
    def reaper_lease(self) -> str:
        """String: the reaper process that runs the passes (its holder id), with a TTL it
        renews every pass: of several reapers one reaps, the others stand by
        (rollouts/reaper.Reaper)."""
        return f"{self.prefix}reaper-lease"

    @cached_property
    def pool_refill_requested(self) -> str:
        """String: a refill was asked for lately (one ask per interval, not per take)."""
        return f"{self.prefix}pool-refill-requested"

    # Graders.

    def verdict(self, digest: str) -> str:
        """JSON string: a judge's verdict kept under the digest of what it was asked
        (grading/judge.py), so a retried grade neither pays for nor gets another one."""
        return f"{self.prefix}verdict:{digest}"

    def grader_slots(self, name: str) -> str:
        """Sorted set: the holders of the deployment's slots called ``name`` (calls to one
        judge model), each scored by when its hold lapses (Redis's clock, ms)."""
        return f"{self.prefix}grader-slots:{name}"

    # Repositories (state/repos.py).

    @cached_property
    def repos(self) -> str:
        """Hash: registered repository name -> its record (JSON), written by `orchestrator
        repo add` and read when a row names a repository."""
        return f"{self.prefix}repos"

    # Snapshots (state/snapshots.py).

    @cached_property
    def snapshots(self) -> str:
        """Hash: snapshot id -> its record (JSON); a snapshot's files are on its host
        (sandbox/docker/snapshots.py), which sweeps those no longer here."""
        return f"{self.prefix}snapshots"

    def output_stream(self, rollout_id: str, call_id: str) -> str:
        """List: a client command's output pieces as printed (state/streams.py)."""
        return f"{self.prefix}out:{rollout_id}:{call_id}"

    def group_setup(self, key: str) -> str:
        """String: a group's set-up (state/snapshots.GroupSetup, JSON), for as long as its
        snapshot serves the group; ``key`` names the environment and the group."""
        return f"{self.prefix}group-setup:{key}"

    def group_setup_lease(self, key: str) -> str:
        """String: held by the one API process setting a group up."""
        return f"{self.prefix}group-setup-lease:{key}"

    def tenant_sandboxes(self, tenant: str) -> str:
        """Sorted set: the rollouts of ``tenant`` holding (or making) a sandbox, scored by
        when each took it (state/quotas.py)."""
        return f"{self.prefix}tenant:{tenant}:sandboxes"

    def tenant_warm(self, tenant: str) -> str:
        """Sorted set: the rollouts of ``tenant`` holding a sandbox taken from a pool,
        scored by when each took it (state/quotas.py, ``warm_sandboxes``)."""
        return f"{self.prefix}tenant:{tenant}:warm"

    def tenant_bucket(self, tenant: str, kind: str) -> str:
        """Hash: ``tenant``'s token bucket of ``kind`` (creations, calls): tokens, at."""
        return f"{self.prefix}tenant:{tenant}:bucket:{kind}"

    def tenant_waiting(self, tenant: str) -> str:
        """Sorted set: ``tenant``'s rollouts waiting for a slot, scored as in ``waiting``
        (state/admission.py: its fair share)."""
        return f"{self.prefix}tenant:{tenant}:waiting"

    @cached_property
    def tenant_prefix(self) -> str:
        """What a tenant's keys start with (admission's script reads each waiting tenant's
        held and waiting sets by name)."""
        return f"{self.prefix}tenant:"

    @cached_property
    def waiting_tenants(self) -> str:
        """Set: the tenants that may have rollouts waiting for a slot."""
        return f"{self.prefix}waiting-tenants"

    @cached_property
    def tenants_seen(self) -> str:
        """Set: every tenant that has held a sandbox (the state gauges list them)."""
        return f"{self.prefix}tenants"

    @cached_property
    def audit(self) -> str:
        """Stream: the audit log, what changed the deployment, who and when (state/audit.py),
        capped at AUDIT_KEEP entries."""
        return f"{self.prefix}audit"

    def audit_once(self, digest: str) -> str:
        """String: held by the one process that records a change every process saw (each
        API process reads the tenants file again by itself)."""
        return f"{self.prefix}audit-once:{digest}"

    def repo_commits(self, name: str) -> str:
        """Hash: commit -> its set-up image ('' none), for each commit of repository
        ``name`` a host has found in it (no host need be asked again)."""
        return f"{self.prefix}repo-commits:{name}"

    # Queues.

    def reply(self, token: str) -> str:
        """List: the one reply to one queued task (state/replies.py)."""
        return f"{self.prefix}reply:{token}"

    def host_queue(self, host_id: str) -> str:
        """The Celery queue of one worker host: calls go to the host holding the sandbox."""
        return f"orch.{self.deployment}.host.{host_id}"

    @cached_property
    def shared_queue(self) -> str:
        """The Celery queue any worker takes from (the reaper, pool refills)."""
        return f"orch.{self.deployment}.shared"

    # Connections.

    def client_name(self, role: str) -> str:
        """What a connection of ``role`` (api, worker, heartbeat, broker, reaper, metrics,
        cli) calls itself (CLIENT SETNAME): ``CLIENT LIST`` shows who holds what, and a
        test counts each side's round trips by it (tests/e2e/test_round_trips.py)."""
        return f"orch:{self.deployment}:{role}"


def deployment_patterns(deployment: str) -> list[str]:
    """``SCAN MATCH`` patterns of every key ``deployment`` leaves in Redis: its own keys, its
    Celery queues and kombu's bindings of them (kept by kombu with no expiry). A
    ``deployment`` ending in ``*`` covers every deployment whose name starts with the rest
    (the test suite's runs: ``test-<run>-*``)."""
    queues = f"orch.{deployment}" if deployment.endswith("*") else f"orch.{deployment}.*"
    return [
        f"orch:{deployment}" if deployment.endswith("*") else f"orch:{deployment}:*",
        queues,
        f"_kombu.binding.{queues}",
        f"_kombu.binding_permanent.{queues}",
    ]


def queue_depth_keys(queue: str) -> list[str]:
    """The Redis lists kombu keeps one Celery queue's waiting messages in (one per
    priority step: the queue's own name, then siblings with kombu's separator)."""
    return [queue if step == 0 else f"{queue}{Channel.sep}{step}" for step in PRIORITY_STEPS]
