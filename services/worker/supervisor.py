"""Keeps an engine under the worker: when the engine is lost (its child process died, its
server stopped answering), the runs it held are settled, a new engine is started (for a
server: once it answers again), and the worker takes runs again once it is ready.

While there is no engine the worker reports no room and `draining`, and refuses
assignments, so the scheduler sends its runs elsewhere. The runs of the dead engine are
settled by this worker, which still holds their leases: one that streamed ends `failed`
ENGINE_ERROR with the usage delivered; one that streamed nothing goes back to the queue
(requeue_reason ENGINE_ERROR), where the scheduler takes it back, or ends `failed`
REQUEUE_LIMIT once it was re-queued too often (`services/core/requeue.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog
from sqlalchemy.exc import InterfaceError, OperationalError

from engine.front import EngineFront
from services.core.event_store import ConcurrencyConflict, EventStore
from services.core.runs import EventStoreError
from services.core.telemetry import bound_log_context
from services.worker.appender import StepAppender
from services.worker.core import WorkerCore
from services.worker.metrics import ENGINE_RESTARTS
from services.worker.runs import AssignedRun, engine_lost_events

log = structlog.get_logger(__name__)

StartEngine = Callable[[], Awaitable[EngineFront]]
OnReady = Callable[[bool], Awaitable[None]]

# Tries to settle a run that others append to meanwhile (a cancel): each re-reads it.
MAX_CONFLICTS = 5
RETRY_SECONDS = 0.5
MAX_START_BACKOFF_SECONDS = 30.0


async def _no_health(ready: bool) -> None:
    return None


class EngineSupervisor:
    def __init__(
        self,
        core: WorkerCore,
        appender: StepAppender,
        store: EventStore,
        engine: EngineFront,
        start_engine: StartEngine,
        *,
        on_ready: OnReady = _no_health,
    ) -> None:
        """`engine` is the running one, `start_engine` starts another; `on_ready` is told
        when the worker stops and starts taking runs (its health)."""
        self.core = core
        self.appender = appender
        self.store = store
        self.engine = engine
        self.start_engine = start_engine
        self.on_ready = on_ready

    async def run(self) -> None:
        """Replaces the engine each time it dies, until cancelled."""
        while True:
            await self.engine.lost.wait()
            await self.replace()

    async def replace(self) -> None:
        ENGINE_RESTARTS.inc()
        log.error("the engine is gone; starting a new one", num_runs=len(self.core.runs))
        self.core.engine_ready = False
        await self.on_ready(False)
        # What the engine delivered before it died is stored first, so that a run's
        # streamed tokens are in its usage and its settlement appends after them.
        await self.appender.flush()
        released = self.appender.release_all()
        await asyncio.gather(*(self.settle(run) for run in released), self._restart())
        self.core.engine_ready = True
        await self.on_ready(True)
        log.info("engine ready again")

    async def _restart(self) -> None:
        await self.engine.shutdown()  # reaps the dead child
        delay = 1.0
        while True:
            try:
                self.engine = await self.start_engine()
                break
            except Exception as error:
                log.error("the engine did not start; retrying", error=repr(error), delay_s=delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, MAX_START_BACKOFF_SECONDS)
        self.core.engine = self.engine

    async def settle(self, run: AssignedRun) -> None:
        """Appends what ends or re-queues `run`, under its lease; a run that ended or was
        leased elsewhere meanwhile is left as it is. While the database is away this
        waits for it, as the appender does: the worker has nothing else to do."""
        with bound_log_context(run_id=run.run_id, tenant_id=run.tenant_id):
            conflicts = 0
            while True:
                try:
                    await self._settle_once(run)
                    return
                except (OperationalError, InterfaceError) as error:
                    log.warning("settling a run of the dead engine, retrying", error=repr(error))
                except ConcurrencyConflict as error:
                    conflicts += 1
                    if conflicts == MAX_CONFLICTS:
                        log.error("run of the dead engine not settled", error=str(error))
                        return
                except EventStoreError as error:
                    log.info("run of the dead engine not settled here", error=str(error))
                    return
                await asyncio.sleep(RETRY_SECONDS)

    async def _settle_once(self, run: AssignedRun) -> None:
        events = await self.store.read(run.run_id)
        settling = engine_lost_events(events, self.core.worker_id, run.lease_epoch)
        if not settling:
            return
        await self.store.append(
            run.run_id,
            events[-1].seq,
            settling,
            lease_epoch=run.lease_epoch,
            traceparent=run.traceparent,
        )
        final = settling[-1]
        log.warning(
            "run of the dead engine settled",
            state=str(final.kind),
            code=final.payload.get("code") or final.payload.get("requeue_reason"),
        )
