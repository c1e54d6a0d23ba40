"""How many threads the engine's steps use: all it was given, or fewer while another
process holds one of its cores (no I/O: the step loop times the steps).

A step's threads meet at dozens of barriers. With every core free that is the fastest
way to step; with a core taken by another busy process, the thread that shares it runs
a fraction of the time and every barrier waits for it, so a step takes many times as
long. One thread fewer then does better than all of them. `ThreadChoice` watches the
time of decode-only steps per sequence: when it rises well above what it was, it tries
fewer threads for a few steps and keeps them if they step faster. A trial alternates the
two counts step by step, so that both are timed on the same batches: a batch that grows
or shrinks meanwhile changes the time per sequence far more than threads do. Now and then it tries
the other count anyway (less often each time that loses): on fewer threads, so that the
engine takes its cores back once they are free; on all, to find a core that was taken
before any step was timed.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from engine.config import switched_on

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.outputs import RequestOutput


def choice_for_engine() -> ThreadChoice | None:
    """The step loop's choice of threads; None with one thread, or when
    `TOLLGATE_ENGINE_ADAPT_THREADS` is off (0, false, no, off)."""
    if not switched_on("TOLLGATE_ENGINE_ADAPT_THREADS"):
        return None
    most = torch.get_num_threads()
    return ThreadChoice(most) if most > 1 else None


def timed_step(engine: LLMEngine, choice: ThreadChoice | None) -> list[RequestOutput]:
    """One engine step on the threads `choice` gives, timed for it."""
    if choice is None:
        return engine.step()
    threads = choice.threads()
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    start = time.perf_counter()
    outputs = engine.step()
    num_seqs, num_tokens = engine.last_step_shape
    choice.record(time.perf_counter() - start, num_seqs, decode_only=num_seqs == num_tokens)
    return outputs


class ThreadChoice:
    def __init__(
        self,
        most: int,
        *,
        window: int = 8,
        slower: float = 1.5,
        better: float = 0.9,
        retry_every: int = 256,
        max_retry_every: int = 4096,
    ) -> None:
        self.most = most
        self.current = most
        self.window = window
        self.slower = slower
        self.better = better
        self.retry_every = retry_every
        self.max_retry_every = max_retry_every
        # The first trial comes as soon as a window of steps is timed.
        self._next_retry = window
        # Seconds per sequence of the latest decode-only steps on `current` threads.
        self._recent: deque[float] = deque(maxlen=window)
        # What such a step took while all went well: the bar a slowdown is measured by.
        self._usual: float | None = None
        self._trying: int | None = None
        self._trial: list[float] = []  # on `_trying` threads
        self._against: list[float] = []  # on `current` threads, between those
        self._since_trial = 0
        self._ran = most  # what the step being timed runs on

    def threads(self) -> int:
        """The threads the next step should use."""
        if self._trying is None:
            self._ran = self.current
        elif len(self._trial) <= len(self._against):
            self._ran = self._trying
        else:
            self._ran = self.current
        return self._ran

    def record(self, seconds: float, num_seqs: int, decode_only: bool) -> None:
        """Takes in the time of the step just run on `threads()` threads."""
        if not decode_only or num_seqs <= 0:
            return
        cost = seconds / num_seqs
        if self._trying is not None:
            (self._trial if self._ran == self._trying else self._against).append(cost)
            if min(len(self._trial), len(self._against)) >= self.window:
                self._end_trial()
            return
        self._recent.append(cost)
        self._since_trial += 1
        if len(self._recent) < self.window:
            return
        recent = statistics.median(self._recent)
        if self._usual is None:
            self._usual = recent
        fewer = max(1, self.most // 2)
        if self.current == self.most and recent > self.slower * self._usual:
            self._start_trial(fewer)
        elif self._since_trial >= self._next_retry:
            self._start_trial(self.most if self.current < self.most else fewer)
        elif self.current == self.most:
            self._usual = min(self._usual, recent) * 0.9 + recent * 0.1

    def _start_trial(self, threads: int) -> None:
        self._trying, self._trial, self._against = threads, [], []

    def _end_trial(self) -> None:
        assert self._trying is not None
        trial, before = statistics.median(self._trial), statistics.median(self._against)
        if trial < self.better * before:
            self.current = self._trying
            self._recent = deque(self._trial, maxlen=self.window)
            self._next_retry = self.retry_every
            if self.current == self.most:
                self._usual = trial
            self._tried()
            return
        self._next_retry = min(max(2 * self._next_retry, self.retry_every), self.max_retry_every)
        if self.current == self.most:
            self._usual = before  # slower for another reason (fewer or longer sequences)
        self._tried()

    def _tried(self) -> None:
        self._trying, self._trial, self._against, self._since_trial = None, [], [], 0
