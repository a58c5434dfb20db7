"""CPU seconds per sandbox create, reset and destroy, by process, variants side by side in
one run.

    python -m bench.create_cost [--creates 30] [--rounds 3] [--variants ...]
                                [--image base|codebase]

Each round runs every variant in turn: N sandboxes created one after the other through
DockerBackend (as bench.exec_latency's bench_create does, but all kept), then each reset
for another rollout (DockerBackend.reset, audited: in place where the host mounts
/workspace, by a restart of the container otherwise; not for variants running the agent
from before the reset existed), then destroyed one after the other. Each phase is metered
as a whole and divided by N.

Where the CPU goes, by process:

- dockerd, containerd, the sandboxes' containerd-shims, the kernel's threads (loop
  devices' workers among them) and this process: utime + stime from /proc/<pid>/stat.
- Short-lived children of the daemons (runc or crun invocations, `containerd-shim start`,
  shims that exited): on cgroup v1 the daemons are moved, for the run only, into a cpuacct
  cgroup of their own (cpuacct is mounted alone here, so nothing about scheduling
  changes; they are moved back at the end); its usage less what the live processes in it
  used is theirs.
- This process's own children (mkfs.ext4, mount, umount): likewise a cpuacct cgroup of
  its own, less its threads' utime + stime.
- The sandboxes themselves (docker-init, the exec agent): their containers' cgroups.
- other: the host's busy time (/proc/stat) less all the above: other tenants, interrupts.

Prints a table; writes bench/results/create_cost.json and .md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker

from bench.common import (
    CLK_TCK,
    container_cpu_s,
    ensure_bench_codebase,
    host_busy_s,
    summary,
    write_report,
)
from orchestrator.config import Runtime, Settings
from orchestrator.images.base import build_base_image
from orchestrator.sandbox import labels
from orchestrator.sandbox.agent import AGENT_MODULES
from orchestrator.sandbox.backend import SandboxHandle, SandboxSpec
from orchestrator.sandbox.docker.backend import DockerBackend
from orchestrator.sandbox.egress import EgressPolicy

AGENT_IN_REPO = "orchestrator/sandbox/agent/exec_agent.py"
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
METER = CPUACCT / "orch-create-cost"
DAEMONS = ("dockerd", "containerd")
ROLES = (
    "dockerd",
    "containerd",
    "containerd-shim (live)",
    "short-lived daemon children (runc/crun, shim start, exited shims)",
    "bench client (python)",
    "bench children (mkfs.ext4, mount, umount)",
    "kernel threads",
    "sandboxes (in container)",
    "other (rest of host)",
)


@dataclass
class Proc:
    comm: str
    started: int  # clock ticks after boot: tells a reused pid from the same process
    own_s: float
    ppid: int
    cgroup: str
    shim_id: str = ""


@dataclass
class Snapshot:
    busy_s: float
    procs: dict[int, Proc]
    daemons_s: float | None
    bench_s: float | None
    sandboxes: dict[str, float] = field(default_factory=dict)


def _read_proc(pid: int) -> Proc | None:
    base = Path(f"/proc/{pid}")
    try:
        stat = (base / "stat").read_text()
        cgroups = (base / "cgroup").read_text()
    except OSError:
        return None
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat.rsplit(")", 1)[1].split()
    cgroup = ""
    for line in cgroups.splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(","):
            cgroup = path
    shim_id = ""
    if comm.startswith("containerd-shim"):
        with suppress(OSError, ValueError, IndexError):
            argv = (base / "cmdline").read_bytes().split(b"\0")
            shim_id = argv[argv.index(b"-id") + 1].decode()
    # fields[1] is the ppid; 11 and 12 are utime and stime (children not included); 19 is
    # the start time. A kernel thread's comm changes with its work item: not an identity.
    own_s = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return Proc(comm, int(fields[19]), own_s, int(fields[1]), cgroup, shim_id)


def _usage_s(group: Path) -> float | None:
    try:
        return int((group / "cpuacct.usage").read_text()) / 1e9
    except (OSError, ValueError):
        return None


class Meter:
    """Snapshots of the host's CPU accounting, and what a phase between two of them cost."""

    def __init__(self, client: docker.DockerClient, deployment: str) -> None:
        self.client = client
        self.deployment = deployment
        self.me = os.getpid()

    @contextmanager
    def cgroups(self) -> Iterator[bool]:
        """The daemons and this process in cpuacct cgroups of their own while the block
        runs (cgroup v1 with cpuacct mounted alone); yields whether that worked."""
        if not (CPUACCT / "cgroup.procs").exists():
            yield False
            return
        moved = False
        try:
            for name in ("daemons", "bench"):
                (METER / name).mkdir(parents=True, exist_ok=True)
            for pid, proc in self._all().items():
                if proc.comm in DAEMONS:
                    (METER / "daemons" / "cgroup.procs").write_text(str(pid))
            (METER / "bench" / "cgroup.procs").write_text(str(self.me))
            moved = True
        except OSError as exc:
            print(f"cpuacct cgroups unavailable ({exc}): short-lived processes go to 'other'")
        try:
            yield moved
        finally:
            for name in ("daemons", "bench"):
                group = METER / name
                with suppress(OSError):
                    for task in (group / "cgroup.procs").read_text().split():
                        with suppress(OSError):
                            (CPUACCT / "cgroup.procs").write_text(task)
                with suppress(OSError):
                    group.rmdir()
            with suppress(OSError):
                METER.rmdir()

    def _all(self) -> dict[int, Proc]:
        found: dict[int, Proc] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                proc = _read_proc(int(entry.name))
                if proc is not None:
                    found[int(entry.name)] = proc
        return found

    def ours(self) -> set[str]:
        """Full ids of this deployment's containers (outside a metered phase: it asks dockerd)."""
        found = self.client.api.containers(
            all=True, filters={"label": labels.deployment_filter(self.deployment)}, quiet=True
        )
        return {c["Id"] for c in found}

    def snapshot(self, containers: set[str]) -> Snapshot:
        return Snapshot(
            busy_s=host_busy_s(),
            procs=self._all(),
            daemons_s=_usage_s(METER / "daemons"),
            bench_s=_usage_s(METER / "bench"),
            sandboxes={c: container_cpu_s(c) for c in containers},
        )

    def cost(self, before: Snapshot, after: Snapshot, ours: set[str]) -> dict[str, float]:
        used = dict.fromkeys(ROLES, 0.0)
        in_daemons = 0.0
        for pid, proc in after.procs.items():
            prior = before.procs.get(pid)
            delta = proc.own_s - (prior.own_s if prior and prior.started == proc.started else 0.0)
            if proc.cgroup == "/orch-create-cost/daemons":
                in_daemons += delta
            if pid == self.me:
                used["bench client (python)"] += delta
            elif proc.comm in DAEMONS:
                used[proc.comm] += delta
            elif proc.shim_id in ours:
                used["containerd-shim (live)"] += delta
            elif pid == 2 or proc.ppid == 2:
                used["kernel threads"] += delta
        if after.daemons_s is not None and before.daemons_s is not None:
            used[ROLES[3]] = max(0.0, after.daemons_s - before.daemons_s - in_daemons)
        if after.bench_s is not None and before.bench_s is not None:
            used[ROLES[5]] = max(
                0.0, after.bench_s - before.bench_s - used["bench client (python)"]
            )
        used["sandboxes (in container)"] = sum(
            max(0.0, after.sandboxes.get(c, 0.0) - before.sandboxes.get(c, 0.0))
            for c in before.sandboxes.keys() | after.sandboxes.keys()
        )
        busy = after.busy_s - before.busy_s
        used["other (rest of host)"] = busy - sum(used.values())
        used["total (host busy)"] = busy
        return used


