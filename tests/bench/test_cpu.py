from __future__ import annotations

import subprocess
import sys

import psutil

from bench.cpu import BENCH, BROKER, ENGINE, OTHER, POSTGRES, CpuWindow, role

PYTHON = "/usr/bin/python3"
# Spins for 0.3 s of CPU, then waits on stdin: still alive when the window closes.
SPIN = (
    "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\ninput()"
)


def test_processes_are_named_by_their_role() -> None:
    assert role([PYTHON, "-m", "services.admission"], "python3", False) == "admission"
    assert role([PYTHON, "-m", "services.worker"], "python3", True) == BENCH
    assert role([PYTHON, "-m", "pytest"], "python3", False) == OTHER
    assert role([PYTHON, "-m"], "python3", False) == OTHER
    spawned = [PYTHON, "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"]
    assert role(spawned, "python3", False) == ENGINE
    tracker = [PYTHON, "-c", "from multiprocessing.resource_tracker import main;main(5)"]
    assert role(tracker, "python3", False) == OTHER
    assert role(["/opt/pg/bin/postgres", "-D", "/data"], "postgres", False) == POSTGRES
    assert role(["postgres: app db 127.0.0.1(5123) idle"], "postgres", False) == POSTGRES
    tansu = ["/root/.calfkit/bin/tansu-v0.6.0", "broker", "--listener-url", "tcp://x"]
    assert role(tansu, "tansu-v0.6.0", False) == BROKER
    llama = ["/root/.cache/tollgate/llama-server/llama-server", "-m", "m.gguf", "-np", "16"]
    assert role(llama, "llama-server", False) == ENGINE


def test_a_window_counts_the_cpu_of_a_child_started_inside_it() -> None:
    with CpuWindow() as window:
        child = subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE)
        times = psutil.Process(child.pid).cpu_times
        while times().user + times().system < 0.3:
            pass
    child.kill()
    child.wait()
    assert window.seconds[OTHER] >= 0.3
    assert window.seconds[BENCH] > 0  # this process, busy waiting
    assert window.total_seconds == sum(window.seconds.values())
    assert 0 < window.busy_fraction <= 1.05
