"""The workers' rows of GetQueueStats, tenants' shares included, as admission reads them."""

from __future__ import annotations

from services.admission.scheduler_client import worker_load
from services.core.fleet import WorkerLoad
from services.core.shares import TenantLoad
from services.scheduler.servicer import worker_load_proto


def test_a_workers_row_with_its_tenants_shares_crosses_to_admission_whole() -> None:
    tenants = (TenantLoad("a", 2, 40, 4, 1, 30), TenantLoad("b", 1, 8, 1, 0, 8))
    load = WorkerLoad("w1", "m", 16, 64, 5, True, False, False, "builtin", tenants, True)
    assert worker_load(worker_load_proto(load)) == load
