"""What an asyncio front of the engine is: one output stream per request, the step
callback, and failing the streams when the engine goes away. `ProcessEngine` is the front
the worker uses."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from collections.abc import Sequence as Seq

from engine.errors import EngineError, RequestError
from engine.outputs import RequestOutput
from engine.sampling import Priority, RequestLimits, SamplingParams


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


class EngineFront(ABC):
    """An engine seen from the event loop: requests go in, each comes back as a stream.

    Implementations queue requests and aborts wherever their step loop runs, and call
    `_deliver` on the event loop with each step's outputs.
    """

    limits: RequestLimits
    # The most answers one request may draw (SamplingParams.n).
    max_answers = 1
    # Whether it returns a prompt's logprobs (SamplingParams.prompt_logprobs).
    scores_prompts = False
    # Whether a request can be held back and freed of its blocks (`suspend`).
    suspends = False

    def __init__(self, on_step: Callable[[list[RequestOutput]], None] | None = None) -> None:
        # Sees every step's outputs together, on the event loop, before the streams do.
        self._on_step = on_step
        self._streams: dict[str, RequestStream] = {}
        self._closed = False
        # Set when the engine went away without being asked to (its process died, its
        # server stopped answering): the worker settles the runs and starts another.
        self.lost = asyncio.Event()
        # The most requests it takes at once, beside its KV blocks; None: blocks alone.
        self.max_running: int | None = None
        # The most tokens one request may hold, when less than its pool; None: the pool's.
        self.max_run_tokens: int | None = None

    @property
    def saturated(self) -> bool:
        """Whether the engine holds back requests it was sent already (a shared server
        that other clients fill): nothing more should be sent to it meanwhile."""
        return False

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """The KV blocks no request holds."""

    @abstractmethod
    def add_request(
        self,
        request_id: str,
        prompt: Seq[int],
        params: SamplingParams | None = None,
        *,
        cache_namespace: str = "",
        priority: Priority | str = Priority.INTERACTIVE,
        adapter: str = "",
    ) -> RequestStream:
        """Queue a request and return its output stream; raises RequestError at once if
        invalid, EngineClosedError once the engine is shut down. `adapter` names one of
        the engine's LoRA adapters; "" is the base model."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort in any state; the stream then ends with a finish_reason "abort" output."""

    def suspend(self, request_id: str) -> None:
        """Frees a request's blocks and computes nothing of it until `resume`; its stream
        stays open and goes on, without a gap or a repeat, once it is resumed. Only where
        `suspends`; a request that draws several answers is not suspended."""
        raise NotImplementedError(f"{type(self).__name__} does not suspend requests")

    def resume(self, request_id: str) -> None:
        """Lets a suspended request go on (its prompt and output are computed again)."""
        raise NotImplementedError(f"{type(self).__name__} does not suspend requests")

    @abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine; open streams end with EngineClosedError."""

    def _checked(
        self, prompt: Seq[int], params: SamplingParams | None
    ) -> tuple[list[int], SamplingParams]:
        """A new request's token ids and parameters, checked against `limits`: raises
        EngineClosedError once the engine is shut down, RequestError if invalid."""
        if self._closed:
            raise EngineClosedError("the engine is shut down")
        if isinstance(prompt, str):
            raise TypeError(f"{type(self).__name__} takes token ids; tokenize the prompt first")
        params = params or SamplingParams()
        if params.n > self.max_answers:
            raise RequestError(f"this engine draws one answer per request, not n={params.n}")
        if params.prompt_logprobs is not None and not self.scores_prompts:
            raise RequestError("prompt_logprobs: this engine returns no prompt logprobs")
        token_ids = [int(token) for token in prompt]
        self.limits.check(token_ids, params)
        return token_ids, params

    def has_request(self, request_id: str) -> bool:
        """Whether the request's stream is still open (not yet finished or aborted)."""
        return request_id in self._streams

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
