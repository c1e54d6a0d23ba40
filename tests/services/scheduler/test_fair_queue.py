import itertools
from collections import Counter
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.fair_queue import FairQueue, QueueClass, Ticket

INTERACTIVE, BATCH = QueueClass.INTERACTIVE, QueueClass.BATCH


def ticket(
    run_id: str,
    tenant: str = "a",
    queue_class: QueueClass = INTERACTIVE,
    cost: int = 1,
    weight: int = 1,
    enqueued_at: float = 0.0,
) -> Ticket:
    return Ticket(run_id, tenant, queue_class, cost, weight, enqueued_at)


def always(_: Ticket) -> bool:
    return True


def costs_at_most(limit: int) -> Callable[[Ticket], bool]:
    return lambda t: t.cost <= limit


def drain(queue: FairQueue, limit: int | None = None) -> list[Ticket]:
    taken: list[Ticket] = []
    while len(queue) and (limit is None or len(taken) < limit):
        picked = queue.pick(always, now=0.0)
        assert picked is not None
        taken.append(picked)
    return taken


tickets = st.lists(
    st.builds(
        ticket,
        run_id=st.uuids().map(str),
        tenant=st.sampled_from(["a", "b", "c"]),
        queue_class=st.sampled_from([INTERACTIVE, BATCH]),
        cost=st.integers(1, 8),
        weight=st.integers(1, 4),
        enqueued_at=st.floats(0, 100),
    ),
    max_size=40,
    unique_by=lambda t: t.run_id,
)


@given(tickets)
def test_every_ticket_leaves_once_interactive_first_fifo_per_tenant(items: list[Ticket]) -> None:
    queue = FairQueue()
    for item in items:
        assert queue.push(item)
    taken = drain(queue)
    assert sorted(t.run_id for t in taken) == sorted(t.run_id for t in items)
    classes = [t.queue_class for t in taken]
    assert classes == sorted(classes, key=[INTERACTIVE, BATCH].index)
    for tenant in "abc":
        for queue_class in (INTERACTIVE, BATCH):
            times = [
                t.enqueued_at
                for t in taken
                if (t.tenant_id, t.queue_class) == (tenant, queue_class)
            ]
            assert times == sorted(times)


def test_a_run_is_queued_once_and_can_be_removed() -> None:
    queue = FairQueue()
    assert queue.push(ticket("r1"))
    assert not queue.push(ticket("r1"))
    assert len(queue) == 1 and "r1" in queue
    assert queue.remove("r1") is not None
    assert queue.remove("r1") is None
    assert len(queue) == 0 and queue.pick(always, now=0.0) is None


@settings(max_examples=50)
@given(st.integers(1, 5), st.integers(1, 5), st.integers(1, 60))
def test_backlogged_tenants_share_dispatches_by_weight(w_a: int, w_b: int, n: int) -> None:
    queue = FairQueue()
    for i in range(100):
        queue.push(ticket(f"a{i}", "a", cost=1, weight=w_a, enqueued_at=i))
        queue.push(ticket(f"b{i}", "b", cost=1, weight=w_b, enqueued_at=i))
    counts = Counter(t.tenant_id for t in drain(queue, n))
    # Weighted fair queuing: normalized service differs by at most one run.
    assert abs(counts["a"] / w_a - counts["b"] / w_b) <= 1 / w_a + 1 / w_b


def test_weight_two_gets_twice_the_dispatches() -> None:
    queue = FairQueue()
    for i in range(50):
        queue.push(ticket(f"heavy{i}", "heavy", cost=4, weight=2, enqueued_at=i))
        queue.push(ticket(f"light{i}", "light", cost=4, weight=1, enqueued_at=i))
    counts = Counter(t.tenant_id for t in drain(queue, 30))
    assert counts == {"heavy": 20, "light": 10}


