"""The TRL adapter against a running orchestrator, without TRL: a scripted agent plays
the model through one environment per dataset row, and TRL's reward function grades.

    make up   # prints the URL and the token
    python -m examples.trl_environment --base-url http://127.0.0.1:8000 --token TOKEN
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from typing import Any

from examples.codebase_planning.agent import localise
from examples.codebase_planning.episodes import example_parser, rows
from orchestrator.adapters.trl import (
    OrchestratorEnvironment,
    environment_factory,
    reward_function,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return example_parser(__doc__.splitlines()[0]).parse_args(argv)


def play(env: OrchestratorEnvironment, tool: str, arguments: dict[str, Any]) -> str:
    """What TRL does with the model's tool call: call the environment's method."""
    output: str = getattr(env, tool)(**arguments)
    return output


def main(argv: list[str] | None = None) -> list[float | None]:
    """Play the rows; returns each row's reward (None: infra failure, sample dropped)."""
    args = parse_args(argv)
    factory = environment_factory(args.base_url, args.token)
    reward = reward_function()
    dataset = rows(args.rows, args.codebase)
    # What GRPOTrainer does: one environment per slot, reset on the row, tools as the
    # model calls them, then the reward functions with the environments.
    environments = [factory() for _ in dataset]
    completions = []
    for env, row in zip(environments, dataset, strict=True):
        env.reset(prompt=[{"role": "user", "content": row["request"]}], **row)
        answer, _ = localise(str(row["request"]), partial(play, env))
        completions.append([{"role": "assistant", "content": json.dumps(answer)}])
    scores = reward(completions=completions, environments=environments)
    for env, row, score in zip(environments, dataset, scores, strict=True):
        shown = "dropped (infra failure)" if score is None else f"{score:.2f}"
        print(f"{env.rollout_id}  calls={env.tool_calls}  reward={shown}  <- {row['request'][:60]}")
    return scores


if __name__ == "__main__":
    main()
