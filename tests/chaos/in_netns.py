"""`python -m tests.chaos.in_netns`: becomes `python -m services.worker` inside the network
namespace TOLLGATE_CHAOS_NETNS, with the same pid and environment, so that a ServiceProcess
starts a worker there as it starts any service."""

from __future__ import annotations

import os
import sys

NETNS_ENV = "TOLLGATE_CHAOS_NETNS"

if __name__ == "__main__":
    namespace = os.environ[NETNS_ENV]
    os.execvp("ip", ["ip", "netns", "exec", namespace, sys.executable, "-m", "services.worker"])