@dataclass
class Variant:
    label: str
    runtime: Runtime
    backend: DockerBackend
    egress: EgressPolicy | None = None


def run_variant(meter: Meter, variant: Variant, image: str, n: int) -> dict[str, Any]:
    create_ms: list[float] = []
    reset_ms: list[float] = []
    destroy_ms: list[float] = []
    handles: list[SandboxHandle] = []
    backend = variant.backend
    spec = SandboxSpec.from_settings(
        backend.settings, image=image, runtime=variant.runtime, rollout_id="bench"
    ).model_copy(update={"egress": variant.egress})
    # The agent of the commit before the reset existed has no manifest to audit with.
    resettable = backend.agent_modules == AGENT_MODULES
    try:
        before = meter.snapshot(set())
        for _ in range(n):
            started = time.perf_counter()
            handles.append(backend.create(spec))
            create_ms.append((time.perf_counter() - started) * 1000)
        after = meter.snapshot(set())
        ours = meter.ours()  # after the snapshot: dockerd's work for it is not the creates'
        # The sandboxes' cgroups did not exist before: all their usage is the create's.
        after.sandboxes = {c: container_cpu_s(c) for c in ours}
        created = meter.cost(before, after, ours)
        reset: dict[str, float] = {}
        if resettable:
            # A reset for another rollout (recycling): kill, remake /workspace, start, audit.
            before = meter.snapshot(ours)
            before.sandboxes = {c: container_cpu_s(c) for c in ours}
            for handle in handles:
                started = time.perf_counter()
                report = backend.reset(handle, spec)
                reset_ms.append((time.perf_counter() - started) * 1000)
                if not report.clean:
                    raise RuntimeError(f"reset audit failed: {report.differences}")
            after = meter.snapshot(ours)
            after.sandboxes = {c: container_cpu_s(c) for c in ours}
            reset = meter.cost(before, after, ours)
        before = meter.snapshot(ours)
        while handles:
            handle = handles.pop()
            started = time.perf_counter()
            backend.destroy(handle)
            destroy_ms.append((time.perf_counter() - started) * 1000)
        after = meter.snapshot(ours)
        destroyed = meter.cost(before, after, ours)
    finally:
        for handle in handles:
            backend.destroy(handle)
    return {
        "create_cpu_s": created,
        "reset_cpu_s": reset,
        "destroy_cpu_s": destroyed,
        "create_ms": create_ms,
        "reset_ms": reset_ms,
        "destroy_ms": destroy_ms,
    }


