"""A TRL ``environment_factory`` environment backed by the orchestrator (no TRL import).

TRL's ``GRPOTrainer(environment_factory=...)`` calls the factory with no arguments, once
per rollout slot, calls ``reset(**row)`` with the dataset row's columns before each
episode, and exposes every other public method as a tool (its schema from the type hints
and the ``Args:`` docstring). So the class's public surface is exactly ``reset`` and the
tools; everything else is private. Each instance owns one rollout at a time.

```python
from orchestrator.adapters.trl import environment_factory, reward_function

factory = environment_factory("http://HOST:8000", TOKEN, environment="codebase-planning")
trainer = GRPOTrainer(..., environment_factory=factory, reward_funcs=reward_function())
```

Infrastructure failures: a tool whose rollout failed for infrastructure reasons raises
:class:`~orchestrator.client.InfraFailure` (TRL shows the model ``{'error': ...}`` for it)
and marks the environment ``infra_failed``. The reward function then returns ``None`` for
that sample, never a score. TRL (1.16, tests/trainers/) turns ``None`` into NaN; a sample
whose every reward function returned ``None`` is unscorable: left out of its group's
mean and standard deviation, its advantage 0, its reward out of the logged mean. So with
``reward_function()`` as the only reward, an infra-failed sample is dropped from the
policy update. Beside other reward functions that score it, it is not: filter on
``env.infra_failed`` there, or use ``on_infra_failure="raise"``, which fails the whole
batch instead.

Rollouts still open when the process exits (a crashed or interrupted run) are closed at
exit, so their sandboxes do not wait for the reaper.
"""

from __future__ import annotations

import atexit
import json
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal

from orchestrator.client import InfraFailure, RetryPolicy, RolloutClient
from orchestrator.client.sync import Rollout
from orchestrator.observability.logging import get_logger

log = get_logger(__name__)

# Dataset columns that are TRL's, not the row's (the prompt is the model's input).
TRAINER_COLUMNS = frozenset({"prompt", "completion", "completions"})


class OrchestratorEnvironment:
    """One sandboxed rollout per episode: ``reset`` starts it, the tools run in it.

    Attributes a reward function may read: ``rollout_id``, ``infra_failed`` (drop the
    sample), ``infra_error`` (why), ``tool_calls``.
    """

    def __init__(
        self,
        client: RolloutClient,
        *,
        environment: str | None = None,
        codebase: str | None = None,
    ) -> None:
        self._client = client
        self._environment = environment
        self._codebase = codebase
        self._rollout: Rollout | None = None
        self.rollout_id: str | None = None
        self.infra_failed = False
        self.infra_error: str | None = None
        self.tool_calls = 0
        _LIVE.add(self)

    def reset(self, **row: Any) -> str | None:
        """Start a new rollout on this dataset row (the previous one is closed first).

        The row may name ``environment`` and ``codebase``; the rest goes to the server as
        the rollout's item (the grader reads its gold answer there).
        """
        self._close()
        self.infra_failed, self.infra_error, self.tool_calls = False, None, 0
        item = {k: v for k, v in row.items() if k not in TRAINER_COLUMNS}
        try:
            self._rollout = self._client.rollout(
                environment=item.get("environment", self._environment),
                codebase=item.get("codebase", self._codebase),
                item=item,
            )
        except InfraFailure as exc:
            self._fail(exc)
            return None
        self.rollout_id = self._rollout.id
        return None

    def shell(self, command: str, timeout_s: float | None = None) -> str:
        """Run a bash command in the sandbox, in /workspace (the codebase).

        Args:
            command: The bash command line, e.g. `grep -rn 'def main' src`.
            timeout_s: Seconds before the command is killed; the environment's default if omitted.

        Returns:
            The command's output (head and tail if long) and its exit status.
        """
        arguments: dict[str, Any] = {"command": command}
        if timeout_s is not None:
            arguments["timeout_s"] = timeout_s
        return self._call("shell", arguments)

    def read_file(
        self, path: str, start_line: int | None = None, end_line: int | None = None
    ) -> str:
        """Read a text file of the codebase, with line numbers.

        Args:
            path: File path relative to /workspace.
            start_line: First line to show, 1-based.
            end_line: Last line to show, inclusive.

        Returns:
            The numbered lines.
        """
        arguments: dict[str, Any] = {"path": path}
        if start_line is not None:
            arguments["start_line"] = start_line
        if end_line is not None:
            arguments["end_line"] = end_line
        return self._call("read_file", arguments)

    # -- private: not tools ---------------------------------------------------------------------

    def _call(self, tool: str, arguments: dict[str, Any]) -> str:
        if self._rollout is None:
            raise RuntimeError("reset() has not started a rollout")
        self.tool_calls += 1
        try:
            return self._rollout.call(tool, arguments).output
        except InfraFailure as exc:
            self._fail(exc)
            raise

    def _grade(self, answer: str) -> float | None:
        """The rollout's score, or None when it failed for infrastructure reasons."""
        try:
            if self.infra_failed or self._rollout is None:
                return None
            return self._rollout.grade(answer=answer).score
        except InfraFailure as exc:
            self._fail(exc)
            return None
        finally:
            self._close()

    def _fail(self, exc: InfraFailure) -> None:
        self.infra_failed, self.infra_error = True, str(exc)
        log.warning("trl.infra_failure", rollout_id=exc.rollout_id, error=str(exc))

    def _close(self) -> None:
        if self._rollout is not None:
            self._rollout.__exit__(None, None, None)
            self._rollout = None


