"""The trainer adapters against a real stack, without the trainers (inside them:
tests/e2e/test_trl.py and test_verl.py): TRL's environment class and verl's tool class
end to end, infra failures reaching each as a drop, never a zero."""

from __future__ import annotations

import asyncio
import inspect
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from orchestrator.adapters.trl import OrchestratorEnvironment, environment_factory, reward_function
from orchestrator.adapters.verl import (
    INFRA_ERROR,
    INFRA_FAILED,
    ROLLOUT_ID,
    TOOL_CALLS,
    OrchestratorTool,
    compute_score,
    infra_failed_mask,
)
from orchestrator.client import InfraFailure, RolloutClient
from tests.e2e.helpers import file_f1, sandboxes_of
from tests.stacks import TOKEN, Stack
from tests.trainers.common import kill_sandbox

pytestmark = pytest.mark.xdist_group("e2e")

GOLD = '["src/requests/sessions.py", "src/requests/adapters.py"]'
VERL_TOOL_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "verl_tool_config.yaml"


def state_of(stack: Stack, rollout_id: str) -> str:
    with RolloutClient(stack.base_url, TOKEN) as client:
        return client.get(rollout_id).state


def answer(text: str) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": text}]


# -- TRL ---------------------------------------------------------------------------------------


def test_trl_environment_exposes_only_its_tools(stack: Stack) -> None:
    env = environment_factory(stack.base_url, TOKEN)()
    # What GRPOTrainer does: every public method but reset becomes a tool.
    tools = {
        name: member
        for name, member in inspect.getmembers(env, predicate=inspect.ismethod)
        if name != "reset" and not name.startswith("_")
    }
    assert set(tools) == {"shell", "read_file"}
    for member in tools.values():
        assert "Args:" in (member.__doc__ or "")
        hints = inspect.signature(member).parameters
        assert all(p.annotation is not inspect.Parameter.empty for p in hints.values())


def test_trl_environment_end_to_end(stack: Stack, planning_item: dict[str, Any]) -> None:
    factory = environment_factory(stack.base_url, TOKEN, environment="codebase-planning")
    env = factory()
    # TRL passes the whole row, its prompt column included.
    assert env.reset(**planning_item) is None
    first = env.rollout_id
    assert first is not None and sandboxes_of(stack.settings, first)
    assert "sessions.py" in env.shell("ls src/requests")
    assert "1" in env.read_file("src/requests/sessions.py", start_line=1, end_line=2)
    env.shell("exit 3")
    assert env.tool_calls == 3

    # A new episode on the same instance closes the previous rollout.
    env.reset(**planning_item)
    assert env.rollout_id != first
    assert state_of(stack, first) == "closed"
    assert env.tool_calls == 0

    scores = reward_function()(completions=[answer(GOLD)], environments=[env])
    assert scores == [pytest.approx(file_f1(GOLD, planning_item))]
    assert env.rollout_id is not None
    assert state_of(stack, env.rollout_id) == "closed"
    assert sandboxes_of(stack.settings, env.rollout_id) == []


def test_trl_infra_failure_is_a_dropped_sample(stack: Stack, planning_item: dict[str, Any]) -> None:
    factory = environment_factory(stack.base_url, TOKEN)
    env, healthy = factory(), factory()
    env.reset(**planning_item)
    healthy.reset(**planning_item)
    assert env.rollout_id is not None
    env.shell("true")
    kill_sandbox(env.rollout_id, stack.settings)
    with pytest.raises(InfraFailure):
        env.shell("echo after")
    assert env.infra_failed and env.infra_error

    environments: list[OrchestratorEnvironment] = [env, healthy]
    strict = reward_function(on_infra_failure="raise")
    with pytest.raises(InfraFailure):
        strict(completions=[answer(GOLD)] * 2, environments=environments)
    assert state_of(stack, env.rollout_id) == "infra_failed"
    assert sandboxes_of(stack.settings, env.rollout_id) == []
    # The healthy sample was graded before the batch raised; graded again, same score.
    healthy.reset(**planning_item)
    env.reset(**planning_item)
    kill_sandbox(str(env.rollout_id), stack.settings)
    with pytest.raises(InfraFailure):
        env.shell("true")
    scores = reward_function()(completions=[answer(GOLD)] * 2, environments=environments)
    assert scores[0] is None, "an infra failure is never a score"
    assert scores[1] == pytest.approx(file_f1(GOLD, planning_item))


# -- verl --------------------------------------------------------------------------------------
# The adapter without verl (its real agent loop: tests/e2e/test_verl.py): tools built from
# the example YAML as verl builds them, and verl's per-call create/execute/release with an
# AgentData stand-in (request_id, tools_kwargs, extra_fields: what the adapter reads).


