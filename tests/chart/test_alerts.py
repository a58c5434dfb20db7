"""The alert rules, their runbooks and the Grafana dashboard.

The rules are checked and unit-tested with the real ``promtool`` (scripts/host-setup.sh
installs it; missing, these tests fail rather than skip). Every metric an alert or a panel
reads must be one the code exports: the counters and histograms of
``orchestrator.observability.metrics`` plus the API's Redis state gauges, rendered exactly
as the API's ``/metrics`` renders them, against the real Redis.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.config import Settings
from orchestrator.environments.loader import load_environments
from orchestrator.observability.metrics import exposition
from orchestrator.state.collector import StateCollector

REPO = Path(__file__).resolve().parents[2]
ALERTS = REPO / "helm" / "orchestrator" / "files" / "alerts.yaml"
DASHBOARD = REPO / "helm" / "orchestrator" / "files" / "dashboard.json"
UNIT_TESTS = Path(__file__).with_name("alerts_test.yaml")
RUNBOOKS = REPO / "runbooks"
RUNBOOK_BASE = "https://github.com/orchestrator-dev/orchestrator/blob/main/runbooks/"
SECTIONS = (
    "What it means",
    "What it does to training",
    "Diagnose",
    "Mitigate",
    "Confirm it is over",
)
SEVERITIES = {"critical", "warning"}
METRIC = re.compile(r"\borchestrator_[a-z0-9_]+")
BY_LABELS = re.compile(r"\bby\s*\(([^)]*)\)")

# The sample names each metric type exposes: a counter family named ``x`` (prometheus_client
# strips ``_total``) is queried as ``x_total``; a histogram ``x`` as its buckets, sum, count.
SAMPLE_SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}


class AlertRule(BaseModel):
    """One alerting rule as Prometheus reads it (recording rules have no place here)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    alert: str
    expr: str
    for_: str = Field(alias="for")
    labels: dict[str, str]
    annotations: dict[str, str]


class RuleGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    interval: str | None = None
    rules: list[AlertRule]


class RuleFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    groups: list[RuleGroup]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not installed: run scripts/host-setup.sh as root "
            "(it installs Debian's prometheus package, which carries /usr/bin/promtool)"
        )
    return path


def run_promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), *args], capture_output=True, text=True, timeout=120, check=False
    )


def rules() -> list[AlertRule]:
    parsed = RuleFile.model_validate(yaml.safe_load(ALERTS.read_text()))
    return [rule for group in parsed.groups for rule in group.rules]


def alert_names() -> set[str]:
    return {rule.alert for rule in rules()}


