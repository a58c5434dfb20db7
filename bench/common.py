"""Shared helpers for the benchmarks: percentiles, host memory, the benchmark codebase."""

from __future__ import annotations

import json
import os
import platform
import secrets
import shutil
import statistics
import sys
import sysconfig
import tempfile
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from orchestrator.api.models import FunctionCall
from orchestrator.config import Settings
from orchestrator.images.codebases import UnknownCodebase, add_codebase, get_codebase
from orchestrator.local import free_port
from orchestrator.sandbox import cgroups

RESULTS = Path(__file__).resolve().parent / "results"
STACK_ENVIRONMENTS = """\
environments:
  - name: bench
    tools: [shell, read_file]
    grader: {name: file_f1}
    idle_timeout_s: 1800
"""
"""The environments of the stacks bench.peer and bench.profile start (the one is `bench`)."""
BENCH_CODEBASE = "bench-cpython-stdlib"
# The standard library of the Python running the bench: a real, offline, ~1,000-file
# codebase. Tests, site-packages and binary modules are left out.
_STDLIB_SKIP = {
    "site-packages",
    "test",
    "__pycache__",
    "idlelib",
    "lib2to3",
    "ensurepip",
    "lib-dynload",
}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": round(statistics.median(values), 3) if values else float("nan"),
        "p90": round(percentile(values, 90), 3),
        "p99": round(percentile(values, 99), 3),
        "mean": round(statistics.fmean(values), 3) if values else float("nan"),
    }


def function_call(
    trace: str, tag: str, tool: str, arguments: dict[str, Any], item: dict[str, Any]
) -> dict[str, Any]:
    """The body Agent RFT posts for one tool call (the API's own model), ids ``*_<tag>``."""
    return FunctionCall(
        id=f"fc_{tag}",
        call_id=f"call_{tag}",
        name=tool,
        arguments=json.dumps(arguments),
        trace_id=trace,
        item=item,
    ).model_dump(mode="json")


def mem_used_mb() -> float:
    """Host memory in use (MemTotal - MemAvailable), MiB."""
    fields: dict[str, int] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0])
    return (fields["MemTotal"] - fields["MemAvailable"]) / 1024


def ensure_bench_codebase(settings: Settings) -> str:
    """The benchmark codebase image, built once from this Python's standard library."""
    try:
        return get_codebase(settings, BENCH_CODEBASE).image
    except UnknownCodebase:
        pass
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "cpython-stdlib"
        shutil.copytree(
            stdlib,
            tree,
            ignore=lambda _dir, names: [
                n for n in names if n in _STDLIB_SKIP or n.startswith("config-")
            ],
        )
        return add_codebase(settings, BENCH_CODEBASE, tree).image


def write_report(name: str, report: dict[str, Any], markdown: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": name,
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": _cpus(),
            "python": sys.version.split()[0],
            "kernel": platform.release(),
        },
        **report,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown)
    return path


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def throwaway_stack_settings(deployment: str, environments_yaml: str) -> Settings:
    """Settings of a deployment that lives for one benchmark run: its own state directory
    (``settings.state_dir``; the stack's log goes there too), token, port and host id, the
    given environments YAML, and ``bench`` as the default environment."""
    state = Path(tempfile.mkdtemp(prefix=f"orch-{deployment}-"))
    environments = state / "environments.yaml"
    environments.write_text(environments_yaml)
    return Settings(
        deployment=deployment,
        api_port=free_port(),
        api_tokens=secrets.token_urlsafe(16),
        state_dir=state,
        host_id=f"bench-{uuid.uuid4().hex[:8]}",
        log_level="WARNING",
        environments_file=environments,
        default_environment="bench",
    )


# -- CPU seconds by process --------------------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # utime + stime + the same of its children it has waited for (the worker's mkfs, mount)
    return sum(int(f) for f in fields[11:15]) / CLK_TCK


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def host_busy_s() -> float:
    parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    values = [int(v) for v in parts]
    idle = values[3] + values[4]
    return (sum(values[:8]) - idle) / CLK_TCK


def container_cpu_s(container_id: str) -> float:
    return cgroups.container_cpu_s(container_id) or 0.0
