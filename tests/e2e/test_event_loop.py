"""Nothing on the call path blocks the API's event loop: the API runs with asyncio's debug
mode (``ORCH_ASYNCIO_DEBUG``), which logs every callback or task step that holds the loop
longer than ``slow_callback_duration`` (100 ms), and a rollout's calls, file reads and
grade must leave no such line in its log.

A blocking Docker call, a synchronous Redis client or a file read of a large workspace
on the loop stalls every other rollout served by the same process: at 32 sessions one
such stall is a missed step boundary for all of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator.client import RolloutClient
from tests.stacks import TOKEN, Stack, another_api

CALLS = 20
GOLD = '["src/requests/sessions.py", "src/requests/adapters.py"]'


def _slow_callbacks(log: Path, offset: int) -> list[str]:
    with log.open("rb") as lines:
        lines.seek(offset)
        text = lines.read().decode(errors="replace")
    return [line for line in text.splitlines() if "Executing" in line and " took " in line]


def test_the_call_path_never_blocks_the_event_loop(
    stack: Stack, planning_item: dict[str, Any], tmp_path: Path
) -> None:
    # An API of the main stack's deployment in asyncio's debug mode, on its worker.
    with another_api(stack, tmp_path, asyncio_debug=True) as debug:
        assert debug.logs is not None
        api_log = debug.logs / "api.log"
        with RolloutClient(debug.base_url, TOKEN) as client:
            # The first rollout's start warms what starts once (environments, scripts).
            with client.rollout(
                environment="codebase-planning", codebase=debug.codebase, item=planning_item
            ) as rollout:
                rollout.call("shell", {"command": "true"})
            offset = api_log.stat().st_size
            with client.rollout(
                environment="codebase-planning", codebase=debug.codebase, item=planning_item
            ) as rollout:
                for n in range(CALLS):
                    reply = rollout.call("shell", {"command": f"echo {n}; ls src | head"})
                    assert reply.outcome == "ok"
                assert rollout.call("read_file", {"path": "src/requests/api.py"}).outcome == "ok"
                rollout.grade(sample={"output_text": GOLD})
        slow = _slow_callbacks(api_log, offset)
        started = [line for line in api_log.read_text().splitlines() if "api.started" in line]
    assert started and all('"asyncio_debug": true' in line for line in started), started
    assert not slow, "\n".join(slow[:10])
