"""Rewards on a real stack (the side deployment: API, worker, beat, Redis, real sandboxes):
``multi`` scores an Agent RFT rollout from its answer, its tool calls and the sample's
token usage; the grade keeps its inputs; a sample without the usage the formula needs is
a 422 that changes nothing; ``orchestrator regrade`` scores the stored rollouts again with
another environment's grader and ``orchestrator export`` writes them as JSONL and Parquet
that ``datasets.load_dataset`` (in the trainers' venv) reads back."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import REGRADER, REWARDED
from tests.e2e.helpers import function_call, new_trace, orchestrator
from tests.e2e.trainers import QUIET, trainers_python
from tests.stacks import Stack

pytestmark = pytest.mark.xdist_group("e2e")

GOLD = ["src/requests/sessions.py"]
RIGHT = json.dumps(GOLD)


def _item(side: Stack) -> dict[str, Any]:
    return {
        "environment": REWARDED,
        "codebase": side.codebase,
        "request": "Make Session.request honour a default timeout.",
        "gold_files": GOLD,
    }


def _calls(client: httpx.Client, trace: str, item: dict[str, Any], commands: list[str]) -> None:
    for command in commands:
        reply = client.post(
            "/agent-rft/tools", json=function_call(trace, item, "shell", {"command": command})
        )
        assert reply.status_code == 200, reply.text


def _grade(
    client: httpx.Client, trace: str, item: dict[str, Any], sample: dict[str, Any]
) -> httpx.Response:
    return client.post("/agent-rft/grade", json={"sample": sample, "item": item, "trace_id": trace})


def _shown(side: Stack, trace: str) -> dict[str, Any]:
    shown = orchestrator(side, "rollouts", "show", trace, "--json")
    assert shown.returncode == 0, shown.stderr
    detail: dict[str, Any] = json.loads(shown.stdout)
    return detail


def test_multi_scores_the_answer_less_its_penalties_and_keeps_its_inputs(side: Stack) -> None:
    item, trace = _item(side), new_trace()
    sample = {"output_text": RIGHT, "usage": {"output_tokens": 500, "input_tokens": 2000}}
    with side.client() as client:
        try:
            _calls(
                client,
                trace,
                item,
                ["ls src/requests", "grep -n timeout src/requests/sessions.py | head", "true"],
            )
            graded = _grade(client, trace, item, sample)
            assert graded.status_code == 200, graded.text
            body = graded.json()
            # file_f1 1.0, less 0.1 for each of the two calls past the first, less 500 tokens
            # at 0.0001 each.
            assert body["score"] == pytest.approx(0.75)
            details = body["details"]
            assert details["graders"]["files"]["score"] == 1.0
            assert details["measures"]["tool_calls"] == 3
            assert details["measures"]["output_tokens"] == 500
            assert details["formula_value"] == pytest.approx(0.75)
            # A retried grade, even with another sample, is the score stored first.
            again = _grade(
                client, trace, item, {"output_text": "[]", "usage": {"output_tokens": 1}}
            )
            assert again.status_code == 200 and again.json()["score"] == pytest.approx(0.75)
        finally:
            client.delete(f"/v1/rollouts/{trace}")
    inputs = _shown(side, trace)["grade_inputs"]
    assert inputs["answer"] == RIGHT
    assert inputs["sample"] == sample
    assert inputs["grader"] == "multi" and len(inputs["grader_digest"]) == 16


def test_a_sample_without_the_usage_the_formula_needs_is_a_422_that_changes_nothing(
    side: Stack,
) -> None:
    item, trace = _item(side), new_trace()
    with side.client() as client:
        try:
            _calls(client, trace, item, ["true"])
            refused = _grade(client, trace, item, {"output_text": RIGHT})
            assert refused.status_code == 422, refused.text
            assert "sample.usage" in refused.text
            view = client.get(f"/v1/rollouts/{trace}").json()
            assert view["score"] is None and view["state"] == "active", view
            fixed = _grade(
                client, trace, item, {"output_text": RIGHT, "usage": {"completion_tokens": 0}}
            )
            assert fixed.status_code == 200 and fixed.json()["score"] == 1.0, fixed.text
        finally:
            client.delete(f"/v1/rollouts/{trace}")


def test_regrade_and_export_round_trip(side: Stack, tmp_path: Path) -> None:
    since = str(time.time() - 1)
    item = _item(side)
    right, wrong = new_trace(), new_trace()
    with side.client() as client:
        try:
            for trace, answer in ((right, RIGHT), (wrong, '["README.md"]')):
                _calls(client, trace, item, ["true", "true"])
                sample = {"output_text": answer, "usage": {"output_tokens": 1000}}
                graded = _grade(client, trace, item, sample)
                assert graded.status_code == 200, graded.text
        finally:
            for trace in (right, wrong):
                client.delete(f"/v1/rollouts/{trace}")
    # Stored: 1.0 - 0.1 - 0.1 = 0.8 for the right answer, 0 for the wrong one (clamped).
    regraded = orchestrator(
        side, "regrade", REGRADER, "--environment", REWARDED, "--since", since, "--json"
    )
    assert regraded.returncode == 0, regraded.stderr
    report = json.loads(regraded.stdout)
    by_id = {entry["rollout_id"]: entry for entry in report["rollouts"]}
    assert by_id[right]["old_score"] == pytest.approx(0.8)
    assert by_id[right]["new_score"] == 1.0  # file_f1 alone: no penalties
    assert by_id[wrong]["old_score"] == 0.0 and by_id[wrong]["new_score"] == 0.0
    assert report["grader_environment"] == REGRADER and report["errors"] == 0
    assert report["changed"] >= 1
    table = orchestrator(
        side, "regrade", REGRADER, "--environment", REWARDED, "--since", since, COLUMNS="300"
    )
    assert table.returncode == 0, table.stderr
    assert right in table.stdout and "changed" in table.stdout, table.stdout
    # Regrading changed no stored score.
    assert _shown(side, right)["summary"]["score"] == pytest.approx(0.8)

    files = {form: tmp_path / f"rollouts.{form}" for form in ("jsonl", "parquet")}
    for path in files.values():
        exported = orchestrator(
            side, "export", str(path), "--environment", REWARDED, "--since", since, "--graded"
        )
        assert exported.returncode == 0, exported.stderr
        assert "wrote" in exported.stdout
    lines = [json.loads(line) for line in files["jsonl"].read_text().splitlines()]
    assert {row["rollout_id"] for row in lines} >= {right, wrong}
    # datasets, as a user loads an export (the trainers' venv has it).
    script = (
        "import datasets, json, sys\n"
        "out = {}\n"
        "for form, path in json.loads(sys.argv[1]).items():\n"
        "    kind = 'json' if form == 'jsonl' else 'parquet'\n"
        "    ds = datasets.load_dataset(kind, data_files=path, split='train')\n"
        "    out[form] = [{'id': r['rollout_id'], 'score': r['score'], 'answer': r['answer'],\n"
        "                  'sample': json.loads(r['sample']), 'calls': len(r['trajectory']),\n"
        "                  'tool': r['trajectory'][0]['tool'], 'item': json.loads(r['item'])}\n"
        "                 for r in ds]\n"
        "print(json.dumps(out))\n"
    )
    loaded = subprocess.run(
        [trainers_python(), "-c", script, json.dumps({k: str(v) for k, v in files.items()})],
        capture_output=True,
        text=True,
        timeout=300,
        env={"PATH": "/usr/bin:/bin", **QUIET},
        check=False,
    )
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    tables = json.loads(loaded.stdout)
    for form in ("jsonl", "parquet"):
        rows = {row["id"]: row for row in tables[form]}
        assert rows[right]["score"] == pytest.approx(0.8), form
        assert (
            rows[right]["answer"] == RIGHT
            and rows[right]["sample"]["usage"]["output_tokens"] == 1000
        )
        assert rows[right]["calls"] == 2 and rows[right]["tool"] == "shell"
        assert rows[right]["item"]["gold_files"] == GOLD
        assert rows[wrong]["score"] == 0.0


def test_export_and_regrade_refuse_bad_input_and_write_nothing(side: Stack, tmp_path: Path) -> None:
    unknown = orchestrator(side, "regrade", "no-such-environment")
    assert unknown.returncode == 2 and "no-such-environment" in unknown.stderr
    target = tmp_path / "out.csv"
    refused = orchestrator(side, "export", str(target))
    assert refused.returncode != 0 and "jsonl" in refused.stderr and not target.exists()
    bad_time = orchestrator(side, "export", str(tmp_path / "x.jsonl"), "--since", "yesterday")
    assert bad_time.returncode != 0 and "ISO 8601" in bad_time.stderr


def test_the_reapers_last_pass_is_a_gauge_of_the_api(side: Stack) -> None:
    """The reaper-down alert's source: the side stack runs the reaper (a pass every second)."""
    with side.client() as client:
        text = client.get("/metrics").text
    (line,) = [
        entry
        for entry in text.splitlines()
        if entry.startswith("orchestrator_reaper_last_pass_timestamp_seconds ")
    ]
    assert time.time() - float(line.split()[1]) < 60, line
