"""What the adapter examples share: their command line and the dataset rows they play."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from orchestrator.environments.examples import planning_example_dir


def example_parser(description: str) -> argparse.ArgumentParser:
    """The options every adapter example takes: where the orchestrator is, and which rows."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--token", default=os.environ.get("ORCH_API_TOKEN"))
    parser.add_argument("--rows", type=int, default=2, help="dataset rows to play")
    parser.add_argument("--codebase", help="play every row on this codebase instead")
    return parser


def rows(limit: int, codebase: str | None) -> list[dict[str, Any]]:
    """The first ``limit`` rows of the planning dataset, on ``codebase`` when given."""
    with (planning_example_dir() / "dataset.jsonl").open() as lines:
        loaded = [json.loads(line) for line, _ in zip(lines, range(limit), strict=False)]
    return [{**row, "codebase": codebase} if codebase else row for row in loaded]
