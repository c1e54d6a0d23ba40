"""A stand-in service for the launcher test: what each `services/*/__main__.py` does
first, then it reports what it sees of the variable and waits."""

import os
import sys
import time

from services.core.parent import PARENT_ENV, follow_parent

follow_parent()
sys.stderr.write(f"{os.environ.get(PARENT_ENV)}\n")
sys.stderr.flush()
time.sleep(60)
