"""`python -m services.scheduler`: configured by TOLLGATE_* environment variables."""

from __future__ import annotations

import sys

from services.core.config import ConfigError
from services.core.loop import run
from services.core.parent import follow_parent
from services.scheduler.app import serve
from services.scheduler.config import SchedulerSettings


def main() -> int:
    follow_parent()
    try:
        settings = SchedulerSettings.from_env()
    except ConfigError as error:
        print(f"scheduler: {error}", file=sys.stderr)
        return 2
    run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
