"""asyncio front of the engine: the step loop runs on a background thread, off the event loop."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from engine.config import EngineConfig
from engine.errors import EngineError, RequestError
from engine.llm_engine import LLMEngine, PreparedRequest, Prompt, RequestLimits
from engine.outputs import RequestOutput
from engine.sampling import Priority, SamplingParams


class EngineClosedError(EngineError):
    """The engine was shut down, or its step loop failed, before the request finished."""


class RequestStream:
    """Async iterator over one request's outputs; it ends after the finished output."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)


class EngineFront:
    """What every asyncio front of the engine shares: one stream per request, the step
    callback, and failing streams when the engine goes away.

    Subclasses queue requests and aborts wherever their step loop runs, and call
    `_deliver` on the event loop with each step's outputs.
    """

    limits: RequestLimits

    def __init__(self, on_step: Callable[[list[RequestOutput]], None] | None = None) -> None:
        # Sees every step's outputs together, on the event loop, before the streams do.
        self._on_step = on_step
        self._streams: dict[str, RequestStream] = {}
        self._closed = False

    @property
    def num_free_blocks(self) -> int:
        raise NotImplementedError

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_namespace: str = "",
        priority: Priority | str = Priority.INTERACTIVE,
    ) -> RequestStream:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    async def generate(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_namespace: str = "",
        priority: Priority | str = Priority.INTERACTIVE,
    ) -> AsyncIterator[RequestOutput]:
        """Like `add_request`, but aborts the request if the caller stops iterating early."""
        stream = self.add_request(
            request_id, prompt, params, cache_namespace=cache_namespace, priority=priority
        )
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort(request_id)

    def _open_stream(self, request_id: str) -> RequestStream:
        if self._closed:
            raise EngineClosedError("the engine is shut down")
        if request_id in self._streams:
            raise RequestError(f"request id {request_id!r} is already in use")
        stream = self._streams[request_id] = RequestStream(request_id)
        return stream

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if self._on_step is not None:
            self._on_step(outputs)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream._put(output)
            if output.finished:
                del self._streams[output.request_id]

    def _fail_one(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream._put(error)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream._put(error)


class AsyncEngine(EngineFront):
    """Thread-backed wrapper of `LLMEngine` for asyncio code.

    `add_request` and `abort` must be called from the event loop's thread; the engine
    itself is only touched by the background thread. The step loop shares this process's
    interpreter lock with the event loop: where the event loop is busy, `ProcessEngine`
    keeps the steps apart from it.
    """

    def __init__(
        self, engine: LLMEngine, on_step: Callable[[list[RequestOutput]], None] | None = None
    ) -> None:
        super().__init__(on_step)
        self.engine = engine
        self.limits = engine.limits
        self._commands: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    async def from_model_dir(
        cls, model_dir: str | Path, config: EngineConfig | None = None
    ) -> AsyncEngine:
        """Load the model on a worker thread so the event loop keeps running meanwhile."""
        return cls(await asyncio.to_thread(LLMEngine.from_model_dir, model_dir, config))

    @property
    def num_free_blocks(self) -> int:
        return self.engine.num_free_blocks

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_namespace: str = "",
        priority: Priority | str = Priority.INTERACTIVE,
    ) -> RequestStream:
        """Queue a request and return its output stream; raises RequestError at once if invalid."""
        if self._closed:
            raise EngineClosedError("the engine is shut down")
        prepared = self.engine.prepare_request(
            request_id, prompt, params, cache_namespace=cache_namespace, priority=priority
        )
        stream = self._open_stream(request_id)
        self._start()
        self._submit(lambda: self._enqueue(prepared))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort in any state; the stream then ends with a finish_reason "abort" output."""
        if request_id in self._streams and not self._closed:
            self._submit(lambda: self.engine.abort(request_id))

    async def shutdown(self) -> None:
        """Stop the step loop; open streams end with EngineClosedError."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._fail_all(EngineClosedError("the engine was shut down"))

    def _enqueue(self, prepared: PreparedRequest) -> None:
        try:
            self.engine.enqueue(prepared)
        except EngineError as exc:
            self._call_in_loop(self._fail_one, prepared.seq.request_id, exc)

    def _start(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="tollgate-engine", daemon=True)
            self._thread.start()

    def _submit(self, command: Callable[[], object]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._closed:
                self._wake.clear()
                while not self._commands.empty():
                    self._commands.get_nowait()()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait()
                    continue
                outputs = self.engine.step()
                if outputs:
                    self._call_in_loop(self._deliver, outputs)
        except BaseException as exc:  # surface any failure to every waiting caller
            self._closed = True
            error = EngineClosedError(f"the engine step loop failed: {exc!r}")
            error.__cause__ = exc
            self._call_in_loop(self._fail_all, error)

    def _call_in_loop(self, callback: Callable[..., None], *args: object) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(callback, *args)
