"""Run by the trainers' interpreter (``.venv-trainers``), not by pytest: verl 0.9.1's own
code on the orchestrator's tool and reward function, in the ways the example does not
show. Writes a JSON report to argv[1]; tests/e2e/test_verl.py reads it.

1. verl's own tool loader (``initialize_tools_from_config``) builds the tools from the
   example's YAML: their class, names and schemas as verl sees them.
2. The explicit lifecycle (no ``agent_data``), which verl's agent loop never drives but a
   custom loop may: ``create`` on both tools with one instance id → ``execute`` ×2 →
   ``calc_reward`` → ``release``.
3. A sandbox killed mid-trajectory, in verl's agent loop: the run's first tool call kills
   its own trajectory's sandbox (through dockerd, as an outage would) just before it is
   sent. With ``on_infra_failure="flag"`` that sample is flagged, scored 0.0 by verl, and
   ``drop_infra_failed`` removes it before ``compute_grpo_outcome_advantage``; then
   ``compute_score`` in its default ``"raise"`` mode is asked to score the same sample.

The stack is named by the ORCH_* variables of the environment (the test passes its own).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, ClassVar

from verl.tools.base_tool import BaseTool
from verl.tools.tool_registry import initialize_tools_from_config

from examples import verl_agent_loop
from orchestrator.adapters import verl as adapter
from orchestrator.client import InfraFailure
from tests.trainers.common import checks_parser, kill_sandbox

GOLD = '["src/requests/sessions.py", "src/requests/adapters.py"]'


def run_args(args: argparse.Namespace, on_infra_failure: str) -> argparse.Namespace:
    return verl_agent_loop.parse_args(
        [
            *("--base-url", args.base_url, "--token", args.token, "--codebase", args.codebase),
            *("--rows", "2", "--generations", "2", "--seed", str(args.seed)),
            *("--on-infra-failure", on_infra_failure),
        ]
    )


def loader(run: verl_agent_loop.Run) -> dict[str, Any]:
    """The tools as verl's own loader builds them from the run's YAML."""
    path = run.config.actor_rollout_ref.rollout.multi_turn.tool_config_path
    tools = initialize_tools_from_config(path)
    return {
        "tools": [
            {
                "name": tool.name,
                "class": f"{type(tool).__module__}.{type(tool).__qualname__}",
                "is_base_tool": isinstance(tool, BaseTool),
                "schema": tool.tool_schema.model_dump(exclude_none=True),
            }
            for tool in tools
        ]
    }


def explicit(run: verl_agent_loop.Run, codebase: str) -> dict[str, Any]:
    """create → execute ×2 → calc_reward → release, on the tools verl's worker loaded."""
    tools = {tool.name: tool for tool in run.worker.tools}
    row = {
        "environment": "codebase-planning",
        "codebase": codebase,
        "request": "Make Session.request honour a default timeout.",
        "gold_files": ["src/requests/sessions.py", "src/requests/adapters.py"],
    }

    async def trajectory() -> dict[str, Any]:
        iid, _ = await tools["shell"].create(create_kwargs={"item": row})
        await tools["read_file"].create(iid, create_kwargs={"item": row})
        before = tools["shell"].rollout_id(iid)  # lazy: no rollout before the first call
        listing, _, metrics = await tools["shell"].execute(iid, {"command": "ls src/requests"})
        read, _, _ = await tools["read_file"].execute(
            iid, {"path": "src/requests/sessions.py", "end_line": 3}
        )
        rollout_id = tools["shell"].rollout_id(iid)
        shared = rollout_id == tools["read_file"].rollout_id(iid)
        score = await tools["shell"].calc_reward(iid, answer=GOLD)
        again = await tools["read_file"].calc_reward(iid)
        await tools["shell"].release(iid)
        open_after_first_release = iid in adapter.OrchestratorTool._instances
        await tools["read_file"].release(iid)
        return {
            "rollout_before_first_call": before,
            "rollout_id": rollout_id,
            "shared": shared,
            "listing": listing.text,
            "read": read.text,
            "metrics": metrics,
            "score": score,
            "score_again": again,
            "open_after_first_release": open_after_first_release,
            "open_after_last_release": iid in adapter.OrchestratorTool._instances,
        }

    result: dict[str, Any] = run.loop.run_until_complete(trajectory())
    return result


class Killer:
    """Wraps the shell tool's execute: the run's first call kills its sandbox first."""

    killed: ClassVar[dict[str, Any]] = {}

    def __init__(self, tool: adapter.OrchestratorTool) -> None:
        self.tool, self.original = tool, tool.execute

    async def __call__(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[Any, float, dict[str, Any]]:
        agent_data = kwargs.get("agent_data")
        if not Killer.killed and agent_data is not None:
            # Claimed before the first await: trajectories call their tools concurrently.
            Killer.killed["request_id"] = agent_data.request_id
            # The rollout starts at the first call: start it, then kill its sandbox.
            session = self.tool._trajectory(instance_id, agent_data)
            rollout_id = await self.tool._ensure_rollout(session)
            kill_sandbox(rollout_id)
            Killer.killed["rollout_id"] = rollout_id
        return await self.original(instance_id, parameters, **kwargs)


def sabotage(args: argparse.Namespace) -> dict[str, Any]:
    run = verl_agent_loop.build(run_args(args, "flag"))
    try:
        shell = next(t for t in run.worker.tools if t.name == "shell")
        shell.execute = Killer(shell)
        out = verl_agent_loop.execute(run)
        samples = verl_agent_loop.samples(out)
        kept = adapter.drop_infra_failed(out)
        advantage = verl_agent_loop.advantages(out)
        flagged = [s for s in samples if s["infra_failed"]]
        strict: dict[str, Any] = {"raised": None}
        if flagged:
            # The flagged sample's extra_info as verl's reward manager would build it.
            extra = {
                adapter.ROLLOUT_ID: flagged[0]["rollout_id"],
                adapter.INFRA_FAILED: True,
                adapter.INFRA_ERROR: flagged[0]["infra_error"],
            }
            try:
                strict["returned"] = run.loop.run_until_complete(
                    adapter.compute_score(
                        "orchestrator/codebase-planning",
                        GOLD,
                        None,
                        extra,
                        base_url=args.base_url,
                        token=args.token,
                    )
                )
            except InfraFailure as exc:
                strict = {"raised": type(exc).__name__, "message": str(exc)[:300]}
        result = {
            "killed": dict(Killer.killed),
            "samples": samples,
            "kept_uids": [str(u) for u in kept.non_tensor_batch["uid"]],
            "kept_count": len(kept),
            "total": len(out),
            **advantage,
            "raise_mode": strict,
            "sessions_left": len(adapter.OrchestratorTool._trajectories)
            + len(adapter.OrchestratorTool._instances),
        }
    finally:
        verl_agent_loop.finish(run)
    return result


def main() -> int:
    args = checks_parser().parse_args()
    run = verl_agent_loop.build(run_args(args, "raise"))
    try:
        result: dict[str, Any] = {"loader": loader(run), "explicit": explicit(run, args.codebase)}
    finally:
        verl_agent_loop.finish(run)
    result["sabotage"] = sabotage(args)
    args.report.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