PHASES = ("create", "reset", "destroy")

# The last commit before issue 13's cheaper cold starts: "before" runs its exec agent.
BASELINE_COMMIT = "bbd7e28"
# name -> (runtime, settings changed from the defaults, whether it runs the old agent).
# before: runc and the old agent; runc+agent: the new agent alone; now: crun and the new
# agent (the defaults: the host mounts /workspace, a reset keeps the container running);
# now-restart: now with Docker mounting /workspace, so a reset restarts the container (the
# reset before it could be done in place); now-nodisk: now with /workspace uncapped (what
# the ext4 cap costs at all, so the most a stock of ready-made images could save);
# runsc-*: gVisor.
VARIANTS: dict[str, tuple[Runtime, dict[str, Any], bool]] = {
    "before": ("runc", {"docker_runc_runtime": "runc"}, True),
    "runc+agent": ("runc", {"docker_runc_runtime": "runc"}, False),
    "now": ("runc", {}, False),
    "now-restart": ("runc", {"docker_workspace_mount": "docker"}, False),
    # What the ext4 cap costs at all: the most a stock of ready-made images could save.
    "now-nodisk": ("runc", {"sandbox_disk_mb": 0}, False),
    "runsc-before": ("runsc", {}, True),
    "runsc-now": ("runsc", {}, False),
    # now, on an egress policy's network (docs/egress.md): what a sandbox with network costs.
    "now-egress": ("runc", {}, False),
}
EGRESS = EgressPolicy(allow_cidrs=["192.0.2.0/24"])
"""now-egress's policy: an address block no one uses (TEST-NET-1), so nothing is reached;
the network, its rules and its resolver are made as for any policy."""


