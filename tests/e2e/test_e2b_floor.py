"""The sandbox features of issue 32 (docs/snapshots.md, docs/e2b.md) through the oldest e2b
SDK Harbor accepts (harbor[e2b]==0.26.0 asks e2b>=2.52.0), beside the pinned one the other
E2B tests use: tests/harnesses/e2b_features.py in that SDK's own interpreter,
``ORCH_E2B_FLOOR_PYTHON`` (``make e2b-floor-venv``), against the side stack."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from orchestrator.sandbox.docker.backend import DockerBackend
from tests.e2e.helpers import wait_for
from tests.stacks import TOKEN, Stack

pytestmark = pytest.mark.xdist_group("e2b")

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "tests" / "harnesses" / "e2b_features.py"
DEFAULT_PYTHON = REPO / ".venv-e2b-floor" / "bin" / "python"


def _python() -> Path:
    configured = os.environ.get("ORCH_E2B_FLOOR_PYTHON")
    path = Path(configured) if configured else DEFAULT_PYTHON
    # make test builds it: missing under make test is a failure, not a skip.
    if not path.exists() and not configured:
        pytest.skip(f"no e2b SDK at its floor in {path}; build it with: make e2b-floor-venv")
    assert path.exists(), f"ORCH_E2B_FLOOR_PYTHON={configured} does not exist"
    return path


def test_the_oldest_sdk_harbor_accepts_drives_every_new_feature(side: Stack) -> None:
    python = _python()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("ORCH_", "E2B_"))},
        "E2B_API_URL": side.base_url,
        "E2B_SANDBOX_URL": side.base_url,
        "E2B_API_KEY": TOKEN,
        "NO_PROXY": "127.0.0.1,localhost",
    }
    done = subprocess.run(
        [str(python), str(HARNESS), side.codebase],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["sdk"] == "2.52.0"
    streamed = seen["streamed"]
    assert streamed["stdout"] == "first\nsecond\n"
    assert streamed["first_at_s"] < streamed["took_s"] - 1.0, streamed
    assert seen["stdin"] == "typed\n"
    assert seen["pty_exit"] == 3 and "30 90" in seen["pty"], seen["pty"]
    assert seen["metrics"]["cpu_count"] >= 1 and seen["metrics"]["mem_total"] > 0
    assert seen["watched"] == [["watched.txt", "create"]]
    assert seen["from_snapshot"] == "set-up\nwarm\n"
    assert seen["forks"] == ["set-up\n", "set-up\n"]
    assert seen["deleted"] is True
    assert seen["paused"] is True and seen["state_paused"] == "paused"
    assert seen["resumed"] == "set-up\nwarm\n"
    wait_for(lambda: not _left(side), timeout_s=60, what="every sandbox the harness made gone")


def _left(side: Stack) -> list[str]:
    backend = DockerBackend(side.settings)
    try:
        return [h.sandbox_id for h in backend.list_owned() if h.rollout_id.startswith("e2b")]
    finally:
        backend.client.close()
