import os

from services.core.loop import run
from services.core.parent import follow_parent
from services.worker.threads import set_openmp_wait

follow_parent()

set_openmp_wait(os.environ)  # before torch loads its OpenMP runtime

from services.worker.app import main  # noqa: E402

run(main())
