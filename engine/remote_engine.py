"""The worker's engine when tokens come from an engine server (vLLM, SGLang, llama.cpp's
server, an OpenAI-compatible one) over HTTP: one streamed request a run.

Each run is one task that posts the run's body (`engine.dialects`) and turns each chunk
into a `RequestOutput`, with the logprobs of its tokens when the run asked, as the
built-in engine's steps do, so the worker above sees no difference. Aborting a run closes
its HTTP stream, which these servers take as the request's cancellation.

Two ways a run can fail here. The server is gone (refused connection, reset stream, a
5xx, no chunk within `chunk_timeout`): every run fails with it, `lost` is set, and the
worker settles them as when its engine process dies, then waits for the server to
answer again. The server answered the run wrongly (a 4xx, a chunk that is not its
kind's): that run alone ends with finish reason "error" and the message.

A run's KV block-seconds are reckoned from its tokens and `block_size`, as if the server
held the run's prompt and output in blocks of that size from its arrival to its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import structlog

from engine.dialects import DIALECTS, DONE, Delta, MalformedChunk, Request, sse_data, waiting
from engine.errors import EngineError, RequestError
from engine.front import EngineClosedError, EngineFront, RequestStream
from engine.outputs import Progress, RequestOutput
from engine.sampling import Priority, RequestLimits, SamplingParams

log = structlog.get_logger(__name__)

# How much of an engine server's error body a run's failure message keeps.
MAX_ERROR_TEXT = 300


class EngineUnavailable(EngineError):
    """The engine server does not answer, or answers that it is not ready."""


@dataclass(frozen=True, slots=True)
class RemoteConfig:
    kind: str
    url: str
    model: str
    vocab_size: int
    max_model_len: int
    api_key: str = ""
    max_running: int = 16
    block_size: int = 16
    # Seconds without a chunk before the server is deemed stuck.
    chunk_timeout: float = 30.0
    # How long `start` waits for the server to answer that it is ready.
    ready_timeout: float = 5.0
    share_cache: bool = False
    send_priority: bool = False
    # How often the server's queue is read (`saturated`).
    poll_interval: float = 1.0

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class ServerGone(EngineError):
    """The server stopped answering a run: every run on it is lost."""


class RemoteEngine(EngineFront):
    """Runs on an engine server; start it with `start`, which waits until it answers."""

    def __init__(
        self,
        config: RemoteConfig,
        session: aiohttp.ClientSession,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
        encode: Callable[[str], list[int]] | None = None,
    ) -> None:
        super().__init__(on_step)
        self.config = config
        self.dialect = DIALECTS[config.kind]
        self.limits = RequestLimits(
            vocab_size=config.vocab_size,
            max_model_len=config.max_model_len,
            num_total_blocks=config.max_running * -(-config.max_model_len // config.block_size),
            block_size=config.block_size,
        )
        self.max_running = config.max_running
        self.max_run_tokens = config.max_model_len
        self._session = session
        # Token ids for a server that sends text only (`openai`).
        self._encode = encode
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._aborted: set[str] = set()
        self._progress: dict[str, Progress] = {}
        self._waiting = 0.0
        self._poller: asyncio.Task[None] | None = None
        if self.dialect.waiting_metric and self.dialect.metrics_path:
            self._poller = asyncio.create_task(self._poll_queue())

    @classmethod
    async def start(
        cls,
        config: RemoteConfig,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
        encode: Callable[[str], list[int]] | None = None,
    ) -> RemoteEngine:
        """Returns once the server answers its health check; raises EngineUnavailable
        after `ready_timeout` without."""
        if config.kind == "openai" and encode is None:
            raise ValueError("an openai engine needs a tokenizer to count its tokens")
        timeout = aiohttp.ClientTimeout(total=None, connect=config.chunk_timeout)
        session = aiohttp.ClientSession(timeout=timeout, headers=config.headers)
        try:
            await wait_ready(session, config)
            context = await read_context(session, config)
        except BaseException:
            await session.close()
            raise
        if context is not None and context < config.max_model_len:
            config = replace(config, max_model_len=context)
        return cls(config, session, on_step, encode)

    @property
    def num_free_blocks(self) -> int:
        """The blocks its runs' tokens so far would fill, taken from the configured pool."""
        held = sum(progress.blocks() for progress in self._progress.values())
        return max(0, self.limits.num_total_blocks - held)

    @property
    def saturated(self) -> bool:
        return self._waiting > 0

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
        # As the built-in engine does: the output ends ("length") where the context does.
        room = self.limits.max_model_len - len(token_ids)
        if params.max_tokens > room:
            params = replace(params, max_tokens=room)
        if len(self._tasks) >= self.config.max_running:
            raise RequestError(f"the engine server runs {self.config.max_running} runs at most")
        request = Request(
            prompt=token_ids,
            params=params,
            model=self.config.model,
            adapter=adapter,
            cache_namespace=cache_namespace,
            priority=Priority.parse(priority),
            share_cache=self.config.share_cache,
            send_priority=self.config.send_priority,
        )
        stream = self._open_stream(request_id)
        task = asyncio.create_task(self._run(request_id, request), name=f"engine-run-{request_id}")
        self._tasks[request_id] = task
        task.add_done_callback(lambda done: self._forget(request_id, done))
        return stream

    def _forget(self, request_id: str, task: asyncio.Task[None]) -> None:
        # The id may be in use again already, by a later attempt of the same run.
        if self._tasks.get(request_id) is task:
            del self._tasks[request_id]

    def abort(self, request_id: str) -> None:
        """Closes the run's stream (the server cancels it); its output ends "abort"."""
        task = self._tasks.get(request_id)
        if task is not None and not task.done():
            self._aborted.add(request_id)
            task.cancel()

    async def shutdown(self) -> None:
        self._closed = True
        tasks = list(self._tasks.values())
        if self._poller is not None:
            tasks.append(self._poller)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._session.close()
        self._fail_all(EngineClosedError("the engine was shut down"))

    async def _run(self, request_id: str, request: Request) -> None:
        now = time.monotonic()
        progress = Progress(len(request.prompt), self.config.block_size, now, held_since=now)
        self._progress[request_id] = progress
        try:
            await self._stream(request_id, request, progress)
        except asyncio.CancelledError:
            if request_id not in self._aborted:
                raise
            self._finish(request_id, progress, "abort")
        except (MalformedChunk, RequestError) as error:
            log.warning("engine server answered a run wrongly", run_id=request_id, error=str(error))
            self._finish(request_id, progress, "error", str(error))
        except (aiohttp.ClientError, TimeoutError, ServerGone, OSError) as error:
            # The HTTP client may turn the cancel of an abort into a timeout of its own.
            if request_id in self._aborted:
                self._finish(request_id, progress, "abort")
            else:
                self._lose(request_id, error)
        finally:
            self._aborted.discard(request_id)
            self._progress.pop(request_id, None)

    async def _stream(self, request_id: str, request: Request, progress: Progress) -> None:
        url = self.config.url.rstrip("/") + self.dialect.path
        body = self.dialect.body(request)
        stops = frozenset(request.params.stop_token_ids)
        async with self._session.post(url, json=body) as response:
            if response.status >= 500:
                raise ServerGone(f"the engine server answered {response.status}")
            if response.status >= 400:
                text = (await response.text())[:MAX_ERROR_TEXT]
                raise RequestError(f"the engine server refused the run ({response.status}): {text}")
            reader = self.dialect.reader(request.params.logprobs)
            # The chunk that ends the run, held until the usage chunk after it (`[DONE]`).
            last: Delta | None = None
            while True:
                async with asyncio.timeout(self.config.chunk_timeout):
                    line = await response.content.readline()
                if not line:
                    if last is not None:
                        break  # the usage chunk and `[DONE]` are the server's to send
                    raise ServerGone("the engine server closed the stream before the run ended")
                data = sse_data(line.rstrip(b"\r\n"))
                if data is DONE:
                    break
                if data is None:
                    continue
                delta = reader.read(data)
                if self._encode is not None and delta.text and not delta.token_ids:
                    delta = _with_ids(delta, self._encode(delta.text))
                delta, stopped = _cut_at_stop(delta, stops)
                if stopped:
                    delta = replace(delta, finish_reason="stop")
                if last is not None:
                    last = _merged(last, delta)  # what follows the end: its usage
                elif delta.finish_reason is None:
                    self._apply(request_id, progress, delta)
                else:
                    last = delta
                if last is not None and (stopped or not self.dialect.done_marker):
                    break
            if last is None:
                raise ServerGone("the engine server ended the stream before the run ended")
            self._apply(request_id, progress, last)

    def _apply(self, request_id: str, progress: Progress, delta: Delta) -> None:
        if delta.num_cached_prompt_tokens is not None:
            progress.num_cached = min(delta.num_cached_prompt_tokens, progress.num_prompt_tokens)
        reason = delta.finish_reason
        if delta.token_ids or delta.text or reason is not None:
            now = time.monotonic()
            output = progress.output(now, request_id, delta.token_ids, delta.text, reason)
            self._deliver([replace(output, logprobs=delta.logprobs)])

    def _finish(self, request_id: str, progress: Progress, reason: str, error: str = "") -> None:
        output = progress.output(time.monotonic(), request_id, finish_reason=reason, error=error)
        self._deliver([output])

    def _lose(self, request_id: str, error: BaseException) -> None:
        """The server is gone: every run fails, and the worker is told (`lost`)."""
        if self._closed:
            return
        log.error(
            "the engine server stopped answering",
            run_id=request_id,
            error=repr(error),
            url=self.config.url,
        )
        self._closed = True
        self.lost.set()
        current = asyncio.current_task()
        for task in self._tasks.values():
            if task is not current:
                task.cancel()
        self._fail_all(EngineClosedError(f"the engine server stopped answering: {error!r}"))

    async def _poll_queue(self) -> None:
        """Keeps `saturated` current from the server's own count of waiting requests."""
        url = self.config.url.rstrip("/") + self.dialect.metrics_path
        while True:
            try:
                async with self._session.get(url) as response:
                    if response.status == 200:
                        count = waiting(await response.text(), self.dialect.waiting_metric)
                        self._waiting = count or 0.0
                    elif response.status in (404, 501):
                        return  # the server keeps no metrics (llama-server without --metrics)
            except (aiohttp.ClientError, TimeoutError, OSError):
                self._waiting = 0.0  # a run's own stream tells when the server is gone
            await asyncio.sleep(self.config.poll_interval)


