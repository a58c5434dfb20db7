"""What the trainer check scripts share: their command line, and an outage as they stage
it (a rollout's sandbox killed through dockerd, behind the orchestrator's back). Imports
only the product: the trainers' venv runs these."""

from __future__ import annotations

import argparse
from pathlib import Path

from orchestrator.config import Settings
from orchestrator.sandbox.docker.backend import DockerBackend


def checks_parser() -> argparse.ArgumentParser:
    """``REPORT --base-url URL --token TOKEN --codebase NAME [--seed N]``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("report", type=Path, help="where the JSON report goes")
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--codebase", required=True)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def kill_sandbox(rollout_id: str, settings: Settings | None = None) -> None:
    """SIGKILL the one sandbox of ``rollout_id`` (settings: the ORCH_* environment's)."""
    backend = DockerBackend(settings or Settings())
    try:
        (handle,) = [h for h in backend.list_owned() if h.rollout_id == rollout_id]
        backend.client.api.kill(handle.native_id)
    finally:
        backend.client.close()