@settings(max_examples=50)
@given(
    st.lists(st.integers(1, 10), min_size=20, max_size=20),
    st.lists(st.integers(1, 10), min_size=20, max_size=20),
)
def test_fair_share_is_counted_in_blocks(costs_a: list[int], costs_b: list[int]) -> None:
    queue = FairQueue()
    for i, (ca, cb) in enumerate(zip(costs_a, costs_b, strict=True)):
        queue.push(ticket(f"a{i}", "a", cost=ca, enqueued_at=i))
        queue.push(ticket(f"b{i}", "b", cost=cb, enqueued_at=i))
    served = Counter[str]()
    for t in drain(queue, 20):
        served[t.tenant_id] += t.cost
    # Unless one tenant ran dry, blocks served differ by at most one run's cost.
    assert abs(served["a"] - served["b"]) <= 10


def test_an_idle_tenant_banks_no_credit() -> None:
    queue = FairQueue()
    for i in range(10):
        queue.push(ticket(f"a{i}", "a", enqueued_at=i))
    drain(queue, 10)
    for i in range(10, 20):
        queue.push(ticket(f"a{i}", "a", enqueued_at=i))
        queue.push(ticket(f"b{i}", "b", enqueued_at=i))
    first = [t.tenant_id for t in drain(queue, 6)]
    assert Counter(first) == {"a": 3, "b": 3}


def test_interactive_goes_first_even_when_queued_later() -> None:
    queue = FairQueue()
    queue.push(ticket("batch", queue_class=BATCH, enqueued_at=0))
    queue.push(ticket("interactive", queue_class=INTERACTIVE, enqueued_at=5))
    assert [t.run_id for t in drain(queue)] == ["interactive", "batch"]


def test_runs_that_fit_skip_a_young_run_that_does_not() -> None:
    queue = FairQueue(max_skip_age=10)
    queue.push(ticket("big", cost=100, enqueued_at=0))
    queue.push(ticket("small", cost=1, enqueued_at=1))
    picked = queue.pick(lambda t: t.cost <= 10, now=5)
    assert picked is not None and picked.run_id == "small"


def test_an_aged_run_that_does_not_fit_holds_back_the_rest_until_it_fits() -> None:
    queue = FairQueue(max_skip_age=10)
    queue.push(ticket("big", cost=100, queue_class=INTERACTIVE, enqueued_at=0))
    queue.push(ticket("small", cost=1, enqueued_at=1))
    queue.push(ticket("batch", cost=1, queue_class=BATCH, enqueued_at=1))
    assert queue.pick(lambda t: t.cost <= 10, now=11) is None
    picked = queue.pick(lambda t: t.cost <= 100, now=12)
    assert picked is not None and picked.run_id == "big"
    assert [t.run_id for t in drain(queue)] == ["small", "batch"]


def test_a_run_that_can_never_fit_does_not_block() -> None:
    queue = FairQueue(max_skip_age=10)
    queue.push(ticket("huge", cost=10_000, enqueued_at=0))
    queue.push(ticket("small", cost=1, enqueued_at=1))
    picked = queue.pick(lambda t: t.cost <= 10, now=100, may_ever_fit=lambda t: t.cost <= 50)
    assert picked is not None and picked.run_id == "small"
    assert "huge" in queue


@settings(max_examples=30)
@given(st.lists(st.integers(1, 20), min_size=1, max_size=30), st.integers(5, 20))
def test_no_run_waits_forever_when_capacity_frees_up(costs: list[int], capacity: int) -> None:
    """Simulated worker of `capacity` blocks; each dispatched run finishes after 3 ticks."""
    queue = FairQueue(max_skip_age=5)
    for i, cost in enumerate(costs):
        queue.push(ticket(f"r{i}", f"t{i % 3}", cost=min(cost, capacity), enqueued_at=i))
    running: list[tuple[int, int]] = []  # (finishes_at, cost)
    for now in range(len(costs), len(costs) + 40 * len(costs)):
        running = [(end, cost) for end, cost in running if end > now]
        free = capacity - sum(cost for _, cost in running)
        while (picked := queue.pick(costs_at_most(free), now=now)) is not None:
            running.append((now + 3, picked.cost))
            free -= picked.cost
        if not len(queue):
            return
    raise AssertionError(f"{len(queue)} runs starved")


