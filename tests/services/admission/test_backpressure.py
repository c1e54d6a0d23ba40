"""Degradation under overload: class bounds and KV watermarks (pure: no database)."""

import pytest

from services.admission.backpressure import QueueBounds, class_refusal
from services.core.config import ConfigError
from services.core.errors import Unavailable
from services.core.fleet import FleetView, WorkerLoad
from services.core.shares import TenantLoad

BOUNDS = QueueBounds(batch_kv_watermark=0.1, interactive_kv_watermark=-0.5)


def load(num_free_blocks: int, interactive_blocks: int = 0, batch_blocks: int = 0) -> FleetView:
    return FleetView(
        num_free_blocks=num_free_blocks,
        num_total_blocks=100,
        num_queued_interactive_blocks=interactive_blocks,
        num_queued_batch_blocks=batch_blocks,
    )


def test_an_idle_fleet_admits_both_classes() -> None:
    assert class_refusal(BOUNDS, load(100), "batch") is None
    assert class_refusal(BOUNDS, load(100), "interactive") is None


def test_under_the_first_watermark_batch_is_refused_and_interactive_admitted() -> None:
    refused = class_refusal(BOUNDS, load(5), "batch")
    assert isinstance(refused, Unavailable) and refused.retry_after > 0
    assert "batch watermark 0.10" in str(refused)
    assert "interactive runs are still admitted" in str(refused)
    assert class_refusal(BOUNDS, load(5), "interactive") is None


def test_interactive_runs_are_refused_only_past_the_second_watermark() -> None:
    assert class_refusal(BOUNDS, load(0, interactive_blocks=40), "interactive") is None
    refused = class_refusal(BOUNDS, load(0, interactive_blocks=60), "interactive")
    assert isinstance(refused, Unavailable)
    assert "interactive watermark -0.50" in str(refused)


def test_a_batch_backlog_counts_against_batch_runs_only() -> None:
    # Interactive runs go ahead of every batch run: the batch backlog is not in their way.
    backlog = load(50, batch_blocks=500)
    assert class_refusal(BOUNDS, backlog, "batch") is not None
    assert class_refusal(BOUNDS, backlog, "interactive") is None


def test_a_fleet_of_unknown_size_refuses_nothing_for_kv() -> None:
    assert class_refusal(BOUNDS, FleetView(num_queued_batch_blocks=10**6), "batch") is None


def test_each_class_has_its_own_queue_bound() -> None:
    bounds = QueueBounds(max_queue_depth=100, max_batch_depth=10)
    full = FleetView(num_interactive=50, num_batch=11)
    refused = class_refusal(bounds, full, "batch")
    assert isinstance(refused, Unavailable) and "batch queue is full" in str(refused)
    assert class_refusal(bounds, full, "interactive") is None
    assert class_refusal(bounds, FleetView(num_interactive=101), "interactive") is not None


def test_the_interactive_watermark_may_not_be_above_the_batch_one() -> None:
    with pytest.raises(ConfigError, match="TOLLGATE_INTERACTIVE_KV_WATERMARK"):
        QueueBounds(batch_kv_watermark=-1.0, interactive_kv_watermark=0.0)


def flooded(suspends_runs: bool = True) -> FleetView:
    """A full fleet with a backlog past both watermarks, the flood holding all of it."""
    flood = (TenantLoad("flood", 1, 100, 20),)
    worker = WorkerLoad("w1", "m", 0, 100, 20, True, False, False, "builtin", flood, suspends_runs)
    return FleetView(
        num_total_blocks=100, num_queued_interactive_blocks=500, workers=(worker,)
    )  # fmt: skip


def test_another_tenants_backlog_does_not_keep_a_tenant_within_its_share_out() -> None:
    assert class_refusal(BOUNDS, flooded(), "interactive", "light") is None
    assert class_refusal(BOUNDS, flooded(), "interactive", "flood") is not None
    assert class_refusal(BOUNDS, flooded(), "batch", "light") is not None
    # Where no worker suspends runs, the backlog is in everyone's way.
    assert class_refusal(BOUNDS, flooded(suspends_runs=False), "interactive", "light") is not None
