"""The audit log (state/audit.py) and tenants' quotas (state/quotas.py) on real Redis:
what is recorded once, what is read back, and the quotas' Lua counted exactly, without an
API. tests/e2e/test_tenancy.py runs both through a real API process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from orchestrator.config import Settings
from orchestrator.state import quotas as quotas_module
from orchestrator.state.audit import AuditEntry, AuditEvent, AuditLog
from orchestrator.state.quotas import OverQuota, TenantQuotas
from orchestrator.state.records import RolloutStore
from orchestrator.tenants import Principal, Quotas
from tests.redis_units import own_deployment


@pytest.fixture()
def unit(settings: Settings) -> Iterator[Settings]:
    with own_deployment(settings, "aq") as own:
        yield own


def test_an_entry_every_process_sees_is_recorded_once(unit: Settings) -> None:
    async def main() -> list[AuditEntry]:
        store = RolloutStore.connect(unit, role="test")
        try:
            log = AuditLog(store.redis, store.keys)
            revoked = AuditEntry(
                event=AuditEvent.CREDENTIAL_REVOKED,
                actor="tenants-file",
                details={"tenant": "team-a", "credential": "0123456789ab"},
            )
            # Three API processes notice one change of the file.
            firsts = await asyncio.gather(
                *(log.record(revoked, once="revoked:team-a:1") for _ in range(3))
            )
            assert sorted(firsts) == [False, False, True]
            ended = AuditEntry(
                event=AuditEvent.ROLLOUT_ENDED, actor="ops", details={"rollout_id": "ro_1"}
            )
            await log.record(ended)
            environments = AuditEntry(event=AuditEvent.ENVIRONMENTS_CHANGED, actor="api")
            assert await log.record_if_changed("environments", "d1", environments)
            assert not await log.record_if_changed("environments", "d1", environments)
            assert await log.record_if_changed("environments", "d2", environments)
            return await log.read(since=time.time() - 60)
        finally:
            await store.close()

    entries = asyncio.run(main())
    assert [e.event for e in entries] == [
        AuditEvent.CREDENTIAL_REVOKED,
        AuditEvent.ROLLOUT_ENDED,
        AuditEvent.ENVIRONMENTS_CHANGED,
        AuditEvent.ENVIRONMENTS_CHANGED,
    ]
    assert entries[0].details == {"tenant": "team-a", "credential": "0123456789ab"}
    assert all(e.id for e in entries) and entries[1].actor == "ops"


def test_a_quota_of_sandboxes_is_exact_under_a_burst(unit: Settings) -> None:
    """Twenty rollouts of one tenant enter at once against a quota of 5: five get in."""
    caller = Principal("t", quotas=Quotas(sandboxes=5))

    async def main() -> tuple[list[BaseException | None], int]:
        store = RolloutStore.connect(unit, role="test")
        quotas = TenantQuotas(store)
        try:
            results = await asyncio.gather(
                *(quotas.enter(caller, f"ro_{n}") for n in range(20)), return_exceptions=True
            )
            # Which five got in is the order Redis ran them in, not the order asked.
            inside = next(f"ro_{n}" for n, result in enumerate(results) if result is None)
            await quotas.enter(caller, inside)  # in already: entering again is nothing
            await quotas.leave("t", inside)
            await quotas.enter(caller, "ro_new")  # the place it left
            return results, await quotas.held("t")
        finally:
            await store.close()

    results, held = asyncio.run(main())
    refused = [r for r in results if isinstance(r, OverQuota)]
    assert len(refused) == 15 and {r.quota for r in refused} == {"sandboxes"}
    assert held == 5


def test_a_rate_quota_lets_a_seconds_worth_through_then_the_rate(unit: Settings) -> None:
    caller = Principal("r", quotas=Quotas(calls_per_s=4))

    async def main() -> tuple[int, int, int]:
        store = RolloutStore.connect(unit, role="test")
        quotas = TenantQuotas(store)
        try:

            async def taken(n: int) -> int:
                got = 0
                for _ in range(n):
                    try:
                        await quotas.call(caller)
                        got += 1
                    except OverQuota as exc:
                        assert exc.retry_after_s == 1 and exc.quota == "calls_per_s"
                return got

            burst = await taken(10)
            await asyncio.sleep(0.6)  # 0.6 s at 4/s: two tokens more
            later = await taken(10)
            free = await taken_free(quotas)
            return burst, later, free
        finally:
            await store.close()

    async def taken_free(quotas: TenantQuotas) -> int:
        for _ in range(50):
            await quotas.call(Principal("no-quota"))  # no bucket: never refused
        return 50

    burst, later, free = asyncio.run(main())
    assert burst == 4
    # At least 0.6 s at 4/s went by (two tokens); a slow machine adds more, never past
    # one second's worth.
    assert 2 <= later <= 4
    assert free == 50


def test_a_creations_rate_of_one_is_told_apart_from_the_sandboxes_quota(
    unit: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 1/s, two creations in the same instant leave a wait of exactly one second: it
    must read as the rate's refusal, never as the sandboxes quota's (whose answer is also
    a 1). The quotas' clock is held still to make that instant."""
    caller = Principal("c", quotas=Quotas(creations_per_s=1))
    monkeypatch.setattr(quotas_module, "time", SimpleNamespace(time=lambda: 1_000_000.0))

    async def main() -> OverQuota:
        store = RolloutStore.connect(unit, role="test")
        quotas = TenantQuotas(store)
        try:
            await quotas.enter(caller, "ro_first")
            with pytest.raises(OverQuota) as refused:
                await quotas.enter(caller, "ro_second")
            return refused.value
        finally:
            await store.close()

    refused = asyncio.run(main())
    assert refused.quota == "creations_per_s" and refused.retry_after_s == 1


def test_a_warm_share_is_exact_under_a_burst_and_given_back(unit: Settings) -> None:
    """Ten rollouts of one tenant ask for a warm sandbox at once against a share of 3:
    three may; one that leaves (or found its pool empty) makes room for another. A tenant
    with no share never asks Redis."""
    caller = Principal("w", quotas=Quotas(warm_sandboxes=3))

    async def main() -> None:
        store = RolloutStore.connect(unit, role="test")
        quotas = TenantQuotas(store)
        try:
            results = await asyncio.gather(
                *(quotas.enter_warm(caller, f"ro_{n}") for n in range(10))
            )
            assert results.count(True) == 3
            inside = [f"ro_{n}" for n, ok in enumerate(results) if ok]
            assert await quotas.enter_warm(caller, inside[0])  # in already
            outside = next(f"ro_{n}" for n, ok in enumerate(results) if not ok)
            assert not await quotas.enter_warm(caller, outside)
            await quotas.leave(caller.tenant, inside[0])  # closed
            assert await quotas.enter_warm(caller, outside)
            await quotas.leave_warm(caller.tenant, inside[1])  # its pool was empty
            assert await quotas.enter_warm(caller, "ro_late")
            assert not await quotas.enter_warm(caller, "ro_later")
            unbounded = Principal("free")
            assert all([await quotas.enter_warm(unbounded, f"x{n}") for n in range(5)])
            assert await store.redis.exists(store.keys.tenant_warm("free")) == 0
        finally:
            await store.close()

    asyncio.run(main())
