"""The one settings object: every knob, read from ``ORCH_*`` environment variables."""

from __future__ import annotations

import ipaddress
import re
import socket
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

GRADER_SECRET = re.compile(r"[A-Za-z0-9_-]+")
"""What a grader URL secret may hold: it is one path segment."""

Runtime = Literal["runc", "runsc", "kata"]
"""runc (containers), runsc (gVisor), kata (a VM per sandbox; Kubernetes backend only)."""


class Settings(BaseSettings):
    """Deployment-wide settings. Each field maps to ``ORCH_<FIELD>`` (case-insensitive)."""

    model_config = SettingsConfigDict(env_prefix="ORCH_", extra="ignore")

    deployment: str = Field(
        "default",
        pattern=r"^[a-z0-9][a-z0-9-]{0,40}$",
        description="Name stamped on every sandbox; the reaper only touches its own.",
    )
    state_dir: Path = Field(
        Path("/var/lib/orchestrator"),
        description="Host directory for per-sandbox exec-agent sockets and build scratch.",
    )
    host_id: str = Field(
        default_factory=socket.gethostname,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
        description="This worker host's name: its sandboxes' label and its queue's name.",
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description=(
            "Broker, results, state: `redis://`, `rediss://` (TLS), `unix://`, or "
            "`redis+sentinel://[:password@]host:port[,host:port...]/<service>[/<db>]`, a "
            "primary watched by Redis Sentinel and followed across a failover "
            '(docs/failure-model.md, "Redis failover").'
        ),
    )
    redis_replicas_to_wait: int = Field(
        0,
        ge=0,
        le=8,
        description=(
            "Behind Sentinel: how many replicas must hold a worker's claim of a call "
            "before its command runs, and its result before the caller is told (Redis "
            "WAIT in the same round trip), so that a failover to one of them keeps both "
            "and no call runs twice. 0: none (a single Redis). With 1, keep two "
            "replicas: while none answers, calls wait (docs/failure-model.md, "
            '"Redis failover", says what WAIT does not promise).'
        ),
    )
    api_host: str = Field("127.0.0.1", description="Address the API binds to.")
    api_port: int = Field(8000, ge=1, le=65535, description="Port the API listens on.")
    api_workers: int = Field(1, ge=1, le=64, description="API processes (uvicorn workers).")
    api_metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Where a scraper reads the API's /metrics with no token: a listener of "
        "its own on api_metrics_host, never the port trainers reach. 0: none, and /metrics "
        "on the API's port answers the operator's tokens only.",
    )
    api_metrics_host: str = Field("127.0.0.1", description="Address api_metrics_port binds.")
    api_forwarded_allow_ips: str = Field(
        "127.0.0.1",
        description="Proxies whose X-Forwarded-For names the client (uvicorn's "
        "forwarded_allow_ips: comma-separated addresses or CIDRs, `*` for any). Behind a load "
        "balancer or an ingress, list it: a client is then counted by its own address, "
        "not the proxy's, for the lock-out of guessing (auth_failures_max) and in logs.",
    )
    api_tokens: str = Field(
        "",
        description="Comma-separated bearer tokens of the operator (tenant `default`, who "
        "sees every tenant's things), each the token or its digest `sha256:<hex>` "
        "(`orchestrator tenants token`). This or a tenants file is required.",
    )
    tenants_file: Path | None = Field(
        None,
        description="YAML file of tenants, their tokens' digests and their quotas "
        "(docs/tenancy.md); read again when it changes, so tokens are added and revoked "
        "without a restart.",
    )
    auth_failures_max: int = Field(
        20,
        ge=1,
        description="Failed authentications from one client address within "
        "auth_failures_window_s, after which its requests get 429 until the window ends "
        "(each API process counts its own).",
    )
    auth_failures_window_s: float = Field(60.0, gt=0, description="See auth_failures_max.")
    grader_url_secret: str = Field(
        "",
        description="When set, the endpoint grader is also served at "
        "/agent-rft/grade/<secret> without a bearer token, for Agent RFT platforms whose "
        "endpoint grader sends no header (Azure's, for now). At least 32 characters; "
        "`orchestrator up` makes one. Treat the URL as a credential.",
    )
    max_request_bytes: int = Field(1024 * 1024, description="Larger bodies get 413.")
    worker_concurrency: int = Field(64, ge=1, description="Threads per worker process.")
    grade_threads: int = Field(
        64,
        ge=1,
        le=4096,
        description="Grades one API process runs at once (graders run in threads of their "
        "own: a judge's or a sandbox's tests' wait never holds up the threads a rollout's "
        "start needs). More grades wait for a thread.",
    )
    queue_wait_s: float = Field(
        30.0, gt=0, description="How long a call waits for a worker beyond its own timeout."
    )
    heartbeat_interval_s: float = Field(
        5.0, gt=0, description="How often each worker publishes its heartbeat, in seconds."
    )
    reaper_interval_s: float = Field(
        10.0,
        gt=0,
        description="How often the reaper passes (idle, expired and orphaned rollouts and "
        "sandboxes; dead hosts), in seconds.",
    )
    sandbox_create_timeout_s: float = Field(
        300.0,
        gt=0,
        description="A new rollout's wait for its sandbox, the creation lane's queue included"
        " (a burst of cold starts queues there for tens of seconds).",
    )
    worker_shutdown_grace_s: float = Field(
        30.0, ge=0, description="On SIGTERM, how long running calls may take to finish."
    )
    host_max_sandboxes: int = Field(
        512, ge=1, description="A host holding this many sandboxes takes no new ones."
    )
    sandbox_reuse: bool = Field(
        True,
        description="A sandbox whose rollout ended cleanly is reset, audited and returned to "
        "its warm pool instead of destroyed (Docker backend; an environment's reuse "
        "overrides it; docs/architecture.md, Recycling).",
    )
    pool_autosize: bool = Field(
        True,
        description="Warm pools follow demand: each (environment, codebase) keeps ready the "
        "peak of its live rollouts over pool_demand_window_s plus pool_headroom (or its "
        "expected_concurrency before any is seen); false: only a hand-set pool_size.",
    )
    pool_demand_window_s: float = Field(
        900.0,
        gt=0,
        description="How long a pool keeps the size of its last peak (a training step's "
        "gap between two bursts fits in it).",
    )
    pool_headroom: float = Field(
        0.1, ge=0, description="A demand-sized pool keeps this fraction more than its peak."
    )
    pool_max_sandboxes: int = Field(
        512,
        ge=0,
        description="The most ready sandboxes one demand-sized pool keeps (each also needs "
        "a host slot: host_max_sandboxes and free memory bound them further).",
    )
    pool_recycle_wait_s: float = Field(
        60.0,
        ge=0,
        description="How long a new rollout that finds its pool empty waits, at most, for a "
        "sandbox being reset for that pool (recycling; one waiter per reset; it stops "
        "waiting as soon as no reset is left) before it takes a cold one; 0: never waits. "
        "Resets are queued ahead of the cold creates that would follow, so the wait "
        "costs a waiter no place.",
    )
    host_min_free_disk_mb: int = Field(
        2048, ge=0, description="A host with less free disk under state_dir takes no new ones."
    )
    host_unhealthy_after: int = Field(
        3, ge=1, description="Failed daemon probes in a row before a host's rollouts fail."
    )
    host_min_free_memory_mb: int = Field(
        1024, ge=0, description="A host with less available memory takes no new sandboxes."
    )
    admission_wait_s: float = Field(
        180.0, ge=0, description="How long a new rollout waits for capacity before 503/429."
    )
    admission_queue_max: int = Field(
        1024, ge=0, description="New rollouts that may wait for capacity at once."
    )
    admission_retry_after_s: float = Field(
        5.0, gt=0, description="Retry-After of a rollout refused at capacity."
    )
    create_concurrency: int = Field(
        4, ge=1, description="Sandboxes a worker creates at once for rollouts waiting for one."
    )
    pool_fill_concurrency: int = Field(
        1,
        ge=1,
        description="Sandboxes a worker creates at once to refill warm pools (only while no "
        "rollout waits for one): few, so running rollouts' calls keep their share of the CPU.",
    )
    background_yield_s: float = Field(
        30.0,
        ge=0,
        description="How long a pool refill's creation and a recycled sandbox's reset wait, "
        "at most, for this host's tool calls to pause (none for 0.3 s): live calls first "
        "(a reset a new rollout waits for goes at once); 0: they never wait.",
    )
    agent_rft_call_bound_s: float = Field(
        600.0,
        gt=0,
        description="How long Agent RFT waits for one tool call or grade before it gives up "
        "(its documentation: 10 minutes). Commands of Agent RFT calls are capped, and a "
        "rollout's first call waits for its sandbox, so that every call answers within it.",
    )
    agent_rft_call_margin_s: float = Field(
        30.0, ge=0, description="Kept free of agent_rft_call_bound_s (network, the platform)."
    )
    host_lost_after_s: float = Field(
        30.0, gt=0, description="A host silent this long has its rollouts marked infra_failed."
    )

    e2b_output_mb: int = Field(
        4,
        ge=1,
        le=64,
        description="E2B API: the most of a command's stdout (and of its stderr) given back "
        "whole, in MB; past it the head and tail are kept (docs/e2b.md).",
    )
    e2b_file_max_mb: int = Field(
        16,
        ge=1,
        le=32,
        description="E2B API: the largest file read or written in one request, in MB.",
    )
    e2b_default_timeout_s: int = Field(
        300, ge=1, description="E2B API: a new sandbox's timeout when the client gives none."
    )
    e2b_paused_keep_s: int = Field(
        86400,
        ge=60,
        description="E2B API: how long a paused sandbox is kept (its snapshot, its record); "
        "past it the reaper ends it.",
    )

    docker_host: str | None = Field(
        None, description="Docker daemon URL; None means DOCKER_HOST or the local socket."
    )
    docker_runc_runtime: Literal["crun", "runc"] = Field(
        "crun",
        description="The OCI runtime of runtime 'runc' (container) sandboxes on the Docker "
        "backend: crun, the same containers from a C runtime at a fraction of runc's CPU per "
        "create, or runc. crun is used only when dockerd has it registered, else runc.",
    )
    docker_workspace_mount: Literal["host", "docker"] = Field(
        "host",
        description="Who mounts a runc/crun sandbox's /workspace on the Docker backend: host "
        "(the worker, on a directory the container binds with rslave propagation; a reset "
        "for another rollout keeps the container running) or docker (a volume Docker mounts; "
        "a reset restarts the container). host needs dockerd in the worker's mount namespace "
        "(a create says so when it is not). gVisor sandboxes always use docker.",
    )

    docker_daemon_cpu_weight: int = Field(
        0,
        ge=0,
        le=10000,
        description="The CPU weight (cgroup cpu.weight's scale: 100 is any other process's) "
        "the worker gives its dockerd and containerd, which do sandboxes' creates, restarts "
        "and destroys: while a burst is seated, running rollouts' calls keep more of the "
        "CPU. 0 (the default) leaves the daemons as they are: at 10, a host saturated by "
        "other work starved dockerd until probes failed (docs/operations.md).",
    )

    base_os_image: str = Field(
        "debian:bookworm-slim",
        description="FROM of the base sandbox image; made with debootstrap when unpullable.",
    )
    debian_mirror: str = Field(
        "http://deb.debian.org/debian",
        description="Debian mirror debootstrap builds the sandbox base image from.",
    )
    debian_suite: str = Field("bookworm", description="Debian suite of the sandbox base image.")
    base_image: str = Field("orchestrator/sandbox-base:latest", description="Base sandbox image.")
    codebase_image_repo: str = Field(
        "orchestrator/codebase", description="Repository for codebase images (tag = name)."
    )
    codebases_file: Path | None = Field(
        None,
        description="YAML map of codebase name to image reference (relative to "
        "k8s_image_registry, e.g. 'orchestrator/codebase@sha256:...'). When set, codebases "
        "are looked up here instead of in the Docker daemon (Kubernetes: the API has no "
        "daemon); `orchestrator codebase publish` prints the entry to add.",
    )
    repo_allowed_urls: str = Field(
        "",
        description="Comma-separated URL prefixes a repository may be registered from "
        "(`orchestrator repo add`), e.g. 'https://github.com/psf/,https://git.example.com/'. "
        "Empty: local paths only. Checked again by every host that fetches one.",
    )
    repo_layers_mb: int = Field(
        20480,
        ge=1,
        description="Disk each repository's materialised commits may take on a host (their "
        "overlay layers, not its object store); past it the least recently used commits go "
        "(docs/datasets.md).",
    )

    egress_dns_servers: str = Field(
        "",
        description="Comma-separated DNS servers (address, or address#port) that resolve the "
        "names an egress policy allows; empty: the sandbox host's /etc/resolv.conf "
        "(docs/egress.md).",
    )
    egress_subnets: str = Field(
        "10.231.0.0/16",
        description="Addresses of egress networks: each policy in use on a host takes a /22 "
        "of it (1,021 sandboxes). Must not overlap the host's other networks.",
    )
    egress_network_idle_s: int = Field(
        600,
        ge=0,
        description="An egress network no sandbox used for this long is removed (its bridge, "
        "rules and DNS server); the next sandbox of its policy makes it again (~0.2 s).",
    )

    sandbox_backend: Literal["docker", "kubernetes"] = Field(
        "docker",
        description="Where sandboxes run: containers on this host's dockerd, or pods on a "
        "Kubernetes cluster (see docs/kubernetes-backend.md).",
    )
    k8s_namespace: str = Field(
        "orchestrator-sandboxes",
        pattern=r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$",
        description="Namespace the sandbox pods (and their Secrets) live in.",
    )
    k8s_image_registry: str = Field(
        "",
        description="Prefix put in front of sandbox image names so the cluster can pull them "
        "(e.g. 'registry.example.com/team/'); '' uses the images as named.",
    )
    k8s_image_pull_secret: str = Field(
        "", description="Name of an imagePullSecret for sandbox pods; '' for none."
    )
    k8s_runtime_classes: dict[str, str] = Field(
        default_factory=lambda: {"runc": "", "runsc": "gvisor", "kata": "kata"},
        description="Runtime -> runtimeClassName of sandbox pods (JSON); '' sets none (the "
        "node's default runtime).",
    )
    k8s_agent_port: int = Field(
        7070, ge=1, le=65535, description="TCP port the in-sandbox exec agent listens on."
    )
    k8s_pending_timeout_s: float = Field(
        300.0,
        gt=0,
        description="A sandbox pod not Ready within this is an infrastructure failure.",
    )
    k8s_node_selector: dict[str, str] = Field(
        default_factory=dict, description="nodeSelector of sandbox pods (JSON)."
    )

    sandbox_runtime: Runtime = Field(
        "runc",
        description="Default sandbox runtime: runc (containers), runsc (gVisor) or kata "
        "(Kubernetes only); an environment's runtime overrides it.",
    )
    sandbox_memory_mb: int = Field(
        1024, ge=64, description="Default memory limit of a sandbox, in MB."
    )
    sandbox_cpus: float = Field(1.0, gt=0, description="Default CPU limit of a sandbox, in CPUs.")
    sandbox_pids: int = Field(
        256, ge=16, description="Default process limit of a sandbox (all its processes)."
    )
    sandbox_tmp_mb: int = Field(
        256, ge=1, description="Size of a sandbox's /tmp (memory-backed), in MB."
    )
    sandbox_lifetime_s: int = Field(
        14400,
        ge=10,
        description="A rollout's (and its sandbox's) hard lifetime, in seconds: past it the "
        "rollout ends and a later call or grade is a 503 (lifetime_exceeded). Far above any "
        "real episode (minutes); abandoned rollouts end sooner, at their idle timeout.",
    )
    sandbox_start_timeout_s: float = Field(
        20.0,
        gt=0,
        description="A started sandbox whose exec agent does not answer within "
        "this is a failed creation, in seconds.",
    )
    sandbox_disk_mb: int = Field(
        2048,
        ge=0,
        description="Cap on a sandbox's writes under /workspace (its own sparse ext4 image, "
        "loop-mounted); 0 leaves them uncapped, on state_dir's filesystem.",
    )
    sandbox_output_mb: int = Field(
        64,
        ge=1,
        description="A command whose output (stdout and stderr together) exceeds this is "
        "killed; the model sees only the output budget's head and tail of it anyway.",
    )

    command_timeout_s: float = Field(30.0, gt=0, description="Default per-command timeout.")
    command_timeout_max_s: float = Field(
        600.0, gt=0, description="Upper bound on any one command's timeout, in seconds."
    )
    output_budget_bytes: int = Field(16 * 1024, ge=256, description="Per tool-output budget.")
    read_file_max_bytes: int = Field(
        64 * 1024, ge=256, description="Most bytes one read_file call returns."
    )

    environments_file: Path | None = Field(
        None,
        description="YAML file of environments; None means the packaged default "
        "(orchestrator/environments/default.yaml).",
    )
    default_environment: str = Field(
        "codebase-planning", description="Environment of a dataset row that names none."
    )

    log_format: Literal["console", "json"] = Field(
        "console",
        description="console: readable lines for a terminal; json: one JSON object per line "
        "(production; the Helm chart sets it).",
    )
    log_level: str = Field("INFO", description="Lowest level logged (DEBUG, INFO, WARNING...).")
    asyncio_debug: bool = Field(
        False,
        description="Run the API's event loop in asyncio's debug mode: every callback that "
        "holds the loop over asyncio_slow_callback_s is logged (asyncio's 'Executing ... "
        "took' warning). Slow; for finding what blocks the loop, never for production.",
    )
    asyncio_slow_callback_s: float = Field(
        0.1,
        gt=0,
        description="With asyncio_debug: how long a callback may hold the loop before it is "
        "logged (asyncio's slow_callback_duration). On a shared VM the hypervisor alone can "
        "stall a busy guest for 100 ms and more.",
    )
    worker_metrics_port: int = Field(
        9109,
        ge=0,
        le=65535,
        description="Port a worker process serves its own Prometheus metrics on (/metrics); "
        "0 disables. A port already taken is logged and skipped, not fatal.",
    )
    reaper_metrics_port: int = Field(
        9110,
        ge=0,
        le=65535,
        description="Port the reaper process serves its own Prometheus metrics on "
        "(/metrics: sandboxes reaped, rollouts it failed); 0 disables.",
    )
    worker_metrics_host: str = Field(
        "127.0.0.1",
        description="Address the worker's and the reaper's metrics endpoints bind (0.0.0.0: all).",
    )

    @property
    def reaper_alive_file(self) -> Path:
        """The file a reaper touches after every try at a pass, lease held or not: its
        liveness (the chart's files/probes/reaper_probe.py reads its age)."""
        return self.state_dir / f"reaper-{self.deployment}.alive"

    @property
    def sockets_dir(self) -> Path:
        """Per-sandbox socket directories of this deployment (deployments may share a
        state_dir; each sweeps only its own)."""
        return self.state_dir / "run" / self.deployment

    @field_validator("egress_subnets")
    @classmethod
    def _egress_subnets_valid(cls, value: str) -> str:
        try:
            pool = ipaddress.IPv4Network(value.strip())
        except ValueError as exc:
            raise ValueError(f"an IPv4 network such as 10.231.0.0/16: {exc}") from None
        if pool.prefixlen > 22:
            raise ValueError("at least a /22: each egress network takes one")
        return str(pool)

    @field_validator("grader_url_secret")
    @classmethod
    def _secret_long_enough(cls, value: str) -> str:
        if value and (len(value) < 32 or not GRADER_SECRET.fullmatch(value)):
            raise ValueError(
                "must be at least 32 characters of [A-Za-z0-9_-] (a URL path segment); "
                "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        return value

    @property
    def repos_dir(self) -> Path:
        """This deployment's repositories on this host: object stores and commit layers
        (sandbox/repos.py); a name means one source in one deployment only."""
        return self.state_dir / "repos" / self.deployment

    @property
    def repo_url_prefixes(self) -> list[str]:
        return [u.strip() for u in self.repo_allowed_urls.split(",") if u.strip()]

    @property
    def tokens(self) -> list[str]:
        return [t.strip() for t in self.api_tokens.split(",") if t.strip()]

    def with_command_cap(self, cap_s: float | None) -> Settings:
        """These settings with no command timeout above ``cap_s`` (None: as they are): the
        bound one call was sent with (Agent RFT's), applied by the worker that runs it."""
        if cap_s is None or cap_s >= self.command_timeout_max_s:
            return self
        return self.model_copy(
            update={
                "command_timeout_max_s": cap_s,
                "command_timeout_s": min(self.command_timeout_s, cap_s),
            }
        )


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Process-wide settings, read once."""
    return Settings()