def baseline_agent() -> Path | None:
    """The exec agent as of BASELINE_COMMIT, from git (None outside a checkout)."""
    root = Path(__file__).resolve().parent.parent
    try:
        source = subprocess.run(
            ["git", "-C", str(root), "show", f"{BASELINE_COMMIT}:{AGENT_IN_REPO}"],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    path = Path(tempfile.mkdtemp(prefix="create-cost-")) / "exec_agent.py"
    path.write_bytes(source)
    path.parent.chmod(0o755)
    return path


def variants_for(
    names: list[str], settings: Settings, client: docker.DockerClient
) -> list[Variant]:
    available = client.info().get("Runtimes", {})
    found: list[Variant] = []
    old_agent = baseline_agent()
    for name in names:
        runtime, changes, old = VARIANTS[name]
        if runtime not in available:
            print(f"runtime {runtime} is not registered with dockerd: {name} skipped")
            continue
        backend = DockerBackend(settings.model_copy(update=changes))
        if old:
            if old_agent is None:
                print(f"no git history: {name} runs the current agent")
            else:
                backend.agent_modules = {"exec_agent": old_agent}
        found.append(Variant(name, runtime, backend, EGRESS if name == "now-egress" else None))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--creates", type=int, default=30, help="sandboxes per phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["before", "now", "now-restart"],
        choices=VARIANTS,
    )
    parser.add_argument("--image", choices=["base", "codebase"], default="base")
    args = parser.parse_args()

    deployment = f"costbench-{uuid.uuid4().hex[:6]}"
    settings = Settings(deployment=deployment)
    build_base_image(settings)
    image = settings.base_image if args.image == "base" else ensure_bench_codebase(settings)
    client = docker.from_env()
    variants = variants_for(args.variants, settings, client)
    meter = Meter(client, deployment)
    raw: dict[str, list[dict[str, Any]]] = {v.label: [] for v in variants}
    idle: dict[str, float] = {}
    with meter.cgroups() as isolated:
        for variant in variants:  # warm up: the image's lower layer, the daemon's caches
            run_variant(meter, variant, image, 2)
        before = meter.snapshot(set())
        time.sleep(2)
        idle = meter.cost(before, meter.snapshot(set()), set())
        for _ in range(args.rounds):
            for variant in variants:
                run = run_variant(meter, variant, image, args.creates)
                raw[variant.label].append(run)
    for variant in variants:  # the egress network, its rules and resolver
        variant.backend.egress.prune(idle_s=0)
    report: dict[str, Any] = {
        "image": image,
        "creates_per_phase": args.creates,
        "rounds": args.rounds,
        "cgroups_isolated": isolated,
        "idle_2s_cpu_s": {k: round(v, 3) for k, v in idle.items()},
        "variants": {label: aggregate(runs) for label, runs in raw.items()},
        "leftover_sandboxes": len(meter.ours()),
    }
    markdown = render(report)
    print(markdown)
    path = write_report("create_cost", report, markdown)
    print(f"\nwrote {path}")


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per sandbox: each role's median over the rounds (a round that another tenant of the
    machine disturbed moves a median less than a sum), and the wall times of all rounds."""
    out: dict[str, Any] = {"n": sum(len(r["create_ms"]) for r in runs)}
    for phase in PHASES:
        if not all(r.get(f"{phase}_cpu_s") for r in runs):
            continue  # not measured for this variant (a reset with the old agent)
        per_round = [
            {role: s / len(r["create_ms"]) for role, s in r[f"{phase}_cpu_s"].items()} for r in runs
        ]
        out[f"{phase}_cpu_s_per_sandbox"] = {
            role: round(statistics.median(p[role] for p in per_round), 4) for role in per_round[0]
        }
        out[f"{phase}_cpu_s_per_round"] = per_round
        out[f"{phase}_ms"] = summary([ms for r in runs for ms in r[f"{phase}_ms"]])
    return out


def render(report: dict[str, Any]) -> str:
    variants = report["variants"]
    labels_ = list(variants)
    lines = [
        f"## CPU-s per sandbox, by process (median of {report['rounds']} rounds of "
        f"{report['creates_per_phase']} sandboxes each, {report['image']})",
        "",
    ]
    for phase in PHASES:
        key = f"{phase}_cpu_s_per_sandbox"
        if not any(key in v for v in variants.values()):
            continue
        lines += [
            f"### per {phase}",
            "",
            "| process | " + " | ".join(labels_) + " |",
            "|---|" + "---|" * len(labels_),
        ]
        measured = [v[key] for v in variants.values() if key in v]
        for role in measured[0]:
            cells = [
                f"{variants[v][key][role]:.4f}" if key in variants[v] else "n/a" for v in labels_
            ]
            lines.append(f"| {role} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "## Wall time (ms)",
        "",
        "| variant | n | create p50 | create p99 | reset p50 | reset p99 | destroy p50 |"
        " destroy p99 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, v in variants.items():
        c, d = v["create_ms"], v["destroy_ms"]
        r = v.get("reset_ms") or {"p50": float("nan"), "p99": float("nan")}
        lines.append(
            f"| {label} | {v['n']} | {c['p50']:.1f} | {c['p99']:.1f} | {r['p50']:.1f} | "
            f"{r['p99']:.1f} | {d['p50']:.1f} | {d['p99']:.1f} |"
        )
    lines += [
        "",
        f"Idle host before the run (2 s): {report['idle_2s_cpu_s']['total (host busy)']} CPU-s"
        f" busy; daemons and this process in their own cpuacct cgroups: "
        f"{report['cgroups_isolated']}; sandboxes left after the run: "
        f"{report['leftover_sandboxes']}",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
