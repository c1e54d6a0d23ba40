"""`python -m tests.chaos [--long] [--seed N]`: the chaos phases on infrastructure of their
own; prints one JSON object as its last line and exits 1 on any violation or stuck run."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

# As tests/conftest.py: the servers are started from a process whose gRPC has threads.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from tests.chaos.cluster import SIM_ENGINE, Infra  # noqa: E402
from tests.chaos.driver import EVERY_SERVICE_TWICE, Outcome, Phase, run_phase, summary  # noqa: E402
from tests.chaos.faults import ALL_KINDS  # noqa: E402
from tests.chaos.partition import PartitionUnavailable, run_partition  # noqa: E402

# The simulated engine runs inside the worker: there is no engine process to kill.
SIM_KINDS = tuple(kind for kind in ALL_KINDS if kind != "engine")
BOUNDED = (
    Phase("single", duration_s=40.0),
    Phase("replicas", duration_s=30.0, replicas=EVERY_SERVICE_TWICE),
    Phase("sim", duration_s=36.0, kinds=SIM_KINDS, engine_env=SIM_ENGINE),
)
LONG = (
    Phase("single", duration_s=240.0),
    Phase("replicas", duration_s=180.0, replicas=EVERY_SERVICE_TWICE),
    Phase("sim", duration_s=180.0, kinds=SIM_KINDS, engine_env=SIM_ENGINE),
)
PARTITION_S = {False: 20.0, True: 60.0}


def chaos(model_dir: Path, long: bool = False, seed: int = 0) -> dict[str, Any]:
    """Every phase; the summary of them all."""
    outcomes: list[Outcome] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="tollgate-chaos-") as scratch:
        kept = os.environ.get("TOLLGATE_E2E_LOGS")
        log_dir = Path(kept) if kept else Path(scratch)
        infra = Infra(Path(scratch) / "infra")
        with infra as endpoints:
            for i, phase in enumerate(LONG if long else BOUNDED):
                outcomes.append(run_phase(infra, endpoints, model_dir, log_dir, phase, seed + i))
            try:
                outcomes.append(
                    run_partition(endpoints, model_dir, log_dir, PARTITION_S[long], seed)
                )
            except PartitionUnavailable as reason:
                skipped["partition"] = str(reason)
    return summary(outcomes, skipped)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--long", action="store_true", help="minutes per phase, not seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from engine.model_dirs.tiny import init_tiny_model

    with tempfile.TemporaryDirectory(prefix="tollgate-chaos-model-") as model_dir:
        result = chaos(init_tiny_model(Path(model_dir)), args.long, args.seed)
    print(json.dumps(result))
    return 1 if result["invariant_violations"] or result["stuck_runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
