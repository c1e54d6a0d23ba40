"""The share rule: who makes room for a tenant under its share of a worker."""

from __future__ import annotations

from services.core.shares import (
    Holding,
    TenantLoad,
    make_room,
    room_by_share,
    tenant_loads,
    to_resume,
)


def flood(tenant: str, count: int, blocks: int = 10, weight: int = 1) -> list[Holding]:
    return [
        Holding(f"{tenant}{i}", tenant, weight, blocks, interactive=i % 2 == 0, since=float(i))
        for i in range(count)
    ]


def light(blocks: int = 2, weight: int = 1, interactive: bool = True) -> Holding:
    return Holding("new", "light", weight, blocks, interactive=interactive, since=99.0)


def test_a_run_that_fits_suspends_nothing() -> None:
    assert make_room(flood("a", 5), light(), num_free_blocks=50, num_total_blocks=100) == []


def test_the_youngest_batch_run_of_the_tenant_over_its_share_makes_room() -> None:
    # a0..a9: even ones interactive; the youngest batch run is a9.
    assert make_room(flood("a", 10), light(), 0, 100) == ["a9"]
    assert make_room(flood("a", 10), light(blocks=25), 0, 100) == ["a9", "a7", "a5"]


def test_interactive_runs_go_once_its_batch_runs_are_gone() -> None:
    assert make_room(flood("a", 10), light(blocks=50), 0, 100) == [
        "a9", "a7", "a5", "a3", "a1"
    ]  # fmt: skip
    # It gives only while over its share: 50 is all a tenant of two gives.
    assert make_room(flood("a", 10), light(blocks=51), 0, 100) is None


def test_a_tenant_alone_a_batch_run_or_one_over_its_share_suspends_nothing() -> None:
    same = Holding("new", "a", 1, 2, since=99.0)
    assert make_room(flood("a", 10), same, 0, 100) is None
    assert make_room(flood("a", 10), light(interactive=False), 0, 100) is None
    mine = [Holding(f"l{i}", "light", 1, 10) for i in range(5)]
    assert make_room(flood("a", 5) + mine, light(), 0, 100) is None  # light holds its 50


def test_the_most_over_its_share_gives_first_by_weight() -> None:
    # Shares of 100 by weights 1, 2 and light's 1: a 25, b 50, light 25.
    running = flood("a", 4, weight=1) + flood("b", 6, weight=2)
    assert make_room(running, light(blocks=10), 0, 100) == ["a3"]  # a 40/25 before b 60/50
    # After a3 and a1 a holds 20 (under 25): b gives next.
    assert make_room(running, light(blocks=25), 0, 100) == ["a3", "a1", "b5"]


def test_runs_that_cannot_be_suspended_are_passed_over() -> None:
    running = [Holding("a0", "a", 1, 60, interactive=False, suspendable=False)] + flood("a", 4)
    assert make_room(running, light(blocks=10), 0, 100) == ["a3"]


def test_room_by_share_is_what_the_others_hold_over_their_shares() -> None:
    loads = [TenantLoad("a", 1, 90, 9, num_suspendable_blocks=90), TenantLoad("light", 1, 0, 0)]
    assert room_by_share(loads, "light", 1, 2, 100) == 40
    assert room_by_share(loads, "a", 1, 2, 100) == 0  # alone
    assert room_by_share(loads, "light", 1, 51, 100) == 0  # over its share with it
    weighty = [TenantLoad("a", 3, 90, 9, num_suspendable_blocks=90)]
    assert room_by_share(weighty, "light", 1, 2, 100) == 15
    # Runs that draw several answers are not suspended: only what the others hold counts.
    assert (
        room_by_share([TenantLoad("a", 1, 90, 9, num_suspendable_blocks=10)], "l", 1, 2, 100) == 10
    )


def test_tenant_loads_count_running_and_suspended_runs() -> None:
    loads = tenant_loads(flood("a", 3), [Holding("s", "a", 1, 10), Holding("t", "b", 2, 5)])
    assert loads == [TenantLoad("a", 1, 30, 3, 1, 30), TenantLoad("b", 2, 0, 0, 1, 0)]


def test_suspended_runs_go_on_longest_suspended_first_none_passed_over() -> None:
    suspended = [Holding("a", "f", 1, 10), Holding("b", "f", 1, 5), Holding("c", "g", 1, 3)]
    assert to_resume(suspended, 18) == ["a", "b", "c"]
    assert to_resume(suspended, 16) == ["a", "b"]
    assert to_resume(suspended, 12) == ["a"]
    assert to_resume(suspended, 8) == []  # b and c would fit, but a came first