def runbook_files() -> dict[str, Path]:
    return {p.stem: p for p in RUNBOOKS.glob("*.md") if p.name != "README.md"}


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels(items: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those folded inside collapsed rows included."""
    for panel in items:
        yield panel
        yield from panels(panel.get("panels", []))


def dashboard_queries() -> list[str]:
    queries = [
        str(target.get("expr", ""))
        for panel in panels(dashboard()["panels"])
        for target in panel.get("targets", [])
    ]
    for variable in dashboard().get("templating", {}).get("list", []):
        query = variable.get("query")
        queries.append(query.get("query", "") if isinstance(query, dict) else str(query or ""))
    return queries


def sample_names(exposition_text: str) -> set[str]:
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition_text):
        if family.name.startswith("orchestrator_"):
            names |= {family.name + suffix for suffix in SAMPLE_SUFFIXES[family.type]}
    return names


@pytest.fixture(scope="module")
def exported(settings: Settings) -> set[str]:
    """Every sample name the code exports: the API's /metrics body (this process's counters
    and histograms, which workers export too, and the Redis state gauges) read from the
    real Redis through the collector the API registers."""
    collector = StateCollector(settings, load_environments(settings))
    try:
        text = exposition(collector).decode()
    finally:
        collector.close()
    names = sample_names(text)
    # A state collector that could not read Redis exports redis_up alone: that would make
    # every other gauge look unexported.
    assert "orchestrator_rollouts_live" in names, "the state collector could not read Redis"
    return names


# -- the rules -------------------------------------------------------------------------------


def test_promtool_accepts_the_rule_file() -> None:
    result = run_promtool("check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules())} rules found" in result.stdout


def test_every_alert_fires_in_its_promtool_unit_tests() -> None:
    result = run_promtool("test", "rules", str(UNIT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_rule_has_a_unit_test_that_makes_it_fire() -> None:
    """promtool only runs the cases written: each rule (alert name with its severity and
    signal) must have one case where it is expected to fire."""
    cases = yaml.safe_load(UNIT_TESTS.read_text())
    assert cases["rule_files"] == [str(Path("..", "..", ALERTS.relative_to(REPO)))]
    fired = {
        (check["alertname"], alert["exp_labels"]["severity"], alert["exp_labels"].get("signal"))
        for case in cases["tests"]
        for check in case.get("alert_rule_test", [])
        for alert in check.get("exp_alerts") or []
    }
    wanted = {(r.alert, r.labels["severity"], r.labels.get("signal")) for r in rules()}
    assert wanted - fired == set(), "rules no promtool case makes fire"
    assert fired - wanted == set(), "promtool cases for rules that do not exist"


def test_every_rule_is_complete() -> None:
    required = {
        "OrchestratorInfraErrorRateHigh",
        "OrchestratorSandboxCreationSlow",
        "OrchestratorQueueBacklog",
        "OrchestratorNoWorkerUp",
        "OrchestratorSandboxesLeaking",
        "OrchestratorRedisDown",
        "OrchestratorGraderErrors",
        "OrchestratorAPI5xxRate",
        "OrchestratorHostUnhealthy",
        "OrchestratorCapacityExhausted",
    }
    assert required - alert_names() == set()
    for rule in rules():
        assert re.fullmatch(r"\d+[smh]", rule.for_), rule.alert
        assert rule.labels["severity"] in SEVERITIES, rule.alert
        assert rule.annotations["summary"].strip(), rule.alert
        assert rule.annotations["description"].strip(), rule.alert
        assert rule.annotations["runbook_url"] == f"{RUNBOOK_BASE}{rule.alert}.md"
        # An alert per host, queue, ... must say which one.
        text = rule.annotations["summary"] + rule.annotations["description"]
        for group in BY_LABELS.findall(rule.expr):
            for label in (part.strip() for part in group.split(",")):
                if label and label != "le":
                    assert f"$labels.{label}" in text, f"{rule.alert} never names its {label}"


# -- the runbooks ----------------------------------------------------------------------------


def test_every_alert_has_a_runbook_and_every_runbook_an_alert() -> None:
    assert set(runbook_files()) == alert_names()


def test_every_runbook_has_the_five_sections_in_order() -> None:
    for name, path in runbook_files().items():
        text = path.read_text()
        assert text.startswith(f"# {name}\n"), f"{path.name}: title is not the alert's name"
        headings = re.findall(r"^## (.+?)\s*$", text, flags=re.MULTILINE)
        assert headings == list(SECTIONS), f"{path.name}: sections {headings}"
        bodies = re.split(r"^## .+$", text, flags=re.MULTILINE)[1:]
        for heading, body in zip(SECTIONS, bodies, strict=True):
            assert len(body.strip()) > 80, f"{path.name}: '{heading}' says next to nothing"


def test_the_runbook_index_links_every_runbook() -> None:
    index = (RUNBOOKS / "README.md").read_text()
    linked = set(re.findall(r"\]\((Orchestrator[A-Za-z0-9]+)\.md\)", index))
    assert linked == set(runbook_files())


# -- the dashboard ---------------------------------------------------------------------------


def test_dashboard_panels_all_query_the_datasource_variable() -> None:
    board = dashboard()
    assert board["schemaVersion"] == 39
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in panels(board["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    graphs = [panel for panel in panels(board["panels"]) if panel["type"] != "row"]
    assert graphs
    for panel in graphs:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert METRIC.search(target["expr"]), f"panel {panel['title']!r}: {target['expr']}"
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """promtool parses each panel's query, as recording rules with Grafana's interval
    variables set to a real duration."""
    queries = [q for q in dashboard_queries() if q]
    recording = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{n}", "expr": q.replace("$__rate_interval", "5m")}
                    for n, q in enumerate(queries)
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump(recording))
    result = run_promtool("check", "rules", "--lint=none", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout


def test_dashboard_covers_what_operators_watch() -> None:
    used = {name for query in dashboard_queries() for name in METRIC.findall(query)}
    watched = {
        "orchestrator_tool_calls_total",  # tool-call rate by outcome
        "orchestrator_tool_call_seconds_bucket",  # latency p50/p99 by phase
        "orchestrator_infra_errors_total",  # infra errors by cause
        "orchestrator_sandbox_create_seconds_bucket",  # creation p50/p99 by source
        "orchestrator_sandboxes_active",  # by host
        "orchestrator_pool_ready",  # pool ready vs target
        "orchestrator_pool_target",
        "orchestrator_queue_depth",
        "orchestrator_workers_up",  # workers up / hosts schedulable
        "orchestrator_host_schedulable",
        "orchestrator_rollouts_finished_total",  # rollouts by final outcome
        "orchestrator_grade_score_bucket",  # grade score distribution
        "orchestrator_http_requests_total",  # API 5xx rate
    }
    assert watched - used == set()


# -- metrics the code exports ----------------------------------------------------------------


def test_every_metric_the_alerts_use_is_exported(exported: set[str]) -> None:
    used = {name for rule in rules() for name in METRIC.findall(rule.expr)}
    assert used
    assert used - exported == set(), "alerts read metrics the code does not export"


def test_every_metric_the_dashboard_uses_is_exported(exported: set[str]) -> None:
    used = {name for query in dashboard_queries() for name in METRIC.findall(query)}
    assert used
    assert used - exported == set(), "panels read metrics the code does not export"