def environment_factory(
    base_url: str,
    token: str | None = None,
    *,
    environment: str | None = None,
    codebase: str | None = None,
    retry: RetryPolicy | None = None,
) -> Callable[[], OrchestratorEnvironment]:
    """The zero-argument factory TRL wants; its environments share one HTTP client."""
    client = RolloutClient(base_url, token, retry=retry)
    return partial(OrchestratorEnvironment, client, environment=environment, codebase=codebase)


# Every environment of the process, for closing what a crashed run leaves open.
_LIVE: weakref.WeakSet[OrchestratorEnvironment] = weakref.WeakSet()


@atexit.register
def _close_open_rollouts() -> None:
    for env in list(_LIVE):
        try:
            env._close()
        except Exception as exc:  # noqa: BLE001 - at exit: the reaper ends what this cannot
            log.warning("trl.close_at_exit_failed", rollout_id=env.rollout_id, error=repr(exc))


def completion_text(completion: Any) -> str:
    """The final answer in a TRL completion: a string, or a conversation whose last
    assistant message holds it."""
    if isinstance(completion, str):
        return completion
    for message in reversed(list(completion or [])):
        if isinstance(message, dict) and message.get("role") == "assistant":
            content = message.get("content")
            if isinstance(content, str):
                return content
            return json.dumps(content)
    return ""


def reward_function(
    *, on_infra_failure: Literal["none", "raise"] = "none"
) -> Callable[..., list[float | None]]:
    """A TRL reward function: each environment's rollout graded by the orchestrator on
    the completion's final text, then closed. An infra-failed rollout gets ``None``
    (or, with ``on_infra_failure="raise"``, the batch raises :class:`InfraFailure`)."""

    def orchestrator_reward(
        completions: Sequence[Any],
        environments: Sequence[OrchestratorEnvironment],
        **_: Any,
    ) -> list[float | None]:
        scores = [
            env._grade(completion_text(completion))
            for completion, env in zip(completions, environments, strict=True)
        ]
        failed = [env.rollout_id for env in environments if env.infra_failed]
        if failed and on_infra_failure == "raise":
            raise InfraFailure(f"rollouts failed for infrastructure reasons: {failed}")
        return scores

    return orchestrator_reward
