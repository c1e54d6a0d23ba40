"""Failed authentications per peer: a burst, then a steady rate, per address."""

from services.core.ratelimit import FailedAttempts, peer_host


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_past_its_burst_waits_for_its_bucket_to_refill() -> None:
    clock = Clock()
    failures = FailedAttempts(burst=3, per_second=2.0, clock=clock)
    for _ in range(3):
        assert failures.retry_after("ipv4:10.0.0.1:5000") == 0
        failures.failed("ipv4:10.0.0.1:5000")
    # Another port of the same address shares the bucket; another address does not.
    assert failures.retry_after("ipv4:10.0.0.1:6000") == 0.5
    assert failures.retry_after("ipv4:10.0.0.2:5000") == 0
    clock.now += 0.5
    assert failures.retry_after("ipv4:10.0.0.1:5000") == 0


def test_peers_are_named_by_address_without_the_port() -> None:
    # gRPC's peers and the HTTP door's client addresses name one host alike.
    assert peer_host("ipv4:127.0.0.1:52114") == "127.0.0.1"
    assert peer_host("ipv6:[::1]:52114") == "::1"
    assert peer_host("unix:/tmp/socket") == "unix:/tmp/socket"
    assert peer_host("10.0.0.7") == "10.0.0.7"
    assert peer_host("::1") == "::1"
    assert peer_host("ipv6:[2001:db8::1]:443") == "2001:db8::1"
    assert peer_host("ipv6:%5B::1%5D:49880") == "::1"  # as grpcio names an IPv6 peer


def test_the_buckets_kept_are_bounded() -> None:
    clock = Clock()
    failures = FailedAttempts(burst=2, per_second=1.0, max_peers=4, clock=clock)
    for i in range(10):
        failures.failed(f"ipv4:10.0.0.{i}:1")
        failures.failed(f"ipv4:10.0.0.{i}:1")
        clock.now += 0.01
    assert failures.num_peers <= 4
    # The latest failing peer is still held back.
    assert failures.retry_after("ipv4:10.0.0.9:1") > 0
