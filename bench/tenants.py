"""Two tenants on one deployment (docs/tenancy.md): does one's burst starve the other?

    python -m bench.tenants [--quota 6] [--rounds 4] [--factor 3]

Starts its own deployment (API, one worker, beat; ``orchestrator up``) with a tenants file
of two tenants, A and B, each with a quota of ``--quota`` sandboxes, on the benchmark
codebase (this Python's standard library). Per round, in an order turned each round:

- ``alone``: A bursts ``quota`` new rollouts at once (``POST /v1/rollouts``), then B does;
- ``together``: A bursts ``factor × quota`` while B bursts ``quota``, at the same moment;
- ``unbounded``: the same, with C (a tenant with no quota) in A's place: what B meets
  without the quotas (the host holds ``2 × quota + 2`` sandboxes; admission's fair share
  is all that is left between them, and a rollout that waits 10 s for a slot is refused).

Acquisition is the client's request to its 201 (the sandbox made and answering). Every
burst's rollouts are ended before the next. Reports, per tenant and phase, the rollouts
asked and seated, p50/p99/max acquisition, and A's refusals (429 ``over_quota``: how fast
the excess is told). Writes bench/results/tenants.json and .md.

The load generator runs on the same cores as the stack: its figures include that contention.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import yaml

from bench.common import (
    BENCH_CODEBASE,
    STACK_ENVIRONMENTS,
    ensure_bench_codebase,
    summary,
    throwaway_stack_settings,
    write_report,
)
from orchestrator.local import local_stack
from orchestrator.tenants import digest

ADMISSION_WAIT_S = 10.0


@dataclass
class Burst:
    """One tenant's burst: each request's status and seconds, the rollouts it made."""

    statuses: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    made: list[str] = field(default_factory=list)

    def seated_s(self) -> list[float]:
        return [s for c, s in zip(self.statuses, self.seconds, strict=True) if c == 201]

    def refused_s(self) -> list[float]:
        return [s for c, s in zip(self.statuses, self.seconds, strict=True) if c == 429]


async def burst(client: httpx.AsyncClient, token: str, count: int) -> Burst:
    """``count`` new rollouts at once, as tenant ``token``."""
    headers = {"Authorization": f"Bearer {token}"}
    item = {"codebase": BENCH_CODEBASE, "gold_files": ["os.py"]}

    async def one() -> tuple[int, float, str]:
        started = time.perf_counter()
        answer = await client.post("/v1/rollouts", json={"item": item}, headers=headers)
        seconds = time.perf_counter() - started
        made = answer.json().get("rollout_id", "") if answer.status_code == 201 else ""
        return answer.status_code, seconds, made

    found = Burst()
    for status, seconds, made in await asyncio.gather(*(one() for _ in range(count))):
        found.statuses.append(status)
        found.seconds.append(seconds)
        if made:
            found.made.append(made)
    return found


async def end(client: httpx.AsyncClient, token: str, bursts: list[Burst]) -> None:
    headers = {"Authorization": f"Bearer {token}"}
    await asyncio.gather(
        *(
            client.delete(f"/v1/rollouts/{rollout}", headers=headers)
            for one in bursts
            for rollout in one.made
        )
    )


async def run(base: str, tokens: dict[str, str], quota: int, rounds: int, factor: int) -> Any:
    phases: dict[tuple[str, str], list[Burst]] = {}
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        # Not measured: the first sandboxes of a fresh host (image layers into the cache).
        warm = await burst(client, tokens["b"], quota)
        await end(client, tokens["b"], [warm])
        for number in range(rounds):

            async def alone() -> None:
                for tenant in ("a", "b"):
                    one = await burst(client, tokens[tenant], quota)
                    await end(client, tokens[tenant], [one])
                    phases.setdefault((tenant, "alone"), []).append(one)

            async def beside(other: str, phase: str) -> None:
                big, b = await asyncio.gather(
                    burst(client, tokens[other], factor * quota), burst(client, tokens["b"], quota)
                )
                await end(client, tokens[other], [big])
                await end(client, tokens["b"], [b])
                phases.setdefault((other, phase), []).append(big)
                phases.setdefault(("b", phase), []).append(b)

            async def together() -> None:
                await beside("a", "together")

            async def unbounded() -> None:
                await beside("c", "unbounded")

            order = [alone, together, unbounded]
            for phase in order[number % 3 :] + order[: number % 3]:
                await phase()
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quota", type=int, default=6, help="each tenant's sandboxes quota")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--factor", type=int, default=3, help="A's burst, in quotas, together")
    args = parser.parse_args()

    settings = throwaway_stack_settings("bench-tenants", STACK_ENVIRONMENTS)
    tokens = {name: secrets.token_urlsafe(32) for name in ("a", "b", "c")}
    tenants_file = settings.state_dir / "tenants.yaml"
    tenants_file.write_text(
        yaml.safe_dump(
            {
                "tenants": {
                    f"tenant-{name}": {
                        "tokens": [digest(token)],
                        "quotas": {"sandboxes": args.quota} if name != "c" else {},
                    }
                    for name, token in tokens.items()
                }
            }
        )
    )
    settings = settings.model_copy(
        update={
            "tenants_file": tenants_file,
            # Room for both quotas at once: what is measured is the quotas, not the host.
            "host_max_sandboxes": 2 * args.quota + 2,
            # Past the host's room (the unbounded phase), a new rollout waits this long for
            # a slot, then is refused (429): the seated ones are ended only after the burst.
            "admission_wait_s": ADMISSION_WAIT_S,
        }
    )
    ensure_bench_codebase(settings)
    with local_stack(settings, log=settings.state_dir / "stack.log", forget=True) as base:
        phases = asyncio.run(run(base, tokens, args.quota, args.rounds, args.factor))

    rows: list[dict[str, Any]] = []
    for (tenant, phase), bursts in sorted(phases.items()):
        pooled = Burst()
        for one in bursts:
            pooled.statuses += one.statuses
            pooled.seconds += one.seconds
            pooled.made += one.made
        seated = [s * 1000 for s in pooled.seated_s()]
        refused = [s * 1000 for s in pooled.refused_s()]
        rows.append(
            {
                "tenant": tenant,
                "phase": phase,
                "asked": len(pooled.statuses),
                "seated": len(seated),
                "refused_429": len(refused),
                "other": len(pooled.statuses) - len(seated) - len(refused),
                "acquisition_ms": summary(seated),
                "acquisition_max_ms": round(max(seated), 1) if seated else None,
                "refusal_ms": summary(refused) if refused else None,
            }
        )
    by = {(r["tenant"], r["phase"]): r for r in rows}

    def p99(tenant: str, phase: str) -> float:
        return float(by[(tenant, phase)]["acquisition_ms"]["p99"])

    ratio = {
        "a_together": round(p99("a", "together") / p99("a", "alone"), 2),
        "b_together": round(p99("b", "together") / p99("b", "alone"), 2),
        "b_unbounded": round(p99("b", "unbounded") / p99("b", "alone"), 2),
    }
    b_seated_unbounded = by[("b", "unbounded")]["seated"]
    lines = [
        f"# Two tenants, quota {args.quota} sandboxes each, {args.rounds} rounds "
        f"(A bursts {args.factor}x its quota together)",
        "",
        "| tenant | phase | asked | seated | 429 | other | p50 ms | p99 ms | max ms | 429 p50 ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acq = r["acquisition_ms"]
        refusal = r["refusal_ms"]["p50"] if r["refusal_ms"] else "-"
        lines.append(
            f"| {r['tenant']} | {r['phase']} | {r['asked']} | {r['seated']} | "
            f"{r['refused_429']} | {r['other']} | {acq['p50']:.0f} | {acq['p99']:.0f} | "
            f"{r['acquisition_max_ms']} | {refusal} |"
        )
    lines += [
        "",
        f"B's p99 over its p99 alone: {ratio['b_together']}x beside A (quota {args.quota}), "
        f"{ratio['b_unbounded']}x beside C (no quota; B seated {b_seated_unbounded} of "
        f"{by[('b', 'unbounded')]['asked']}). A's own: {ratio['a_together']}x.",
        "",
    ]
    markdown = "\n".join(lines)
    print(markdown)
    path = write_report(
        "tenants",
        {
            "quota": args.quota,
            "rounds": args.rounds,
            "factor": args.factor,
            "rows": rows,
            "p99_together_over_alone": ratio,
        },
        markdown,
    )
    print(f"report: {path}")


if __name__ == "__main__":
    main()
