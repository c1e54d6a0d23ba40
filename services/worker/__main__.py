"""`python -m services.worker`, configured by `TOLLGATE_*` variables (docs/CONFIGURATION.md)."""

import os

from services.core.parent import follow_parent

follow_parent()

from services.worker.threads import set_openmp_wait  # noqa: E402

set_openmp_wait(os.environ)  # before torch loads its OpenMP runtime

from services.core.server import run_service  # noqa: E402
from services.worker.app import WorkerSettings, main  # noqa: E402

run_service("worker", WorkerSettings.from_env, main)
