"""Load for the chaos: tenants' clients starting runs of mixed lengths, cancelling some,
and dropping their streams at random to resume them from the last seq they saw.

Every event a client receives is kept, in the order received, across its resumes, so that
the checks can tell whether a token reached it twice or never.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from dataclasses import dataclass, field

from tests.chaos.cluster import Stack
from tollgate import Client
from tollgate.errors import TollgateError
from tollgate.stream import Stream
from tollgate.types import RetryPolicy, RunEvent

MODEL = "tiny"
# Patient enough to outlast any one process's restart, reconnecting quickly.
RETRY = RetryPolicy(max_attempts=400, initial_backoff=0.1, max_backoff=0.5)
OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]
PROMPT_WORDS = (1, 6, 24, 70)
# The longest stream for seconds, so that kills find runs streaming.
MAX_TOKENS = (1, 8, 40, 120, 1200)
CANCEL_PROBABILITY = 0.15
DISCONNECT_PROBABILITY = 0.35
MAX_RESUME_DELAY_S = 1.5
# A run its client cannot read to `billed` within this long is reported, not waited for.
RUN_DEADLINE_S = 150.0
WORDS = "toll gate river stone lamp road field cloud ember north quiet salt".split()


@dataclass
class RunRecord:
    tenant: str
    idempotency_key: str
    max_tokens: int
    ignore_eos: bool = False
    cancel_planned: bool = False
    run_id: str | None = None
    events: list[RunEvent] = field(default_factory=list)
    num_resumes: int = 0  # streams the client dropped on purpose and resumed
    num_reopens: int = 0  # streams that broke under it and were opened again
    cancel_requested: bool = False
    error: str = ""

    @property
    def last_seq(self) -> int:
        return self.events[-1].seq if self.events else 0

    @property
    def runs_to_max_tokens(self) -> bool:
        """Whether the run streams all its max_tokens: no end of sequence, no cancel."""
        return self.ignore_eos and not self.cancel_planned

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1].kind == "billed"


@dataclass
class Plan:
    """What the client does to one run: cancel after `cancel_after` events, drop its
    stream after each count in `disconnect_after`."""

    cancel_after: int | None
    disconnect_after: list[int]

    @classmethod
    def draw(cls, rng: random.Random) -> Plan:
        cancel = rng.randint(1, 12) if rng.random() < CANCEL_PROBABILITY else None
        drops: list[int] = []
        while rng.random() < DISCONNECT_PROBABILITY and len(drops) < 3:
            drops.append((drops[-1] if drops else 0) + rng.randint(1, 10))
        return cls(cancel, drops)


class Tenant:
    def __init__(self, stack: Stack, name: str, rng: random.Random) -> None:
        self.name = name
        self.rng = rng
        self.client = Client(
            stack.gateways,
            stack.tenant_key(name),
            ledger_address=stack.ledger,
            retry=RETRY,
            options=OPTIONS,
        )

    def new_record(self) -> tuple[RunRecord, dict[str, object]]:
        rng = self.rng
        max_tokens = rng.choice(MAX_TOKENS)
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.choice(PROMPT_WORDS)))
        sampling: dict[str, object] = {"temperature": 0.0}
        if rng.random() < 0.5:
            sampling = {"temperature": 0.8, "seed": rng.randint(0, 2**31)}
        ignore_eos = rng.random() < 0.7
        request = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": ignore_eos, **sampling}
        return RunRecord(self.name, str(uuid.uuid4()), max_tokens, ignore_eos), request

    def open(self, record: RunRecord, request: dict[str, object]) -> Stream:
        if record.run_id is None:
            return self.client.generate(
                model=MODEL,
                idempotency_key=record.idempotency_key,
                **request,  # type: ignore[arg-type]
            )
        position = record.events[-1].position if record.events else 0
        return self.client.stream_run(record.run_id, starting_after=position)

    def follow(self, record: RunRecord, request: dict[str, object], plan: Plan) -> None:
        """Reads the run to `billed`, doing what `plan` says on the way."""
        deadline = time.monotonic() + RUN_DEADLINE_S
        while not record.done:
            if time.monotonic() > deadline:
                record.error = (
                    f"not billed after {RUN_DEADLINE_S:.0f}s (last seq {record.last_seq})"
                )
                return
            stream = self.open(record, request)
            try:
                dropped = self._read(stream, record, plan)
            except TollgateError as error:
                record.num_reopens += 1
                record.error = f"{type(error).__name__}: {error}"
                time.sleep(0.3)
                continue
            finally:
                stream.close()
            if dropped:
                record.num_resumes += 1
                time.sleep(self.rng.uniform(0, MAX_RESUME_DELAY_S))
        record.error = ""

    def _read(self, stream: Stream, record: RunRecord, plan: Plan) -> bool:
        """True when the client dropped the stream on purpose."""
        for event in stream:
            record.events.append(event)
            record.run_id = event.run_id
            if plan.cancel_after is not None and len(record.events) >= plan.cancel_after:
                plan.cancel_after = None
                record.cancel_requested = True
                try:
                    self.client.cancel_run(event.run_id)
                except TollgateError:
                    pass  # the run goes on; it still has to end and be billed
            if plan.disconnect_after and len(record.events) >= plan.disconnect_after[0]:
                plan.disconnect_after.pop(0)
                if event.kind != "billed":
                    return True
        return False


class Load:
    """`num_tenants` tenants, each with `streams_per_tenant` runs in flight at a time."""

    def __init__(
        self, stack: Stack, seed: int, num_tenants: int = 5, streams_per_tenant: int = 2
    ) -> None:
        rng = random.Random(seed)
        self.tenants = [
            Tenant(stack, f"chaos-tenant-{i}", random.Random(rng.random()))
            for i in range(num_tenants)
        ]
        self.streams_per_tenant = streams_per_tenant
        self.records: list[RunRecord] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for tenant in self.tenants:
            for i in range(self.streams_per_tenant):
                thread = threading.Thread(
                    target=self._loop, args=(tenant,), name=f"{tenant.name}-{i}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def stop(self, timeout: float = RUN_DEADLINE_S + 30) -> None:
        """Starts no more runs; waits for those in flight to be read to their end."""
        self._stopping.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _loop(self, tenant: Tenant) -> None:
        while not self._stopping.is_set():
            with self._lock:
                record, request = tenant.new_record()
                plan = Plan.draw(tenant.rng)
                record.cancel_planned = plan.cancel_after is not None
                self.records.append(record)
            tenant.follow(record, request, plan)