def picks_until(queue: FairQueue, run_id: str, now: float = 0.0) -> int:
    """How many picks it takes until `run_id` leaves the queue (it included)."""
    for num_picks in itertools.count(1):
        picked = queue.pick(always, now=now)
        assert picked is not None
        if picked.run_id == run_id:
            return num_picks
    raise AssertionError("unreachable")


@settings(max_examples=30)
@given(st.integers(0, 199), st.sampled_from([INTERACTIVE, BATCH]))
def test_a_flood_of_200_runs_delays_another_tenant_by_at_most_two_rounds(
    already_dispatched: int, flood_class: QueueClass
) -> None:
    queue = FairQueue()
    for i in range(200):
        queue.push(ticket(f"flood{i}", "flood", flood_class, cost=4, enqueued_at=i))
    drain(queue, already_dispatched)
    queue.push(ticket("light", "light", INTERACTIVE, cost=4, enqueued_at=500))
    # The flood's next run may share the light run's virtual finish; then it goes first.
    assert picks_until(queue, "light") <= 2


def test_a_flood_of_interactive_and_batch_runs_holds_back_only_its_own_tenant() -> None:
    queue = FairQueue()
    for i in range(100):
        queue.push(ticket(f"fi{i}", "flood", INTERACTIVE, cost=2, weight=4, enqueued_at=i))
        queue.push(ticket(f"fb{i}", "flood", BATCH, cost=2, weight=4, enqueued_at=i))
    drain(queue, 30)
    queue.push(ticket("light", "light", INTERACTIVE, cost=2, weight=1, enqueued_at=500))
    # A weight of 4 buys the flood 4 runs per light run, not the 70 it has queued.
    assert picks_until(queue, "light") <= 5


def test_an_aged_batch_run_goes_ahead_of_interactive_runs_once() -> None:
    queue = FairQueue(max_batch_wait=60)
    queue.push(ticket("old-batch", "b", BATCH, enqueued_at=0))
    queue.push(ticket("next-batch", "b", BATCH, enqueued_at=1))
    for i in range(5):
        queue.push(ticket(f"i{i}", "a", INTERACTIVE, enqueued_at=50 + i))
    young = queue.pick(always, now=59)
    assert young is not None and young.run_id == "i0"  # not waited long enough yet
    order = [queue.pick(always, now=100) for _ in range(5)]
    assert [t.run_id for t in order if t] == ["old-batch", "i1", "next-batch", "i2", "i3"]


def test_an_aged_batch_run_that_does_not_fit_does_not_hold_back_interactive_runs() -> None:
    queue = FairQueue(max_batch_wait=60)
    queue.push(ticket("big-batch", "b", BATCH, cost=50, enqueued_at=0))
    queue.push(ticket("small", "a", INTERACTIVE, cost=1, enqueued_at=90))
    picked = queue.pick(costs_at_most(10), now=100)
    assert picked is not None and picked.run_id == "small"
    assert "big-batch" in queue


def test_batch_runs_are_served_under_a_steady_stream_of_interactive_runs() -> None:
    """One interactive run arrives per tick and one dispatch happens per tick: without
    aging the batch run would never leave."""
    queue = FairQueue(max_batch_wait=10)
    queue.push(ticket("batch", "b", BATCH, enqueued_at=0))
    for now in range(100):
        queue.push(ticket(f"i{now}", "a", INTERACTIVE, enqueued_at=now))
        picked = queue.pick(always, now=now)
        if picked is not None and picked.run_id == "batch":
            assert now == 10
            return
    raise AssertionError("the batch run starved")
