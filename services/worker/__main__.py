import asyncio
import os

from services.core.infra_process import follow_parent

follow_parent()

# The worker shares its cores with the database, the broker and the other services:
# OpenMP threads that spin while waiting for work would take CPU those need. Set before
# torch loads its OpenMP runtime; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from services.worker.app import main  # noqa: E402

asyncio.run(main())
