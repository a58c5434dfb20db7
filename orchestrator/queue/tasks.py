"""The tasks workers run. Each takes and returns a JSON payload (see payloads.py); an
infrastructure fault comes back as data, with its evidence, not as a Celery exception."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

from celery import shared_task as _shared_task
from celery.signals import worker_ready

from orchestrator.config import get_settings
from orchestrator.observability.logging import get_logger
from orchestrator.queue import worker
from orchestrator.queue.payloads import (
    CreateSandbox,
    DestroySandbox,
    SandboxCreated,
    ToolCall,
    ToolCallDone,
)
from orchestrator.sandbox.backend import SandboxError
from orchestrator.sandbox.gc import collect_expired

log = get_logger(__name__)

Task = Callable[[dict[str, Any]], dict[str, Any]]


def shared_task(name: str) -> Callable[[Task], Task]:
    """Celery's decorator, typed: tasks take and return JSON payloads."""
    decorator: Callable[[Task], Task] = _shared_task(name=name)
    return decorator


def _on_worker_ready(**_: Any) -> None:
    worker.start_heartbeat()
    log.info("worker.ready", host=get_settings().host_id)


worker_ready.connect(_on_worker_ready, weak=False)


def replies(
    fn: Callable[[dict[str, Any]], dict[str, Any]],
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Push the task's result to the caller's reply list as well as returning it."""

    @functools.wraps(fn)
    def wrapper(payload: dict[str, Any]) -> dict[str, Any]:
        result = fn(payload)
        worker.reply(payload, result)
        return result

    return wrapper


@shared_task(name="orchestrator.create_sandbox")
@replies
def create_sandbox(payload: dict[str, Any]) -> dict[str, Any]:
    request = CreateSandbox.model_validate(payload)
    try:
        handle = worker.backend().create(request.spec)
    except SandboxError as exc:
        log.error("sandbox.create_failed", rollout_id=request.rollout_id, error=str(exc))
        return SandboxCreated(error=str(exc)).model_dump(mode="json")
    return SandboxCreated(handle=handle).model_dump(mode="json")


@shared_task(name="orchestrator.run_tool")
@replies
def run_tool(payload: dict[str, Any]) -> dict[str, Any]:
    started = time.time()
    call = ToolCall.model_validate(payload)
    queue_ms = max(0.0, (started - call.enqueued_at) * 1000)
    settings = get_settings()
    config = worker.environments().get(call.environment)
    tool = worker.environments().tools(call.environment)[call.tool]
    try:
        result = tool.run(
            worker.backend(), call.handle, call.arguments, config.tool_settings(settings)
        )
    except SandboxError as exc:
        probe = _probe_evidence(call)
        log.error(
            "tool.infra_error",
            rollout_id=call.rollout_id,
            sandbox_id=call.handle.sandbox_id,
            host=call.handle.host,
            error=str(exc),
            probe=probe,
        )
        return ToolCallDone(
            infra_error=f"{type(exc).__name__}: {exc}",
            evidence={"probe": probe},
            queue_ms=queue_ms,
            exec_ms=(time.time() - started) * 1000,
        ).model_dump(mode="json")
    return ToolCallDone(
        result=result, queue_ms=queue_ms, exec_ms=(time.time() - started) * 1000
    ).model_dump(mode="json")


def _probe_evidence(call: ToolCall) -> dict[str, Any]:
    try:
        return worker.backend().probe(call.handle).model_dump(mode="json")
    except SandboxError as exc:
        return {"alive": False, "detail": f"probe failed: {exc}"}


@shared_task(name="orchestrator.destroy_sandbox")
@replies
def destroy_sandbox(payload: dict[str, Any]) -> dict[str, Any]:
    request = DestroySandbox.model_validate(payload)
    try:
        worker.backend().destroy(request.handle)
    except SandboxError as exc:
        return {"destroyed": False, "error": str(exc)}
    log.info(
        "sandbox.reaped",
        sandbox_id=request.handle.sandbox_id,
        rollout_id=request.handle.rollout_id,
        reason=request.reason,
    )
    return {"destroyed": True}


@shared_task(name="orchestrator.sweep_host")
def sweep_host(_payload: dict[str, Any]) -> dict[str, Any]:
    """Destroy this host's expired sandboxes and leftovers, by label alone."""
    return collect_expired(worker.backend()).model_dump(mode="json")


@shared_task(name="orchestrator.reap")
def reap(_payload: dict[str, Any]) -> dict[str, Any]:
    """Periodic (beat): end rollouts past their idle timeout, lifetime or grading grace,
    and ask every known host to sweep its expired sandboxes."""
    from orchestrator.rollouts.reaper import reap_once

    return asyncio.run(reap_once(get_settings()))
