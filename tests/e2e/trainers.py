"""Running a trainer's own code, in the trainers' interpreter, against a test stack.

TRL, verl and torch live in ``.venv-trainers`` (``make trainers-venv``, the ``trainers``
extra), not in the product's venv, so their tests run scripts there and read back the
JSON report each script writes. ``make test`` names the interpreter in
``ORCH_TRAINERS_PYTHON``: when it is set and missing the tests fail; when it is unset
(a bare ``pytest``) and the default venv is missing, they skip and say how to build it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from orchestrator.sandbox.docker.backend import DockerBackend
from tests.stacks import TOKEN, Stack

REPO = Path(__file__).resolve().parents[2]
TRAINERS_PYTHON_ENV = "ORCH_TRAINERS_PYTHON"

# Offline and single-threaded: nothing is downloaded, and two cores are shared with the
# rest of the suite (torch would otherwise start a thread per core for tiny matrices).
QUIET = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRL_EXPERIMENTAL_SILENCE": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "RAY_DISABLE_IMPORT_WARNING": "1",
    "PYTHONHASHSEED": "0",
}


def trainers_python() -> str:
    """The trainers' interpreter, or a skip (a fail under ``make test``) without it."""
    named = os.environ.get(TRAINERS_PYTHON_ENV)
    path = Path(named) if named else REPO / ".venv-trainers" / "bin" / "python"
    if path.exists():
        return str(path)
    if named:
        pytest.fail(f"{TRAINERS_PYTHON_ENV}={named} does not exist: run `make trainers-venv`")
    pytest.skip("no .venv-trainers: `make trainers-venv` installs TRL, verl and torch (CPU)")


def run_in_trainers(
    stack: Stack,
    args: list[str],
    report: Path,
    *,
    timeout_s: float = 600,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """``python ARGS`` in the trainers' interpreter, from the repository root, with the
    stack's ORCH_* settings; returns the JSON it wrote to ``report``, with ``_left`` the
    sandboxes of rollouts the script started that are still there once it exited. A
    non-zero exit fails the test with the output's tail."""
    before = _rollouts_with_sandboxes(stack)
    log = report.with_suffix(".log")
    with log.open("wb") as out:
        done = subprocess.run(
            [trainers_python(), *args],
            cwd=REPO,
            env={**stack.env, **QUIET, "ORCH_API_TOKEN": TOKEN, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
    assert done.returncode == 0, f"{args[:2]} exited {done.returncode}; its output ends:\n{tail}"
    assert report.exists(), f"{args[:2]} wrote no report; its output ends:\n{tail}"
    loaded: dict[str, Any] = json.loads(report.read_text())
    loaded["_log"] = str(log)
    loaded["_left"] = sorted(_rollouts_with_sandboxes(stack) - before)
    return loaded


def _rollouts_with_sandboxes(stack: Stack) -> set[str]:
    """The rollouts that hold a sandbox of the stack's deployment now. The stack is the
    session's, shared with the tests before: their sandboxes (a grade's grace period,
    pool sandboxes, which belong to no rollout) are not the script's."""
    backend = DockerBackend(stack.settings)
    try:
        return {h.rollout_id for h in backend.list_owned() if h.rollout_id}
    finally:
        backend.client.close()
