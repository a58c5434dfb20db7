"""A guard on the suite's structure: every ``xdist_group`` runs on one worker.

The suite's groups are what keeps one deployment per group (a stack, a Kubernetes
control plane, the fault stack with its own dockerd): split across workers, each worker
starts its own copy and the run is slower and heavier without a test failing. That
happened silently once (pytest 9.2 reads node ids from ``_id``, pytest-xdist 3.8 still
writes ``_nodeid``, so ``--dist loadgroup`` ran as ``--dist load``). This plugin, run by
the controlling process, fails the session when:

- a test marked with ``xdist_group`` reached the controller without its group in its node
  id (xdist's ``@group`` suffix): groups are not being applied at all; or
- one group's tests ran on more than one worker.

It is active whenever tests run on two or more workers; loaded by tests/conftest.py, and
by ``-p tests.xdist_groups`` in tests/test_suite_structure.py's small projects.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

GROUP_MARK = "xdist_group"


def _distributed(config: pytest.Config) -> bool:
    # The controller of a run on two or more workers (xdist's own option parsing, done
    # before any plugin's configure, has turned -n into a number and set dist).
    return (
        not hasattr(config, "workerinput")
        and getattr(config.option, "dist", "no") != "no"
        and int(getattr(config.option, "numprocesses", 0) or 0) >= 2
    )


def group_of(nodeid: str) -> str | None:
    """The group xdist appended to ``nodeid`` (``path::test[params]@group``), or None."""
    head, at, group = nodeid.rpartition("@")
    # An "@" inside a parameter id is not a group: the group comes after the last "]".
    if not at or "]" in group or "::" in group or not head:
        return None
    return group


class GroupGuard:
    """The controller's record of which worker set up each grouped test."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.workers: dict[str, set[str]] = defaultdict(set)
        self.unapplied: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        node = getattr(report, "node", None)  # the worker, set by xdist on the controller
        if report.when != "setup" or node is None or GROUP_MARK not in report.keywords:
            return
        group = group_of(report.nodeid)
        if group is None:
            self.unapplied.append(report.nodeid)
        else:
            self.workers[group].add(str(node.gateway.id))

    def problems(self) -> list[str]:
        """What the guard found, one line each (empty: every group ran on one worker)."""
        found = []
        if self.unapplied:
            found.append(
                f"{len(self.unapplied)} tests marked {GROUP_MARK} carry no group in their node "
                f"id (first: {self.unapplied[0]}): groups are not applied; run with --dist "
                "loadgroup on a pytest that pytest-xdist supports (pyproject.toml pins it)"
            )
        for group, workers in sorted(self.workers.items()):
            if len(workers) > 1:
                found.append(f"group {group!r} was split across workers {sorted(workers)}")
        return found

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        found = self.problems()
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if found:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
            for line in found:
                if reporter is not None:
                    reporter.write_line(f"XDIST GROUP CHECK FAILED: {line}", red=True)
        elif reporter is not None:
            reporter.write_line(
                f"xdist group check: {len(self.workers)} groups, each on one worker"
            )


def pytest_configure(config: pytest.Config) -> None:
    if _distributed(config):
        config.pluginmanager.register(GroupGuard(config), "xdist-group-guard")
