import asyncio

from services.admission.tenant_gate import TenantGate


async def test_a_tenant_past_its_places_waits_for_its_own_and_no_one_else_does() -> None:
    gate = TenantGate(per_tenant=2)
    release = asyncio.Event()
    entered: list[str] = []

    async def admit(tenant: str, name: str) -> None:
        async with gate.admitting(tenant):
            entered.append(name)
            await release.wait()

    flood = [asyncio.create_task(admit("flood", f"f{i}")) for i in range(5)]
    await asyncio.sleep(0.01)
    assert entered == ["f0", "f1"] and gate.waiting("flood") == 5
    light = asyncio.create_task(admit("light", "l0"))
    await asyncio.sleep(0.01)
    assert entered[-1] == "l0"  # past the flood's three waiting
    release.set()
    await asyncio.gather(*flood, light)
    assert sorted(entered) == ["f0", "f1", "f2", "f3", "f4", "l0"]
    assert gate.waiting("flood") == 0 and gate.waiting("light") == 0 and not gate._gates


async def test_a_failed_or_cancelled_admission_gives_its_place_back() -> None:
    gate = TenantGate(per_tenant=1)

    async def fail() -> None:
        async with gate.admitting("t"):
            raise ValueError("refused")

    for _ in range(3):
        try:
            await fail()
        except ValueError:
            pass
    holder = asyncio.Event()

    async def hold() -> None:
        async with gate.admitting("t"):
            await holder.wait()

    first = asyncio.create_task(hold())
    second = asyncio.create_task(hold())
    await asyncio.sleep(0.01)
    second.cancel()  # while waiting for the place
    await asyncio.sleep(0.01)
    holder.set()
    await first
    assert second.cancelled() and not gate._gates
    async with asyncio.timeout(1):
        async with gate.admitting("t"):
            pass


async def test_no_places_set_lets_every_admission_through() -> None:
    gate = TenantGate(per_tenant=0)
    async with gate.admitting("t"), gate.admitting("t"):
        assert gate.waiting("t") == 0
