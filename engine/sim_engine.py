"""A simulated engine: deterministic tokens at a set pace, for measuring the services at
rates a GPU would give them (thousands of tokens per second, hundreds of streams) on a
machine without one.

Each step takes `step_seconds` and gives one token to every running request, up to
`max_running` of them; the others wait in arrival order. A request's first token comes
no sooner than its prompt's length at `prefill_tokens_per_s`. Outputs are a function of
the prompt and the seed alone, so a run gives the same tokens wherever it runs. A
request ends at `max_tokens` (finish reason "length") or at one of its stop token ids;
the simulated model has no end-of-sequence token and honours no stop strings.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from engine.front import EngineClosedError, EngineFront, RequestStream
from engine.outputs import Progress, RequestOutput
from engine.sampling import Priority, RequestLimits, SamplingParams


@dataclass(frozen=True, slots=True)
class SimConfig:
    vocab_size: int
    max_model_len: int
    step_seconds: float = 0.02
    max_running: int = 256
    prefill_tokens_per_s: float = 20_000.0
    block_size: int = 16
    # The KV pool it simulates, which bounds the runs a worker sends it.
    num_blocks: int = 512


@dataclass(slots=True)
class SimRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    progress: Progress
    # The step loop's clock when its prefill is done and its first token may come.
    ready_at: float = 0.0
    num_generated: int = 0


class SimEngine(EngineFront):
    def __init__(
        self,
        config: SimConfig,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
        vocabulary: Seq[tuple[int, str]] = (),
    ) -> None:
        """`vocabulary` is the (token id, text) pairs outputs are drawn from; by default
        ids below the model's vocabulary, each its own short word."""
        super().__init__(on_step)
        self.config = config
        self.limits = RequestLimits(
            vocab_size=config.vocab_size,
            max_model_len=config.max_model_len,
            num_total_blocks=config.num_blocks,
            block_size=config.block_size,
        )
        self.max_running = config.max_running
        size = min(config.vocab_size, 1000)
        self._vocabulary = list(vocabulary) or [(i, f" w{i}") for i in range(size)]
        self._waiting: deque[SimRequest] = deque()
        self._running: dict[str, SimRequest] = {}
        self._wake = asyncio.Event()
        self._loop_task = asyncio.create_task(self._step_loop(), name="sim-engine")

    @property
    def num_free_blocks(self) -> int:
        held = sum(r.progress.blocks() for r in self._running.values())
        held += sum(r.progress.blocks() for r in self._waiting)
        return max(0, self.limits.num_total_blocks - held)

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
        token_ids, params = self._checked(prompt, params)
        stream = self._open_stream(request_id)
        now = time.monotonic()
        progress = Progress(len(token_ids), self.config.block_size, now, held_since=now)
        self._waiting.append(SimRequest(request_id, token_ids, params, progress))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        request = self._running.pop(request_id, None)
        if request is None:
            request = next((r for r in self._waiting if r.request_id == request_id), None)
            if request is None:
                return
            self._waiting.remove(request)
        now = time.monotonic()
        self._deliver([request.progress.output(now, request_id, finish_reason="abort")])

    async def shutdown(self) -> None:
        self._closed = True
        self._loop_task.cancel()
        await asyncio.gather(self._loop_task, return_exceptions=True)
        self._fail_all(EngineClosedError("the engine was shut down"))

    def token(self, request: SimRequest, index: int) -> tuple[int, str]:
        """The request's `index`-th output token: a function of its prompt and seed."""
        seed = request.params.seed or 0
        key = sum(request.prompt) * 1_000_003 + len(request.prompt) * 7919 + seed + index * 31
        return self._vocabulary[key % len(self._vocabulary)]

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_step = loop.time()
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                next_step = loop.time()
            next_step += self.config.step_seconds
            await asyncio.sleep(max(0.0, next_step - loop.time()))
            self._admit(loop.time())
            outputs = self._step(loop.time())
            if outputs:
                self._deliver(outputs)

    def _admit(self, now: float) -> None:
        while self._waiting and len(self._running) < self.config.max_running:
            request = self._waiting.popleft()
            request.ready_at = now + len(request.prompt) / self.config.prefill_tokens_per_s
            self._running[request.request_id] = request

    def _step(self, now: float) -> list[RequestOutput]:
        clock = time.monotonic()
        outputs = []
        for request in list(self._running.values()):
            if request.ready_at > now:
                continue
            token, text = self.token(request, request.num_generated)
            request.num_generated += 1
            reason = None
            if token in request.params.stop_token_ids:
                reason = "stop"
            elif request.num_generated >= request.params.max_tokens:
                reason = "length"
            if reason is not None:
                del self._running[request.request_id]
            outputs.append(
                request.progress.output(clock, request.request_id, (token,), text, reason)
            )
        return outputs
