"""The verl adapter against a running orchestrator, without verl: the tools are built
from examples/verl_tool_config.yaml as verl builds them, and a scripted agent plays the
model through one trajectory per dataset row (create, execute..., calc_reward, release).

    make up   # prints the URL and the token
    python -m examples.verl_tool --base-url http://127.0.0.1:8000 --token TOKEN
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import uuid
from pathlib import Path
from typing import Any

import yaml

from examples.codebase_planning.agent import localise
from examples.codebase_planning.episodes import example_parser, rows
from orchestrator.adapters.verl import OrchestratorTool
from orchestrator.client import InfraFailure

CONFIG = Path(__file__).with_name("verl_tool_config.yaml")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = example_parser(__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=CONFIG)
    return parser.parse_args(argv)


def load_tools(path: Path, **overrides: Any) -> dict[str, OrchestratorTool]:
    """The tools of a verl tool-config YAML, made the way verl makes them (class_name,
    config, tool_schema), with ``overrides`` in every tool's config."""
    tools = {}
    for entry in yaml.safe_load(path.read_text())["tools"]:
        module, _, name = entry["class_name"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        tool = cls({**entry["config"], **overrides}, entry["tool_schema"])
        tools[tool.name] = tool
    return tools


async def play(tools: dict[str, OrchestratorTool], row: dict[str, Any]) -> float | None:
    """One trajectory; None when it failed for infrastructure reasons (drop it)."""
    instance_id = uuid.uuid4().hex
    for tool in tools.values():
        await tool.create(instance_id, item=row)
    loop = asyncio.get_running_loop()

    def call(name: str, arguments: dict[str, object]) -> str:
        # The scripted agent is synchronous: it runs in a thread, the tools on this loop.
        response, _, _ = asyncio.run_coroutine_threadsafe(
            tools[name].execute(instance_id, dict(arguments)), loop
        ).result()
        return response.text or ""

    try:
        answer, _ = await asyncio.to_thread(localise, str(row["request"]), call)
        return await tools["shell"].calc_reward(instance_id, answer=json.dumps(answer))
    except InfraFailure:
        return None
    finally:
        for tool in tools.values():
            await tool.release(instance_id)


async def run(args: argparse.Namespace) -> list[float | None]:
    overrides = {"base_url": args.base_url, "token": args.token}
    tools = load_tools(args.config, **{k: v for k, v in overrides.items() if v})
    try:
        scores = []
        for row in rows(args.rows, args.codebase):
            score = await play(tools, row)
            shown = "dropped (infra failure)" if score is None else f"{score:.2f}"
            print(f"reward={shown}  <- {row['request'][:60]}")
            scores.append(score)
        return scores
    finally:
        await OrchestratorTool.shutdown()


def main(argv: list[str] | None = None) -> list[float | None]:
    """Play the rows; returns each trajectory's reward (None: dropped)."""
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    main()
