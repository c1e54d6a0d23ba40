"""asyncio front of the engine whose step loop runs in a child process.

A step loop on a thread shares the interpreter lock with the event loop: every
time the event loop runs Python (network I/O, serialization), the engine's next
operator waits for the lock, and its steps stretch. In a process of its own the
engine keeps its steps to itself.

The child loads the model and then answers a pipe: requests, aborts and a stop
come in; each step's outputs and the free block count go out. Requests are
checked here first (against the child's `RequestLimits`), so a bad one is
refused at once rather than after the child reads it. Commands are written by a thread of
their own: the child reads only between steps, and commands larger than the
pipe's buffer would otherwise hold up the event loop until it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import os
import queue
import signal
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from engine.errors import EngineError, ModelLoadError, RequestError
from engine.front import EngineClosedError, EngineFront, RequestStream
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling import MAX_N, Priority, RequestLimits, SamplingParams
from engine.threads import choice_for_engine, timed_step

# How long a stopping child may take to finish its step and exit before it is killed.
STOP_TIMEOUT_SECONDS = 10.0


class ProcessEngine(EngineFront):
    """The engine in a child process, seen from the event loop; prompts are token ids.
    Start it with `start`."""

    max_answers = MAX_N
    scores_prompts = True
    suspends = True

    def __init__(
        self,
        process: multiprocessing.process.BaseProcess,
        conn: Connection,
        limits: RequestLimits,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
    ) -> None:
        super().__init__(on_step)
        self.limits = limits
        self._free_blocks = limits.num_total_blocks
        self._process = process
        self._conn = conn
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(conn.fileno(), self._on_readable)
        self._reading = True
        # Commands for the writer thread, in order; None ends it.
        self._commands: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._writer = threading.Thread(
            target=self._write_commands, name="tollgate-engine-commands", daemon=True
        )
        self._writer.start()

    @classmethod
    async def start(
        cls,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
        *,
        niceness: int = 0,
    ) -> ProcessEngine:
        """Starts the child and waits until its model is loaded; raises ModelLoadError
        (or what loading raised) when it cannot be. The child and its threads run at
        `niceness` (0-19: how far below this machine's other processes they stand)."""
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe()
        process = context.Process(
            target=serve,
            args=(child_conn, str(model_dir), config or EngineConfig(), niceness),
            name="tollgate-engine",
            daemon=True,
        )
        process.start()
        child_conn.close()
        try:
            kind, body = await asyncio.to_thread(conn.recv)
        except EOFError:
            await asyncio.to_thread(process.join)
            conn.close()
            raise ModelLoadError(
                f"the engine process exited while loading (exit code {process.exitcode})"
            ) from None
        if kind != "ready":
            await asyncio.to_thread(process.join)
            conn.close()
            raise body
        return cls(process, conn, body, on_step)

    @property
    def num_free_blocks(self) -> int:
        """As of the last step the child reported."""
        return self._free_blocks

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
        """Queue a request and return its output stream; raises RequestError at once if invalid."""
        token_ids, params = self._checked(prompt, params)
        command = (
            "add",
            request_id,
            token_ids,
            params,
            cache_namespace,
            Priority.parse(priority),
            adapter,
        )
        stream = self._open_stream(request_id)
        self._send(command)
        return stream

    def abort(self, request_id: str) -> None:
        """Abort in any state; the stream then ends with a finish_reason "abort" output."""
        if request_id in self._streams and not self._closed:
            self._send(("abort", request_id))

    def suspend(self, request_id: str) -> None:
        if request_id in self._streams and not self._closed:
            self._send(("suspend", request_id))

    def resume(self, request_id: str) -> None:
        if request_id in self._streams and not self._closed:
            self._send(("resume", request_id))

    async def shutdown(self) -> None:
        """Stops the child (killed if it does not stop in time); open streams end with
        EngineClosedError."""
        if not self._closed:
            self._closed = True
            self._send(("stop",))
        self._commands.put(None)
        self._stop_reading()
        await asyncio.to_thread(self._process.join, STOP_TIMEOUT_SECONDS)
        if self._process.is_alive():
            self._process.kill()
            await asyncio.to_thread(self._process.join)
        await asyncio.to_thread(self._writer.join)  # the child is gone: no write can block
        self._conn.close()
        self._fail_all(EngineClosedError("the engine was shut down"))

    def _send(self, command: tuple[Any, ...]) -> None:
        self._commands.put(command)

    def _write_commands(self) -> None:
        """The writer thread: sends the commands in order until None, or the child is gone."""
        while (command := self._commands.get()) is not None:
            try:
                self._conn.send(command)
            except OSError:  # BrokenPipeError, ConnectionResetError: the child is gone
                with contextlib.suppress(RuntimeError):  # the event loop closed meanwhile
                    self._loop.call_soon_threadsafe(self._lost)
                return

    def _on_readable(self) -> None:
        try:
            while self._conn.poll():
                kind, *body = self._conn.recv()
                if kind == "step":
                    outputs, self._free_blocks = body
                    self._deliver(outputs)
                elif kind == "refused":
                    request_id, error = body
                    self._fail_one(request_id, error)
                else:  # "failed": the step loop raised, and the child is exiting
                    self._lost(body[0])
                    return
        except (EOFError, OSError):
            self._lost()

    def _lost(self, error: BaseException | None = None) -> None:
        """The child is gone: every open stream fails, and nothing more is sent."""
        if not self._reading:
            return
        self._closed = True
        self._commands.put(None)
        self._stop_reading()
        self.lost.set()
        reason = repr(error) if error is not None else f"exit code {self._process.exitcode}"
        failure = EngineClosedError(f"the engine process failed: {reason}")
        failure.__cause__ = error
        self._fail_all(failure)

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._conn.fileno())


def serve(conn: Connection, model_dir: str, config: EngineConfig, niceness: int = 0) -> None:
    """The child's main: load, report ready, then step while there is work."""
    if niceness:
        os.nice(niceness)  # before any thread starts: threads take their creator's
    # Interrupts and termination are the parent's to handle: it says when to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = LLMEngine.from_model_dir(model_dir, config)
    except Exception as error:
        conn.send(
            ("error", error if isinstance(error, EngineError) else ModelLoadError(repr(error)))
        )
        return
    # The model's objects live as long as the process: the collector need not walk them
    # again at each collection of the steps' garbage.
    gc.freeze()
    conn.send(("ready", engine.limits))
    threads = choice_for_engine()
    try:
        while True:
            # Block for commands only while idle; between steps, take what has arrived.
            while conn.poll(0 if engine.has_unfinished_requests() else None):
                if not _apply(engine, conn, conn.recv()):
                    return
            outputs = timed_step(engine, threads)
            if outputs:
                conn.send(("step", outputs, engine.num_free_blocks))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the parent is gone
    except BaseException as error:
        conn.send(("failed", EngineError(f"the engine step loop failed: {error!r}")))


def _apply(engine: LLMEngine, conn: Connection, command: tuple[Any, ...]) -> bool:
    """Carries out one command; False on stop."""
    kind, *args = command
    if kind == "stop":
        return False
    if kind in ("abort", "suspend", "resume"):
        getattr(engine, kind)(args[0])
        return True
    request_id, token_ids, params, namespace, priority, adapter = args
    try:
        engine.add_request(
            request_id,
            token_ids,
            params,
            cache_namespace=namespace,
            priority=priority,
            adapter=adapter,
        )
    except RequestError as error:
        conn.send(("refused", request_id, error))
    return True
