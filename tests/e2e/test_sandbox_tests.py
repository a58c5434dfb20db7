"""The SWE-style grader end to end (the side deployment: API, worker, beat, Redis, real
sandboxes, the system's pytest inside them), on a real small project with a real history
(tests/swe_project.py): the agent edits the code through the shell tool, the grade applies
the row's test patch and runs its tests in the sandbox. Fixed: 1.0; half fixed: the fraction
that passes; the tests tampered with every way a naive harness falls for: no more than the
honest score; the sandbox killed while its tests run: 503, the rollout discarded; a row the
grader cannot use: 422 naming the field, and nothing changed."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import docker
import httpx
import pytest

from orchestrator.images.codebases import add_codebase, remove_codebase
from tests import swe_project
from tests.e2e.conftest import SWE_TESTS
from tests.e2e.helpers import function_call, new_trace, wait_for
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2e")

EVIL_CONFTEST = """\
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""

SLOW_TEST = """\
diff --git a/tests/test_slow.py b/tests/test_slow.py
new file mode 100644
--- /dev/null
+++ b/tests/test_slow.py
@@ -0,0 +1,5 @@
+import time
+
+
+def test_waits():
+    time.sleep(60)
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> swe_project.Project:
    return swe_project.build(tmp_path_factory.mktemp("swe"))


@pytest.fixture(scope="module")
def codebase(side: Stack, project: swe_project.Project) -> Iterator[str]:
    """The project at its buggy commit (its fix is later in the history the sandbox never
    sees)."""
    name = f"calc-{new_trace()[-6:]}"
    add_codebase(side.settings, name, project.repo, rev=project.base_commit)
    yield name
    remove_codebase(side.settings, name)


def _write(path: str, text: str) -> str:
    return f"cat > {path} <<'ORCH_EOF'\n{text}ORCH_EOF\n"


def _rollout(client: httpx.Client, row: dict[str, Any], commands: list[str]) -> str:
    trace = new_trace()
    for command in commands:
        reply = client.post(
            "/agent-rft/tools", json=function_call(trace, row, "shell", {"command": command})
        )
        assert reply.status_code == 200, reply.text
    return trace


def _grade(client: httpx.Client, trace: str, row: dict[str, Any]) -> httpx.Response:
    body = {"sample": {"output_text": "done"}, "item": row, "trace_id": trace}
    return client.post("/agent-rft/grade", json=body, timeout=180)


def _scored(client: httpx.Client, row: dict[str, Any], commands: list[str]) -> dict[str, Any]:
    trace = _rollout(client, row, commands)
    try:
        graded = _grade(client, trace, row)
        assert graded.status_code == 200, graded.text
        body: dict[str, Any] = graded.json()
        return body
    finally:
        client.delete(f"/v1/rollouts/{trace}")


def test_the_fix_scores_one_a_partial_fix_its_fraction_and_none_the_pass_to_pass_share(
    side: Stack, project: swe_project.Project, codebase: str
) -> None:
    row = project.row(codebase, SWE_TESTS)
    with side.client() as client:
        fixed = _scored(client, row, [_write("calc/__init__.py", swe_project.FIXED)])
        half = _scored(client, row, [_write("calc/__init__.py", swe_project.MUL_FIXED)])
        untouched = _scored(client, row, ["git log --oneline | wc -l"])
    assert fixed["score"] == 1.0, fixed
    assert set(fixed["details"]["fail_to_pass"].values()) == {"passed"}
    # mul fixed, power not: 4 of the 5 listed tests pass.
    assert half["score"] == pytest.approx(0.8), half
    assert half["details"]["fail_to_pass"]["tests/test_calc.py::test_power"] == "failed"
    assert untouched["score"] == pytest.approx(0.4), untouched
    assert untouched["details"]["pass_to_pass"] == {t: "passed" for t in swe_project.PASS_TO_PASS}
    # The test patch's tests were applied at grade time: the agent never saw them.
    assert "tests/test_calc.py" in untouched["details"]["restored"]


def test_tampering_with_the_tests_scores_no_more_than_the_honest_score(
    side: Stack, project: swe_project.Project, codebase: str
) -> None:
    row = project.row(codebase, SWE_TESTS)
    tamper = [
        _write("/tmp/evil.py", EVIL_CONFTEST),
        "cp /tmp/evil.py conftest.py && cp /tmp/evil.py tests/conftest.py",
        # A conftest.py in a directory it made unlistable: still found by name by pytest.
        "mkdir -p tests/sub && cp /tmp/evil.py tests/sub/conftest.py && chmod 311 tests/sub",
        "printf '[pytest]\\ntestpaths = tests\\naddopts = -p evil -k test_add\\n' > pytest.ini",
        "cp /tmp/evil.py evil.py && printf '[tool.pytest.ini_options]\\n' > pyproject.toml",
        # A pytest of its own, first on every path it could reach.
        "printf 'import sys\\nprint(\"5 passed\")\\nsys.exit(0)\\n' > pytest.py",
        "mkdir -p ~/bin && printf '#!/bin/sh\\nexit 0\\n' > ~/bin/pytest && chmod +x ~/bin/pytest",
        "echo 'export PATH=~/bin:$PATH PYTEST_ADDOPTS=\"-p evil\"' >> ~/.bashrc",
        "echo 'import evil' > sitecustomize.py && echo 'import evil' > calc/evil.pth",
        # The tests themselves, made to pass.
        "printf 'def test_mul_negative():\\n    pass\\n' >> tests/test_calc.py",
        # Something left running to put it all back while the grader works.
        "setsid sh -c 'while true; do cp /tmp/evil.py conftest.py; sleep 0.05; done' "
        "> /dev/null 2>&1 < /dev/null & echo started",
    ]
    with side.client() as client:
        honest = _scored(client, row, ["true"])
        tampered = _scored(client, row, tamper)
    # No more than honest; here exactly it: the pass-to-pass tests still pass.
    assert tampered["score"] == honest["score"] == pytest.approx(0.4), (honest, tampered)
    removed = set(tampered["details"]["removed"])
    assert {"tests/conftest.py", "tests/sub/conftest.py", "sitecustomize.py"} <= removed
    assert "calc/evil.pth" in removed
    assert {"conftest.py", "pytest.ini", "tests/test_calc.py"} <= set(
        tampered["details"]["restored"]
    )


def test_the_sandbox_killed_while_its_tests_run_is_a_503_never_a_score(
    side: Stack, project: swe_project.Project, codebase: str
) -> None:
    row = project.row(
        codebase,
        SWE_TESTS,
        test_patch=project.test_patch + SLOW_TEST,
        FAIL_TO_PASS=[*swe_project.FAIL_TO_PASS, "tests/test_slow.py::test_waits"],
    )
    daemon = docker.from_env()
    with side.client() as client:
        trace = _rollout(client, row, [_write("calc/__init__.py", swe_project.FIXED)])
        try:
            sandbox = client.get(f"/v1/rollouts/{trace}").json()["sandbox_id"]
            (container,) = daemon.containers.list(
                filters={"label": f"orchestrator.sandbox={sandbox}"}
            )
            graded: list[httpx.Response] = []
            grading = threading.Thread(target=lambda: graded.append(_grade(client, trace, row)))
            grading.start()

            # Until the tests run (the runner names them in its argv).
            wait_for(
                lambda: "test_waits" in json.dumps(container.top(ps_args="-eo pid,args")),
                timeout_s=60,
                what="the tests running",
            )
            container.kill()
            grading.join(timeout=120)
            assert graded and graded[0].status_code == 503, graded and graded[0].text
            error = graded[0].json()["error"]
            assert error["type"] == "infra_error" and error["code"] == "sandbox_dead", error
            view = client.get(f"/v1/rollouts/{trace}").json()
            assert view["state"] == "infra_failed" and view["score"] is None, view
            again = _grade(client, trace, row)
            assert again.status_code == 503, again.text
        finally:
            client.delete(f"/v1/rollouts/{trace}")
            daemon.close()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"test_patch": "--- a/nowhere.py\n+++ b/nowhere.py\n@@ -1 +1 @@\n-a\n+b\n"}, "test_patch"),
        ({"FAIL_TO_PASS": "not json", "PASS_TO_PASS": []}, "FAIL_TO_PASS"),
        ({"FAIL_TO_PASS": [], "PASS_TO_PASS": []}, "FAIL_TO_PASS"),
        ({"test_patch": 7}, "test_patch"),
    ],
)
def test_a_row_the_grader_cannot_use_is_a_422_naming_the_field_and_changes_nothing(
    side: Stack,
    project: swe_project.Project,
    codebase: str,
    change: dict[str, Any],
    field: str,
) -> None:
    good = project.row(codebase, SWE_TESTS)
    bad = {**good, **change}
    with side.client() as client:
        trace = _rollout(client, good, [_write("calc/__init__.py", swe_project.FIXED)])
        try:
            refused = _grade(client, trace, bad)
            assert refused.status_code == 422, refused.text
            assert field in refused.json()["error"]["message"], refused.text
            view = client.get(f"/v1/rollouts/{trace}").json()
            assert view["state"] == "active" and view["score"] is None, view
            graded = _grade(client, trace, good)
            assert graded.status_code == 200 and graded.json()["score"] == 1.0, graded.text
        finally:
            client.delete(f"/v1/rollouts/{trace}")


def test_grades_racing_for_one_rollout_run_its_tests_once_and_agree(
    side: Stack, project: swe_project.Project, codebase: str
) -> None:
    """A platform's retry that comes while the first grade still runs the tests waits for
    that grade's score: a second staging would end the first run's test processes, and the
    first would store failures the agent never caused."""
    row = project.row(codebase, SWE_TESTS)
    with side.client() as client:
        trace = _rollout(client, row, [_write("calc/__init__.py", swe_project.FIXED)])
        try:
            replies: list[httpx.Response] = []
            racers = [
                threading.Thread(target=lambda: replies.append(_grade(client, trace, row)))
                for _ in range(3)
            ]
            for racer in racers:
                racer.start()
            for racer in racers:
                racer.join(timeout=180)
            assert [r.status_code for r in replies] == [200, 200, 200], [r.text for r in replies]
            assert {r.json()["score"] for r in replies} == {1.0}
        finally:
            client.delete(f"/v1/rollouts/{trace}")
    assert side.logs is not None
    ran = [
        line
        for line in (side.logs / "worker.log").read_text().splitlines()
        if '"grade.tests_ran"' in line and trace in line
    ]
    assert len(ran) == 1, ran