def verl_tools(stack: Stack, **config: Any) -> dict[str, OrchestratorTool]:
    tools = {}
    for entry in yaml.safe_load(VERL_TOOL_CONFIG.read_text())["tools"]:
        assert entry["class_name"] == "orchestrator.adapters.verl.OrchestratorTool"
        settings = {**entry["config"], "base_url": stack.base_url, "token": TOKEN, **config}
        tool = OrchestratorTool(settings, entry["tool_schema"])
        tools[tool.name] = tool
    return tools


def agent_data(row: dict[str, Any]) -> SimpleNamespace:
    kwargs = {"create_kwargs": {"item": row}}
    return SimpleNamespace(
        request_id=uuid.uuid4().hex,
        tools_kwargs={"shell": kwargs, "read_file": kwargs},
        extra_fields={},
    )


async def verl_call(
    tool: OrchestratorTool, data: SimpleNamespace, arguments: dict[str, Any]
) -> tuple[Any, float, dict[str, Any]]:
    """One tool call as verl 0.9.1's ToolAgentLoop makes it."""
    instance, _ = await tool.create(create_kwargs=data.tools_kwargs[tool.name]["create_kwargs"])
    try:
        return await tool.execute(instance, arguments, agent_data=data)
    finally:
        await tool.release(instance)


def test_verl_config_schemas_match_the_server(stack: Stack, planning_item: dict[str, Any]) -> None:
    tools = verl_tools(stack)
    with (
        RolloutClient(stack.base_url, TOKEN) as client,
        client.rollout(codebase=stack.codebase, item=planning_item) as rollout,
    ):
        served = {t["name"]: t["parameters"] for t in rollout.tools}
    assert set(tools) == set(served)
    for name, tool in tools.items():
        ours = tool.get_openai_tool_schema()["function"]["parameters"]
        assert ours["required"] == served[name]["required"]
        assert set(ours["properties"]) == set(served[name]["properties"])


def test_verl_trajectory_keeps_one_rollout_across_calls(
    stack: Stack, planning_item: dict[str, Any]
) -> None:
    async def run() -> tuple[SimpleNamespace, dict[str, Any], bool]:
        tools = verl_tools(stack)
        data = agent_data(planning_item)
        try:
            listing, reward, metrics = await verl_call(
                tools["shell"], data, {"command": "ls src/requests"}
            )
            assert "sessions.py" in (listing.text or "") and reward == 0.0
            assert metrics["agent_error"] == 0.0
            first = data.extra_fields[ROLLOUT_ID]
            # verl released the instance; the trajectory's sandbox is still there.
            assert sandboxes_of(stack.settings, first)
            await verl_call(tools["read_file"], data, {"path": "src/requests/sessions.py"})
            await verl_call(tools["shell"], data, {"command": "exit 3"})  # the agent's own error
            assert data.extra_fields[ROLLOUT_ID] == first
            assert data.extra_fields[TOOL_CALLS] == 3
            assert INFRA_FAILED not in data.extra_fields
            extra_info = {"tools_kwargs": data.tools_kwargs, **data.extra_fields}
            result = await compute_score(
                "src", GOLD, None, extra_info, base_url=stack.base_url, token=TOKEN
            )
            sessions_left = bool(OrchestratorTool._trajectories)
        finally:
            await OrchestratorTool.shutdown()
        return data, result, sessions_left

    data, result, sessions_left = asyncio.run(run())
    rollout_id = data.extra_fields[ROLLOUT_ID]
    assert result == {
        "score": pytest.approx(file_f1(GOLD, planning_item)),
        INFRA_FAILED: False,
        ROLLOUT_ID: rollout_id,
    }
    assert not sessions_left, "the reward step ended the trajectory's session"
    with RolloutClient(stack.base_url, TOKEN) as client:
        view = client.get(rollout_id)
    assert (view.state, view.tool_calls) == ("closed", 3)
    assert view.score == pytest.approx(result["score"])
    assert sandboxes_of(stack.settings, rollout_id) == []


def test_verl_score_without_a_tool_call(stack: Stack, planning_item: dict[str, Any]) -> None:
    """The model answered at once: compute_score starts the rollout from tools_kwargs."""

    async def run() -> dict[str, Any]:
        data = agent_data(planning_item)
        try:
            return await compute_score(
                "src",
                f"assistant\n{GOLD}",
                None,
                {"tools_kwargs": data.tools_kwargs},
                base_url=stack.base_url,
                token=TOKEN,
            )
        finally:
            await OrchestratorTool.shutdown()

    result = asyncio.run(run())
    assert result["score"] == pytest.approx(file_f1(GOLD, planning_item))
    with RolloutClient(stack.base_url, TOKEN) as client:
        view = client.get(result[ROLLOUT_ID])
    assert (view.state, view.tool_calls) == ("closed", 0)


