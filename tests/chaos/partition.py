"""The partition phase, in the spirit of Jepsen: a worker in a network namespace of its
own, joined to the host by two veth pairs, one to PostgreSQL and one to the schedulers.
Taking the schedulers' link down cuts the worker off from them and not from the database:
the scheduler takes its runs over, its late appends are fenced by the lease epoch, and no
token may reach a client twice. Then the link comes back up (healed).

The namespace reaches the host's loopback-only servers through relays listening on the
host's end of each link (HostLink).
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import structlog
from sqlalchemy.engine import make_url

from services.stack.flaky_link import FlakyLink
from services.stack.infra import Endpoints, free_port
from services.stack.launcher import ServiceProcess
from tests.chaos.cluster import SIM_ENGINE, Stack, supervised_stack, wait_until
from tests.chaos.driver import Outcome, finish
from tests.chaos.evidence import held_runs
from tests.chaos.faults import WorkerKill
from tests.chaos.in_netns import NETNS_ENV
from tests.chaos.load import Load

log = structlog.get_logger(__name__)

HOLD_TIMEOUT_S = 60.0
# On the simulated engine, whose steps take a fixed time whatever the machine's speed, a
# run this long streams for many times the scheduler's worker timeout, if it has stored
# no more than a few hundred tokens (each `streaming` event after the first holds 16).
LONG_RUN_TOKENS = 1200
FRESH_SEQ = 20
# What the worker logs when an append of its is refused (fenced off, or the run ended).
FENCED = "append refused"
CUT_FOR_S = 8.0


class PartitionUnavailable(Exception):
    """This machine cannot make network namespaces (not root, no `ip`, no permission)."""


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise PartitionUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


class HostLink(FlakyLink):
    """A FlakyLink listening on `host` (the host's end of a veth) instead of loopback."""

    def __init__(self, host: str, target: str) -> None:
        target_host, port = target.rsplit(":", 1)
        self.target = (target_host, int(port))
        self._listener = socket.create_server((host, 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.num_cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()


class Namespace:
    """A network namespace with a veth pair per link: `link(i)` is (host end, its address,
    the namespace end's address)."""

    def __init__(self, num_links: int) -> None:
        self.name = f"tgchaos-{secrets.token_hex(3)}"
        self.tag = secrets.token_hex(2)
        self.subnet = random.randrange(100, 250)
        self.num_links = num_links

    def host_end(self, i: int) -> str:
        return f"tgh{self.tag}{i}"

    def address(self, i: int, side: int) -> str:
        return f"10.{self.subnet}.{i}.{side}"

    def __enter__(self) -> Namespace:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise PartitionUnavailable("network namespaces need root and iproute2's `ip`")
        _ip("netns", "add", self.name)
        try:
            _ip("netns", "exec", self.name, "ip", "link", "set", "lo", "up")
            for i in range(self.num_links):
                self._add_link(i)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _add_link(self, i: int) -> None:
        host, inner = self.host_end(i), f"tgn{self.tag}{i}"
        _ip("link", "add", host, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", self.name)
        _ip("addr", "add", f"{self.address(i, 1)}/24", "dev", host)
        _ip("link", "set", host, "up")
        inside = ("netns", "exec", self.name, "ip")
        _ip(*inside, "addr", "add", f"{self.address(i, 2)}/24", "dev", inner)
        _ip(*inside, "link", "set", inner, "up")

    def set_link(self, i: int, up: bool) -> None:
        _ip("link", "set", self.host_end(i), "up" if up else "down")

    def __exit__(self, *_: object) -> None:
        for i in range(self.num_links):
            with contextlib.suppress(PartitionUnavailable):
                _ip("link", "del", self.host_end(i))
        with contextlib.suppress(PartitionUnavailable):
            _ip("netns", "del", self.name)


DB_LINK, SCHEDULER_LINK = 0, 1


@contextmanager
def namespaced_worker(stack: Stack, namespace: Namespace) -> Iterator[ServiceProcess]:
    services = stack.services
    database = make_url(services.config.database_url)
    db_link = HostLink(namespace.address(DB_LINK, 1), f"{database.host}:{database.port}")
    scheduler_links = [
        HostLink(namespace.address(SCHEDULER_LINK, 1), p.address)
        for p in stack.processes("scheduler")
    ]
    db_host, db_port = db_link.address.split(":")
    env = {
        **services.common_env(),
        **services.worker_env(),
        "TOLLGATE_DATABASE_URL": database.set(host=db_host, port=int(db_port)).render_as_string(
            hide_password=False
        ),
        "TOLLGATE_SCHEDULER_ADDRESS": ",".join(link.address for link in scheduler_links),
        "TOLLGATE_LISTEN": f"{namespace.address(SCHEDULER_LINK, 2)}:0",
        "TOLLGATE_METRICS_LISTEN": f"127.0.0.1:{free_port()}",
    }
    env[NETNS_ENV] = namespace.name
    log_path = services.log_dir / "worker-netns.log"
    worker = ServiceProcess("worker-netns", "tests.chaos.in_netns", env, log_path, "worker")
    worker.start()
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()
        for link in (db_link, *scheduler_links):
            link.close()


def run_partition(
    endpoints: Endpoints, model_dir: Path, log_dir: Path, duration_s: float, seed: int
) -> Outcome:
    """Load on a stack with one worker on the host and one in a namespace; the namespace's
    worker is cut off from the schedulers while it streams, then healed."""
    with Namespace(num_links=2) as namespace:
        with supervised_stack(endpoints, model_dir, log_dir, extra_env=SIM_ENGINE) as stack:
            with namespaced_worker(stack, namespace) as worker:
                load = Load(stack, seed=seed)
                load.start()
                cut = partition_while_streaming(stack, namespace, worker, load, duration_s)
                verdict = finish(stack, load, [cut] if cut else [], [worker.address])
    refusals = [line for line in worker.log_path.read_text().splitlines() if FENCED in line]
    extra = {
        "taken_over": len(verdict.settle_seconds),
        # Its appends after the takeover, refused: by the lease epoch, or by the seq the
        # takeover's own event moved on (checked first).
        "fenced_appends": {
            "stale_lease": sum("lease epoch" in line for line in refusals),
            "seq_conflict": sum("expected last seq" in line for line in refusals),
        },
    }
    kills = Counter({"partition": 1 if cut else 0})
    return Outcome("partition", load.records, kills, verdict, extra)


def partition_while_streaming(
    stack: Stack, namespace: Namespace, worker: ServiceProcess, load: Load, duration_s: float
) -> WorkerKill | None:
    """Cuts the worker off once it holds a long run, heals it after CUT_FOR_S, lets the load
    go on for the rest of `duration_s`. The cut, as a kill of the runs it held."""
    started = time.monotonic()

    def holds_a_long_run() -> bool:
        long_runs = {
            r.run_id
            for r in load.records
            if r.max_tokens >= LONG_RUN_TOKENS and r.runs_to_max_tokens
        }
        fresh = held_runs(stack.database_url, worker.pid, max_seq=FRESH_SEQ)
        return bool(long_runs.intersection(fresh))

    if not wait_until(holds_a_long_run, HOLD_TIMEOUT_S):
        log.error("chaos: the namespaced worker never held a long run; no partition")
        return None
    runs = held_runs(stack.database_url, worker.pid)
    log.warning("chaos: partitioning the namespaced worker from the schedulers", run_ids=runs)
    at = time.time()
    namespace.set_link(SCHEDULER_LINK, up=False)
    time.sleep(CUT_FOR_S)
    namespace.set_link(SCHEDULER_LINK, up=True)
    log.warning("chaos: partition healed")
    time.sleep(max(0.0, duration_s - (time.monotonic() - started)))
    return WorkerKill("partition", worker.pid, at, runs)
