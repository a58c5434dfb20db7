"""The trainer adapters and their examples against a real stack: TRL's environment class
and verl's tool class end to end, infra failures reaching each as a drop, never a zero."""

from __future__ import annotations

import asyncio
import inspect
import uuid
from typing import Any

import pytest

from examples import trl_environment, verl_tool
from orchestrator.adapters.trl import OrchestratorEnvironment, environment_factory, reward_function
from orchestrator.adapters.verl import OrchestratorTool
from orchestrator.client import InfraFailure, RolloutClient
from orchestrator.sandbox.docker import DockerBackend
from tests.e2e.conftest import TOKEN, Stack
from tests.e2e.helpers import file_f1, sandboxes_of

pytestmark = pytest.mark.xdist_group("e2e")

GOLD = '["src/requests/sessions.py", "src/requests/adapters.py"]'


def kill_sandbox(stack: Stack, rollout_id: str) -> None:
    backend = DockerBackend(stack.settings)
    try:
        (handle,) = [h for h in backend.list_owned() if h.rollout_id == rollout_id]
        backend.client.api.kill(handle.native_id)
    finally:
        backend.client.close()


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
    kill_sandbox(stack, env.rollout_id)
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
    kill_sandbox(stack, str(env.rollout_id))
    with pytest.raises(InfraFailure):
        env.shell("true")
    scores = reward_function()(completions=[answer(GOLD)] * 2, environments=environments)
    assert scores[0] is None, "an infra failure is never a score"
    assert scores[1] == pytest.approx(file_f1(GOLD, planning_item))


def test_trl_example_runs(stack: Stack) -> None:
    args = ["--base-url", stack.base_url, "--token", TOKEN, "--codebase", stack.codebase]
    scores = trl_environment.main([*args, "--rows", "2"])
    assert len(scores) == 2
    assert all(s is not None and 0 <= s <= 1 for s in scores)
    assert any(s for s in scores), "the scripted agent finds at least one gold file"


# -- verl --------------------------------------------------------------------------------------


def verl_tools(stack: Stack, **config: Any) -> dict[str, OrchestratorTool]:
    return verl_tool.load_tools(verl_tool.CONFIG, base_url=stack.base_url, token=TOKEN, **config)


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


def test_verl_tool_end_to_end(stack: Stack, planning_item: dict[str, Any]) -> None:
    async def run() -> tuple[str | None, float, float, dict[str, Any]]:
        tools = verl_tools(stack)
        instance = uuid.uuid4().hex
        try:
            for tool in tools.values():
                assert (await tool.create(create_kwargs={"item": planning_item}))[0]
                await tool.create(instance, item=planning_item)
            rollout_id = tools["shell"].rollout_id(instance)
            assert rollout_id == tools["read_file"].rollout_id(instance), "one shared rollout"
            text, reward, metrics = await tools["shell"].execute(
                instance, {"command": "grep -rln 'class Session' src"}
            )
            assert "src/requests/sessions.py" in (text.text or "")
            assert (reward, metrics["infra_failed"]) == (0.0, 0.0)
            read, _, _ = await tools["read_file"].execute(
                instance, {"path": "src/requests/sessions.py", "end_line": 2}
            )
            assert read.text
            score = await tools["shell"].calc_reward(instance, answer=GOLD)
            again = await tools["read_file"].calc_reward(instance)
            assert OrchestratorTool._sessions[instance].holders == 2
        finally:
            for tool in tools.values():
                await tool.release(instance)
            leftovers = [i for i in OrchestratorTool._sessions if i != instance]
            for tool in tools.values():
                for other in leftovers:
                    await tool.release(other)
            await OrchestratorTool.shutdown()
        return rollout_id, score, again, metrics

    rollout_id, score, again, _ = asyncio.run(run())
    assert score == again == pytest.approx(file_f1(GOLD, planning_item))
    assert rollout_id is not None
    assert state_of(stack, rollout_id) == "closed"
    assert sandboxes_of(stack.settings, rollout_id) == []
    assert OrchestratorTool._sessions == {}


def test_verl_infra_failure_raises_or_flags(stack: Stack, planning_item: dict[str, Any]) -> None:
    async def run() -> str | None:
        strict = verl_tools(stack)["shell"]
        lenient = verl_tools(stack, raise_on_infra_failure=False)["shell"]
        instance = uuid.uuid4().hex
        await strict.create(instance, item=planning_item)
        await lenient.create(instance, item=planning_item)
        rollout_id = strict.rollout_id(instance)
        try:
            assert rollout_id is not None
            await strict.execute(instance, {"command": "true"})
            await asyncio.to_thread(kill_sandbox, stack, rollout_id)
            with pytest.raises(InfraFailure):
                await strict.execute(instance, {"command": "echo after"})
            assert strict.is_infra_failed(instance)
            text, reward, metrics = await lenient.execute(instance, {"command": "echo"})
            assert metrics == {"infra_failed": 1.0} and reward == 0.0
            assert "infrastructure failure" in (text.text or "")
            with pytest.raises(InfraFailure):
                await strict.calc_reward(instance, answer=GOLD)
        finally:
            await strict.release(instance)
            await lenient.release(instance)
            await OrchestratorTool.shutdown()
        return rollout_id

    rollout_id = asyncio.run(run())
    assert rollout_id is not None
    assert state_of(stack, rollout_id) == "infra_failed"
    assert sandboxes_of(stack.settings, rollout_id) == []


def test_verl_example_runs(stack: Stack) -> None:
    args = ["--base-url", stack.base_url, "--token", TOKEN, "--codebase", stack.codebase]
    scores = verl_tool.main([*args, "--rows", "2"])
    assert len(scores) == 2
    assert all(s is not None and 0 <= s <= 1 for s in scores)
    assert any(s for s in scores), "the scripted agent finds at least one gold file"
