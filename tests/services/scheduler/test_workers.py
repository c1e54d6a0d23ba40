from services.core.shares import Holding
from services.scheduler.workers import WorkerRegistry, WorkerReport


def report(free: int, total: int | None = None, model: str | None = "tiny") -> WorkerReport:
    return WorkerReport(num_free_blocks=free, num_total_blocks=total, model=model)


def test_a_static_worker_is_dispatchable_once_it_answers() -> None:
    registry = WorkerRegistry()
    registry.add_static("w1", "127.0.0.1:1")
    assert registry.choose(1, "tiny") is None
    registry.observe("w1", report(10), now=0)
    chosen = registry.choose(4, "tiny")
    assert chosen is not None and chosen.worker_id == "w1"


def test_choose_prefers_the_most_free_blocks_and_respects_model_and_room() -> None:
    registry = WorkerRegistry()
    for worker_id, free in (("w1", 4), ("w2", 9)):
        registry.register(worker_id, f"h:{free}", "tiny", now=0)
        registry.heartbeat(worker_id, report(free, model=None), now=0)
    registry.register("other", "h:0", "big", now=0)
    registry.heartbeat("other", report(100, model=None), now=0)
    assert registry.choose(5, "tiny").worker_id == "w2"  # type: ignore[union-attr]
    assert registry.choose(10, "tiny") is None
    registry.reserve("w2", Holding("run_a", "t", 1, 6))
    assert registry.choose(4, "tiny").worker_id == "w1"  # type: ignore[union-attr]


def held_report(free: int, runs: frozenset[str] = frozenset()) -> WorkerReport:
    return WorkerReport(num_free_blocks=free, running_run_ids=runs, num_total_blocks=16)


def test_a_report_that_crossed_an_assignment_does_not_hand_its_blocks_out_again() -> None:
    registry = WorkerRegistry()
    registry.register("w1", "h:1", "tiny", now=0)
    registry.heartbeat("w1", held_report(10), now=0)
    registry.reserve("w1", Holding("run_a", "t", 1, 6))
    # Written before the worker took run_a: 10 free, run_a not among its runs.
    registry.heartbeat("w1", held_report(10), now=0.1)
    assert registry.get("w1").num_free_blocks == 4  # type: ignore[union-attr]
    assert registry.choose(5, "tiny") is None
    # The worker counts run_a now: its own figure is the truth again.
    registry.heartbeat("w1", held_report(4, frozenset({"run_a"})), now=0.2)
    registry.heartbeat("w1", held_report(4, frozenset({"run_a"})), now=0.3)
    assert registry.get("w1").num_free_blocks == 4  # type: ignore[union-attr]


def test_held_blocks_come_back_when_the_run_ends_the_assignment_fails_or_time_passes() -> None:
    registry = WorkerRegistry(live_timeout=5)
    registry.register("w1", "h:1", "tiny", now=0)
    registry.heartbeat("w1", held_report(10), now=0)
    for run_id in ("ended", "refused", "lost"):
        registry.reserve("w1", Holding(run_id, "t", 1, 2))
    registry.release("w1", "refused")  # the worker did not take it
    assert registry.get("w1").num_free_blocks == 6  # type: ignore[union-attr]
    registry.run_ended("ended")  # ended before any report listed it
    registry.heartbeat("w1", held_report(10), now=1)
    assert registry.get("w1").num_free_blocks == 8  # type: ignore[union-attr]
    # Neither listed nor seen to end (its end lost with the broker): not held forever.
    registry.heartbeat("w1", held_report(10), now=11)
    assert registry.get("w1").num_free_blocks == 10  # type: ignore[union-attr]


def test_suspect_and_full_workers_are_skipped_until_heard_from() -> None:
    registry = WorkerRegistry()
    registry.register("w1", "h:1", "tiny", now=0)
    registry.heartbeat("w1", report(10), now=0)
    registry.mark_suspect("w1")
    assert registry.choose(1, "tiny") is None
    registry.heartbeat("w1", report(10), now=1)
    registry.mark_full("w1", 8)
    assert registry.choose(8, "tiny") is None
    assert registry.choose(7, "tiny") is not None


