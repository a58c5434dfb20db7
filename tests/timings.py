"""The suite's shape, recorded on every run: each phase's wall time and its slowest tests.

The controlling process (the only one under xdist that sees every report) adds up each
test's setup, call and teardown, and at the end writes ``<dir>/<phase>.json``: the phase's
wall time, how many tests ran and the slowest of them with the worker that ran each. The
directory is ``ORCH_TEST_TIMES_DIR`` (default ``.venv/test-times`` in the repository) and
the phase ``ORCH_TEST_PHASE`` (the Makefile names ``parallel`` and ``solo``; default
``pytest``). ``scripts/test_times.py`` prints them as one table after ``make test``.

A test's setup time holds the fixtures it was the first to need: a session stack's start
shows up on the first test that used it, which is what makes a stack's cost visible.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import pytest

SLOWEST = 40
"""Tests kept per phase, slowest first."""


def times_dir(config: pytest.Config) -> Path:
    configured = os.environ.get("ORCH_TEST_TIMES_DIR")
    return Path(configured) if configured else config.rootpath / ".venv" / "test-times"


class Timings:
    """The controller's sum of each test's phases."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.started = time.monotonic()
        self.tests: dict[str, dict[str, float]] = defaultdict(dict)
        self.workers: dict[str, str] = {}
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.tests[report.nodeid][report.when] = report.duration
        node = getattr(report, "node", None)
        if node is not None:
            self.workers[report.nodeid] = str(node.gateway.id)
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid] = report.outcome

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        wall = time.monotonic() - self.started
        totals = sorted(
            ((sum(phases.values()), nodeid) for nodeid, phases in self.tests.items()),
            reverse=True,
        )
        modules: dict[str, float] = defaultdict(float)
        module_workers: dict[str, set[str]] = defaultdict(set)
        for total, nodeid in totals:
            module = nodeid.split("::", 1)[0]
            modules[module] += total
            module_workers[module].add(self.workers.get(nodeid, "main"))
        by_worker: dict[str, float] = defaultdict(float)
        for total, nodeid in totals:
            by_worker[self.workers.get(nodeid, "main")] += total
        phase = os.environ.get("ORCH_TEST_PHASE", "pytest")
        record = {
            "phase": phase,
            "wall_s": round(wall, 1),
            "tests": len(self.tests),
            "test_s": round(sum(total for total, _ in totals), 1),
            "exit_status": int(session.exitstatus),
            "busy_s_by_worker": {w: round(t, 1) for w, t in sorted(by_worker.items())},
            "modules": [
                {"module": m, "total_s": round(t, 1), "workers": sorted(module_workers[m])}
                for m, t in sorted(modules.items(), key=lambda item: -item[1])[:SLOWEST]
            ],
            "slowest": [
                {
                    "nodeid": nodeid,
                    "total_s": round(total, 2),
                    **{f"{when}_s": round(s, 2) for when, s in self.tests[nodeid].items()},
                    "worker": self.workers.get(nodeid, "main"),
                    "outcome": self.outcomes.get(nodeid, "passed"),
                }
                for total, nodeid in totals[:SLOWEST]
            ],
        }
        directory = times_dir(self.config)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f"{phase}.json").write_text(json.dumps(record, indent=1) + "\n")
        except OSError as exc:  # a read-only checkout still runs its tests
            reporter = self.config.pluginmanager.get_plugin("terminalreporter")
            if reporter is not None:
                reporter.write_line(f"test times not recorded: {exc}")


def pytest_configure(config: pytest.Config) -> None:
    # Only the controller (or a run without xdist): workers' reports reach it anyway.
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(Timings(config), "orchestrator-timings")
