"""How big each warm pool should be, and what its sandboxes are: the policy, apart from
the pools' storage (state/pools.py).

A pool's size follows demand (:func:`pool_size`): the peak of its live rollouts over the
last ``pool_demand_window_s`` (the reaper records it from the records of the rollouts live
at some moment since its last pass, :func:`peak_concurrency`, :func:`next_demand`), or the
environment's ``expected_concurrency`` before any is seen, plus ``pool_headroom``, never
below a hand-set ``pool_size``, never above what the live hosts can hold. Every pool of
the configuration, with the spec of its sandboxes: :func:`targets`. No I/O here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

from orchestrator.config import Settings
from orchestrator.environments.loader import EnvironmentRegistry
from orchestrator.environments.models import EnvironmentConfig
from orchestrator.sandbox.backend import CommitWorkspace, SandboxSpec

POOL_LABEL = "pool"
"""The rollout label of a pool sandbox until a rollout takes it."""


class PoolDemand(BaseModel):
    """One pool's recent demand: the most rollouts of its (environment, codebase) live at
    once, held for the demand window from when it was seen (the reaper's passes)."""

    environment: str
    codebase: str | None = None
    peak: int = 0
    at: float = 0.0
    workspace: CommitWorkspace | None = Field(
        None, description="The repository at a commit the pool's sandboxes are (its rows')."
    )


def next_demand(previous: PoolDemand | None, seen: PoolDemand, window_s: float) -> PoolDemand:
    """The demand to keep after a pass that saw ``seen.peak`` live rollouts at ``seen.at``:
    a new high replaces the peak; an old peak (past the window) gives way to what is live."""
    if previous is None or seen.peak >= previous.peak or seen.at - previous.at > window_s:
        return seen
    return previous


def peak_concurrency(spans: list[tuple[str, float, float | None]]) -> dict[str, int]:
    """The most rollouts of each pool live at once, from each rollout's ``(pool, created_at,
    closed_at or None while live)``. A rollout closed at the moment another starts does
    not count beside it."""
    events: dict[str, list[tuple[float, int]]] = {}
    for pool, created, closed in spans:
        events.setdefault(pool, []).append((created, 1))
        if closed is not None:
            events[pool].append((closed, -1))
    peaks: dict[str, int] = {}
    for pool, changes in events.items():
        live = peak = 0
        for _, change in sorted(changes):  # at one instant, closes (-1) before starts
            live += change
            peak = max(peak, live)
        peaks[pool] = peak
    return peaks


def parse_demand(raw: Mapping[Any, Any]) -> dict[str, PoolDemand]:
    """The demand hash (state/keys.Keys.pool_demand) as pool name -> demand."""
    return {
        (k.decode() if isinstance(k, bytes) else str(k)): PoolDemand.model_validate_json(v)
        for k, v in raw.items()
    }


def pool_size(env: EnvironmentConfig, settings: Settings, demand: PoolDemand | None) -> int:
    """How many ready sandboxes to keep for one of ``env``'s pools: demand-sized (the peak
    seen, else ``expected_concurrency``, plus headroom) unless autosizing is off, never
    below ``pool_size``, never above ``pool_max_sandboxes``."""
    if not (settings.pool_autosize and env.pool_autosize):
        return env.pool_size
    wanted = max(demand.peak if demand else 0, env.expected_concurrency)
    sized = math.ceil(wanted * (1 + settings.pool_headroom)) if wanted else 0
    return min(max(env.pool_size, sized), max(env.pool_size, settings.pool_max_sandboxes))


def autosized(env: EnvironmentConfig, settings: Settings) -> bool:
    return settings.pool_autosize and env.pool_autosize


def same_spec(a: SandboxSpec, b: SandboxSpec) -> bool:
    """Whether sandboxes of ``a`` and ``b`` are alike (their owner and lifetime aside): a
    recycled sandbox goes only to a pool whose sandboxes it is like."""
    ignore = {"rollout_id", "lifetime_s"}
    return a.model_dump(exclude=ignore) == b.model_dump(exclude=ignore)


@dataclass(frozen=True)
class PoolTarget:
    """One pool: what its sandboxes are made from and how many to keep."""

    name: str
    size: int
    spec: SandboxSpec
    recycles: bool = False
    """Its rollouts' sandboxes come back to it (recycling): refills leave room for them."""


def recycles(env: EnvironmentConfig, settings: Settings) -> bool:
    """Whether ``env``'s sandboxes are recycled (rollouts/recycling.py decides per rollout)."""
    reuse = env.reuse if env.reuse is not None else settings.sandbox_reuse
    return reuse and settings.sandbox_backend == "docker"


def pool_name(environment: str, codebase: str | None) -> str:
    return f"{environment}:{codebase or '-'}"


def pooled_codebases(
    env: EnvironmentConfig,
    settings: Settings | None = None,
    demand: Mapping[str, PoolDemand] | None = None,
) -> list[str | None]:
    """The codebases ``env`` keeps pools of (None: its fixed image); empty: no pool. Those
    it configures (``pool_size`` or ``expected_concurrency`` set), and, when it sizes its
    pools by demand, every codebase its rollouts used within the demand window."""
    fixed = [env.codebase] if env.codebase or env.image else list(env.pool_codebases)
    auto = settings is not None and autosized(env, settings)
    configured = env.pool_size > 0 or (auto and env.expected_concurrency > 0)
    codebases: list[str | None] = list(fixed) if configured else []
    if auto:
        own = env.codebase or env.image
        for seen in (demand or {}).values():
            if seen.environment == env.name:
                at_commit = seen.workspace is not None
                codebases.append(seen.codebase if at_commit or not own else fixed[0])
    return list(dict.fromkeys(codebases))


def targets(
    registry: EnvironmentRegistry,
    settings: Settings,
    demand: Mapping[str, PoolDemand] | None = None,
) -> Iterator[PoolTarget]:
    """Every pool, with the spec of its sandboxes and its size now (:func:`pool_size`).
    An environment whose codebase comes from the dataset row pools the codebases it lists
    in ``pool_codebases`` and, sized by demand, those its recent rollouts used."""
    demand = demand or {}
    for name in registry.names():
        env = registry.get(name)
        for codebase in pooled_codebases(env, settings, demand):
            row: dict[str, Any] = {"environment": name}
            seen = demand.get(pool_name(name, codebase))
            workspace = seen.workspace if seen is not None else None
            if workspace is not None:  # a repository at a commit, as its rows named it
                row |= {"repo": workspace.repo, "commit": workspace.commit}
            elif codebase:
                row["codebase"] = codebase
            try:
                resolved = registry.resolve(row, workspace=workspace)
            except (LookupError, ValueError):
                continue  # a codebase not built (yet): nothing to pool
            pool = pool_name(name, resolved.codebase)
            yield PoolTarget(
                name=pool,
                size=pool_size(env, settings, demand.get(pool)),
                spec=resolved.sandbox_spec(settings, POOL_LABEL),
                recycles=recycles(env, settings),
            )
