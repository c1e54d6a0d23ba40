import asyncio
import os

from services.core.infra_process import follow_parent

follow_parent()

# Between two parallel regions the engine's OpenMP threads spin about a millisecond
# (libgomp counts some 100000 rounds per ms), then sleep. Sleeping at once costs a
# wake-up per region, dozens per decode step: a quarter of one stream's throughput
# (bench.stack, README). An idle engine still sleeps and leaves its cores to the
# database, the broker and the other services. Set before torch loads its OpenMP
# runtime; OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")

from services.worker.app import main  # noqa: E402

asyncio.run(main())