def test_verl_explicit_lifecycle(stack: Stack, planning_item: dict[str, Any]) -> None:
    async def run() -> tuple[str | None, str | None, float, float]:
        tools = verl_tools(stack)
        instance = uuid.uuid4().hex
        try:
            for tool in tools.values():
                await tool.create(instance, create_kwargs={"item": planning_item})
            before = tools["shell"].rollout_id(instance)
            text, _, _ = await tools["shell"].execute(
                instance, {"command": "grep -rln 'class Session' src"}
            )
            assert "src/requests/sessions.py" in (text.text or "")
            await tools["read_file"].execute(instance, {"path": "src/requests/sessions.py"})
            rollout_id = tools["shell"].rollout_id(instance)
            assert rollout_id == tools["read_file"].rollout_id(instance), "one shared rollout"
            await tools["shell"].release(instance)
            assert sandboxes_of(stack.settings, str(rollout_id)), "one tool still holds it"
            # The grade closes the rollout (grace_after_grade_s 0); the first score stands.
            score = await tools["read_file"].calc_reward(instance, answer=GOLD)
            again = await tools["read_file"].calc_reward(instance)
            await tools["read_file"].release(instance)
        finally:
            await OrchestratorTool.shutdown()
        return before, rollout_id, score, again

    before, rollout_id, score, again = asyncio.run(run())
    assert before is None, "created lazily, at the first call"
    assert score == again == pytest.approx(file_f1(GOLD, planning_item))
    assert rollout_id is not None
    assert state_of(stack, rollout_id) == "closed"
    assert sandboxes_of(stack.settings, rollout_id) == []


def test_verl_infra_failure_is_flagged_never_scored(
    stack: Stack, planning_item: dict[str, Any]
) -> None:
    async def run() -> tuple[SimpleNamespace, dict[str, Any], SimpleNamespace]:
        shell = verl_tools(stack)["shell"]
        data, healthy = agent_data(planning_item), agent_data(planning_item)
        try:
            await verl_call(shell, data, {"command": "true"})
            await verl_call(shell, healthy, {"command": "true"})
            await asyncio.to_thread(kill_sandbox, data.extra_fields[ROLLOUT_ID], stack.settings)
            with pytest.raises(InfraFailure):
                await verl_call(shell, data, {"command": "echo after"})
            with pytest.raises(InfraFailure):  # sticky: not sent again
                await verl_call(shell, data, {"command": "echo again"})
            assert data.extra_fields[INFRA_FAILED] is True
            assert data.extra_fields[INFRA_ERROR]
            extra = {"tools_kwargs": data.tools_kwargs, **data.extra_fields}
            with pytest.raises(InfraFailure):
                await compute_score("src", GOLD, None, extra, base_url=stack.base_url, token=TOKEN)
            flagged = await compute_score(
                "src",
                GOLD,
                None,
                extra,
                base_url=stack.base_url,
                token=TOKEN,
                on_infra_failure="flag",
            )
            scored = await compute_score(
                "src",
                GOLD,
                None,
                {"tools_kwargs": healthy.tools_kwargs, **healthy.extra_fields},
                base_url=stack.base_url,
                token=TOKEN,
                on_infra_failure="flag",
            )
        finally:
            await OrchestratorTool.shutdown()
        return data, {"flagged": flagged, "scored": scored}, healthy

    data, results, _ = asyncio.run(run())
    rollout_id = data.extra_fields[ROLLOUT_ID]
    assert results["flagged"] == {"score": 0.0, INFRA_FAILED: True, ROLLOUT_ID: rollout_id}
    assert results["scored"]["score"] == pytest.approx(file_f1(GOLD, planning_item))
    assert state_of(stack, rollout_id) == "infra_failed"
    assert sandboxes_of(stack.settings, rollout_id) == []
    # What drop_infra_failed removes: the tool's flag column, or the reward's own flag
    # (verl's extra_fields column of the same name may hide it: None where no tool flagged).
    batch = {
        INFRA_FAILED: [True, None, None],
        "reward_extra_info": [results["flagged"], results["scored"], {INFRA_FAILED: True}],
    }
    assert infra_failed_mask(batch) == [True, False, True]


def test_verl_stale_trajectory_sessions_are_pruned(
    stack: Stack, planning_item: dict[str, Any]
) -> None:
    async def run() -> tuple[str, bool]:
        shell = verl_tools(stack, session_ttl_s=0.5)["shell"]
        data = agent_data(planning_item)
        try:
            await verl_call(shell, data, {"command": "true"})  # never scored here
            await asyncio.sleep(0.6)
            await shell.create(create_kwargs={})  # any later create prunes
            return data.extra_fields[ROLLOUT_ID], data.request_id in OrchestratorTool._trajectories
        finally:
            await OrchestratorTool.shutdown()

    rollout_id, kept = asyncio.run(run())
    assert not kept
    assert state_of(stack, rollout_id) == "closed"
    assert sandboxes_of(stack.settings, rollout_id) == []