def _with_ids(delta: Delta, token_ids: list[int]) -> Delta:
    return replace(delta, token_ids=tuple(token_ids))


def _merged(last: Delta, after: Delta) -> Delta:
    """The ending chunk with what chunks after it add (the usage chunk's counts)."""
    if after.token_ids or after.text:
        raise MalformedChunk("the engine server sent tokens after the run ended")
    return replace(
        last,
        num_prompt_tokens=_first(after.num_prompt_tokens, last.num_prompt_tokens),
        num_cached_prompt_tokens=_first(
            after.num_cached_prompt_tokens, last.num_cached_prompt_tokens
        ),
    )


def _first(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


def _cut_at_stop(delta: Delta, stops: frozenset[int]) -> tuple[Delta, bool]:
    """Ends the output at the first of the run's stop token ids, for servers that do not
    stop on them: that token is the run's last, and the text and logprobs after it are
    dropped."""
    if not stops:
        return delta, False
    for index, token in enumerate(delta.token_ids):
        if token in stops:
            end = index + 1
            text = delta.text if end == len(delta.token_ids) else ""
            kept = replace(
                delta, token_ids=delta.token_ids[:end], text=text, logprobs=delta.logprobs[:end]
            )
            return kept, True
    return delta, False


async def wait_ready(session: aiohttp.ClientSession, config: RemoteConfig) -> None:
    """Polls the server's health path until it answers 200; EngineUnavailable after
    `ready_timeout` seconds without."""
    dialect = DIALECTS[config.kind]
    url = config.url.rstrip("/") + dialect.health_path
    deadline = time.monotonic() + config.ready_timeout
    last = "no answer"
    while True:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2.0)) as response:
                if response.status == 200:
                    return
                last = f"HTTP {response.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            last = repr(error)
        if time.monotonic() >= deadline:
            raise EngineUnavailable(f"the engine server at {config.url} is not ready: {last}")
        await asyncio.sleep(0.2)


CONTEXT_PATHS = {"llama-server": "/props", "vllm": "/v1/models"}


async def read_context(session: aiohttp.ClientSession, config: RemoteConfig) -> int | None:
    """The context length the server reports for the model, None where it says none."""
    path = CONTEXT_PATHS.get(config.kind)
    if path is None:
        return None
    try:
        async with session.get(config.url.rstrip("/") + path) as response:
            if response.status != 200:
                return None
            answer = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return None
    return server_context(config.kind, answer, config.model)


def server_context(kind: str, answer: Any, model: str) -> int | None:
    """The context length a server reports for `model`, where its answer says it."""
    with contextlib.suppress(AttributeError, TypeError, KeyError, IndexError):
        if kind == "llama-server":
            return int(answer["default_generation_settings"]["n_ctx"])
        if kind == "vllm":
            for entry in answer["data"]:
                if entry.get("id") == model and entry.get("max_model_len"):
                    return int(entry["max_model_len"])
    return None
