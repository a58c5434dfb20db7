"""Run by the trainers' interpreter (``.venv-trainers``), not by pytest: TRL's real
``GRPOTrainer`` on the orchestrator's environment, in the two ways the example does not
show. Writes a JSON report to argv[1]; tests/trainers/test_trl.py reads it.

1. The environment's surface as TRL itself sees it: the tools TRL lists for the class,
   and what TRL does with a public method that has no docstring (a tool it cannot
   describe).
2. A sandbox killed mid-rollout, during training: the second tool call of the run kills
   its own sandbox (through dockerd, as an outage would) just before it is sent. What
   TRL then did with that sample (its reward, its advantage, the logged mean) is read
   off the trainer, not assumed.

The stack is named by the ORCH_* variables of the environment (the test passes its own).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from typing import Any, ClassVar

from examples import trl_grpo
from orchestrator.adapters.trl import OrchestratorEnvironment
from orchestrator.client import RolloutClient
from tests.trainers.common import checks_parser, kill_sandbox


class Recorder(logging.Handler):
    """TRL's warnings, kept."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class UndocumentedTool(OrchestratorEnvironment):
    # TRL makes this public method a tool; it has no docstring to describe it.
    def describe(self, verbose: bool) -> str:
        return str(verbose)


class SandboxKiller(OrchestratorEnvironment):
    """The run's second tool call kills its sandbox first (once)."""

    calls: ClassVar[int] = 0
    killed: ClassVar[str | None] = None

    def _call(self, tool: str, arguments: dict[str, Any]) -> str:
        SandboxKiller.calls += 1
        if SandboxKiller.calls == 2 and self.rollout_id is not None:
            kill_sandbox(self.rollout_id)
            SandboxKiller.killed = self.rollout_id
        return super()._call(tool, arguments)


def trainer_args(args: argparse.Namespace, steps: int) -> argparse.Namespace:
    return trl_grpo.parse_args(
        [
            *("--base-url", args.base_url, "--token", args.token, "--codebase", args.codebase),
            *("--rows", "4", "--steps", str(steps), "--seed", str(args.seed)),
        ]
    )


def surface(args: argparse.Namespace) -> dict[str, Any]:
    client = RolloutClient(args.base_url, args.token)
    trainer, _ = trl_grpo.build(trainer_args(args, 1), lambda: OrchestratorEnvironment(client))
    listed = {name: [tool.__name__ for tool in tools] for name, tools in trainer._env_tools.items()}
    failing, _ = trl_grpo.build(trainer_args(args, 1), lambda: UndocumentedTool(client))
    failure: dict[str, Any] = {"raised": None}
    try:
        failing.train()
    except Exception as exc:  # noqa: BLE001 - what TRL raises is what is reported
        failure = {"raised": type(exc).__name__, "message": str(exc)[:500]}
    # What the failed step had started: closed here, as the adapter's atexit would.
    for pool in failing._environment_pool.values():
        for env in pool:
            env._close()
    opened = [env.rollout_id for pool in failing._environment_pool.values() for env in pool]
    return {"tools": listed, "undocumented": failure, "undocumented_rollouts": opened}


def sabotage(args: argparse.Namespace) -> dict[str, Any]:
    client = RolloutClient(args.base_url, args.token)
    trainer, log = trl_grpo.build(trainer_args(args, 2), lambda: SandboxKiller(client))
    batches: list[list[float]] = []
    generate = trainer._generate_and_score_completions

    def observed(inputs: Any) -> Any:
        output = generate(inputs)
        batches.append([float(a) for a in output["advantages"].tolist()])
        return output

    trainer._generate_and_score_completions = observed
    recorder = Recorder()
    logging.getLogger("trl").addHandler(recorder)
    trainer.train()
    report = trl_grpo.report(trainer, log)
    report["advantages"] = batches
    report["killed"] = SandboxKiller.killed
    report["warnings"] = recorder.messages
    return report


def main() -> int:
    args = checks_parser().parse_args()
    result = {"surface": surface(args), "sabotage": sabotage(args)}
    args.report.write_text(json.dumps(result, indent=2, default=_nan_safe))
    return 0


def _nan_safe(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else str(value)


if __name__ == "__main__":
    sys.exit(main())
