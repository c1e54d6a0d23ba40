"""The bounded chaos, in the test suite: every kind of process killed under load, with one
of each service and then two; a partition where network namespaces can be made. Nothing
stuck, nothing broken, every token delivered once (see tests/chaos/__main__.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.__main__ import chaos
from tests.chaos.faults import ALL_KINDS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(540)]


@pytest.fixture(scope="module")
def result(tiny_model_dir: Path) -> dict[str, Any]:
    outcome = chaos(tiny_model_dir)
    print(json.dumps(outcome))
    return outcome


def phase(result: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [p for p in result["phases"] if p["phase"] == name]
    return found


@pytest.mark.parametrize("name", ["single", "replicas", "sim"])
def test_kills_of_every_process_leave_no_run_stuck_and_no_invariant_broken(
    result: dict[str, Any], name: str
) -> None:
    outcome = phase(result, name)
    assert outcome["violations"] == {} and outcome["invariant_violations"] == 0
    assert outcome["stuck_run_ids"] == [] and outcome["stuck_runs"] == 0
    assert outcome["runs"] > 0 and outcome["resumes"] > 0


def test_every_kind_of_process_was_killed(result: dict[str, Any]) -> None:
    assert set(phase(result, "single")["kills"]) == set(ALL_KINDS)
    assert set(phase(result, "sim")["kills"]) == set(ALL_KINDS) - {"engine"}


def test_a_partitioned_worker_is_taken_over_and_fenced(result: dict[str, Any]) -> None:
    if "partition" in result["skipped"]:
        pytest.skip(f"no partition phase: {result['skipped']['partition']}")
    outcome = phase(result, "partition")
    assert outcome["kills"] == {"partition": 1}
    assert outcome["taken_over"] > 0
    assert outcome["violations"] == {} and outcome["stuck_runs"] == 0
