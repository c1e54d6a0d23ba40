"""A tenant's streams against its limit, with the streams reserved for runs being admitted
(no I/O)."""

import pytest

from services.admission.stream_limits import StreamCounts
from services.core.errors import QuotaExceeded


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_a_reservation_counts_until_its_stream_claims_it_or_it_lapses() -> None:
    clock = Clock()
    streams = StreamCounts(reservation_ttl=5.0, clock=clock)
    streams.reserve("t", 2, "run_a")
    streams.reserve("t", 2, "run_b")
    with pytest.raises(QuotaExceeded):
        streams.reserve("t", 2, "run_c")
    # A run's own stream takes its reservation even at the limit; another stream may not.
    with streams.held("t", 2, "run_a"):
        assert streams.num_open("t") == 1 and streams.num_held("t") == 2
        with pytest.raises(QuotaExceeded), streams.held("t", 2, "run_x"):
            pass
    assert streams.num_held("t") == 1  # run_b's reservation, never claimed yet
    clock.now += 5.0
    assert streams.num_held("t") == 0  # lapsed: its front never streamed
    with streams.held("t", 2, "run_b"):  # a late stream counts as a new one
        assert streams.num_open("t") == 1
    assert streams.release("t", "run_b") is False


def test_a_reservation_runs_from_its_runs_admission_and_no_limit_holds_none() -> None:
    clock = Clock()
    streams = StreamCounts(reservation_ttl=5.0, clock=clock)
    streams.reserve("t", 1, "run_slow")
    clock.now += 4.0  # admitting took long
    streams.renew("t", "run_slow")
    clock.now += 4.0
    assert streams.num_held("t") == 1
    for i in range(1000):
        streams.reserve("unlimited", 0, f"run_{i}")
    assert streams.num_held("unlimited") == 0
