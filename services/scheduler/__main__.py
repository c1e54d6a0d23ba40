"""`python -m services.scheduler`, configured by `TOLLGATE_*` variables (docs/CONFIGURATION.md)."""

from services.core.parent import follow_parent

follow_parent()

from services.core.server import run_service  # noqa: E402
from services.scheduler.app import SchedulerSettings, main  # noqa: E402

run_service("scheduler", SchedulerSettings.from_env, main)