def test_silent_workers_expire_registered_ones_are_forgotten() -> None:
    registry = WorkerRegistry()
    registry.add_static("static", "h:1")
    registry.observe("static", report(10), now=0)
    registry.register("dynamic", "h:2", "tiny", now=0)
    registry.heartbeat("dynamic", report(10), now=3)
    assert registry.expire(now=5.5, timeout=5) == ["static"]
    assert sorted(registry.expire(now=8.5, timeout=5)) == ["dynamic"]
    assert registry.get("static") is not None and not registry.is_alive("static")
    assert registry.get("dynamic") is None
    assert not registry.heartbeat("dynamic", report(10), now=9)
    assert registry.heartbeat("static", report(10), now=9)


def test_may_ever_fit_compares_with_the_largest_live_worker() -> None:
    registry = WorkerRegistry()
    assert not registry.may_ever_fit(1, "tiny")
    registry.register("w1", "h:1", "tiny", now=0)
    registry.observe("w1", report(2, total=64), now=0)
    assert registry.may_ever_fit(64, "tiny")
    assert not registry.may_ever_fit(65, "tiny")
    assert not registry.may_ever_fit(1, "other-model")


def test_a_run_for_an_adapter_goes_only_to_workers_serving_it() -> None:
    registry = WorkerRegistry()
    registry.register("plain", "h:1", "tiny", now=0)
    registry.heartbeat("plain", report(50, total=50, model=None), now=0)
    registry.register("lora", "h:2", "tiny", now=0, adapters=["tiny-sql"])
    registry.heartbeat("lora", report(10, total=10, model=None), now=0)
    assert registry.choose(1, "tiny-sql").worker_id == "lora"  # type: ignore[union-attr]
    assert registry.choose(1, "tiny").worker_id == "plain"  # type: ignore[union-attr]
    assert registry.choose(1, "tiny-chat") is None
    assert registry.serves_any("tiny-sql") and not registry.serves_any("tiny-chat")
    registry.get("plain").block_size = registry.get("lora").block_size = 4  # type: ignore[union-attr]
    assert registry.max_run_tokens() == {"tiny": 200, "tiny-sql": 40}


def test_a_status_report_updates_the_adapters_served() -> None:
    registry = WorkerRegistry()
    registry.add_static("w1", "h:1")
    registry.observe(
        "w1",
        WorkerReport(num_free_blocks=5, model="tiny", adapters=frozenset({"tiny-sql"})),
        now=0,
    )
    assert registry.choose(1, "tiny-sql") is not None
    registry.observe("w1", WorkerReport(num_free_blocks=5, model="tiny"), now=1)
    assert registry.choose(1, "tiny-sql") is not None  # not reported: unchanged
    registry.observe("w1", WorkerReport(num_free_blocks=5, adapters=frozenset()), now=2)
    assert registry.choose(1, "tiny-sql") is None


def test_what_serves_a_workers_tokens_is_what_it_said_last() -> None:
    registry = WorkerRegistry()
    registry.register("w1", "h:1", "tiny", now=0, engine_kind="vllm")
    assert registry.get("w1").engine_kind == "vllm"  # type: ignore[union-attr]
    registry.observe("w1", WorkerReport(num_free_blocks=4, engine_kind="sim"), now=1)
    assert registry.get("w1").engine_kind == "sim"  # type: ignore[union-attr]
    registry.observe("w1", WorkerReport(num_free_blocks=4), now=2)  # an older worker: unsaid
    assert registry.get("w1").engine_kind == "sim"  # type: ignore[union-attr]


def test_a_run_may_hold_no_more_than_the_engine_takes_per_run() -> None:
    registry = WorkerRegistry()
    registry.register("pool", "h:1", "tiny", now=0)
    registry.observe(
        "pool", WorkerReport(num_free_blocks=64, num_total_blocks=64, block_size=16), now=0
    )
    assert registry.max_run_tokens() == {"tiny": 1024}
    registry.register("server", "h:2", "tiny", now=0, engine_kind="llama-server")
    capped = WorkerReport(
        num_free_blocks=256, num_total_blocks=256, block_size=16, max_run_tokens=512
    )
    registry.observe("server", capped, now=0)
    assert registry.max_run_tokens() == {"tiny": 1024}  # the pool worker takes more
    registry.observe(
        "pool", WorkerReport(num_free_blocks=16, num_total_blocks=16, block_size=16), now=1
    )
    assert registry.max_run_tokens() == {"tiny": 512}
