"""How many threads the engine's steps use: all it was given, or fewer while another
process holds one of its cores (no I/O: the step loop times the steps).

A step's threads meet at dozens of barriers. With every core free that is the fastest
way to step; with a core taken by another busy process, the thread that shares it runs
a fraction of the time and every barrier waits for it, so a step takes many times as
long. One thread fewer then does better than all of them. `ThreadChoice` watches the
time of decode-only steps per sequence: when it rises well above what it was, it tries
fewer threads for a few steps and keeps them if they step faster. A trial alternates the
two counts step by step, so that both are timed on the same batches: a batch that grows
or shrinks meanwhile changes the time per sequence far more than threads do. It tries them
on decode steps only: after a step that prefilled, the next runs on the chosen count, so
that a burst of long prefill steps does not run on a count that may lose. Now and then it tries
the other count anyway (less often each time that loses): on fewer threads, so that the
engine takes its cores back once they are free; on all, to find a core that was taken
before any step was timed.
"""

from __future__ import annotations

import math
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
        # The latest decode-only steps on all the threads: each one's seconds per
        # sequence over the usual for its batch's size.
        self._recent: deque[float] = deque(maxlen=window)
        # Seconds per sequence of a decode step while all went well, by the batch's size
        # (`_size_class`): the bar a slowdown is measured by. A batch of more sequences
        # costs less per sequence, so a batch that shrinks is no slowdown.
        self._usual: dict[int, float] = {}
        self._trying: int | None = None
        self._trial: list[float] = []  # on `_trying` threads
        self._against: list[float] = []  # on `current` threads, between those
        self._since_trial = 0
        self._ran = most  # what the step being timed runs on
        self._decoded = True  # whether the last step timed was decode-only

    def threads(self) -> int:
        """The threads the next step should use."""
        # A trial's turn comes on decode steps, every other one.
        turn = self._decoded and len(self._trial) <= len(self._against)
        self._ran = self._trying if self._trying is not None and turn else self.current
        return self._ran

    def record(self, seconds: float, num_seqs: int, decode_only: bool) -> None:
        """Takes in the time of the step just run on `threads()` threads."""
        self._decoded = decode_only and num_seqs > 0
        if not self._decoded:
            return
        cost = seconds / num_seqs
        if self._trying is not None:
            (self._trial if self._ran == self._trying else self._against).append(cost)
            if min(len(self._trial), len(self._against)) >= self.window:
                self._end_trial()
            return
        self._since_trial += 1
        fewer = max(1, self.most // 2)
        if self.current == self.most:
            self._recent.append(self._over_usual(cost, num_seqs))
            slow = len(self._recent) == self.window
            if slow and statistics.median(self._recent) > self.slower:
                self._start_trial(fewer)
                return
        if self._since_trial >= self._next_retry:
            self._start_trial(self.most if self.current < self.most else fewer)

    def _over_usual(self, cost: float, num_seqs: int) -> float:
        """`cost` over the usual for batches of about `num_seqs`, which it then moves
        towards (slowly upwards); 1 for a size not seen before."""
        size = _size_class(num_seqs)
        usual = self._usual.get(size)
        self._usual[size] = cost if usual is None else min(usual, cost) * 0.9 + cost * 0.1
        return 1.0 if usual is None else cost / usual

    def _start_trial(self, threads: int) -> None:
        self._trying, self._trial, self._against = threads, [], []

    def _end_trial(self) -> None:
        assert self._trying is not None
        trial, before = statistics.median(self._trial), statistics.median(self._against)
        if trial < self.better * before:
            self.current = self._trying
            self._next_retry = self.retry_every
        else:
            self._next_retry = min(
                max(2 * self._next_retry, self.retry_every), self.max_retry_every
            )
        # Either way the usual costs are learnt anew: on other threads, or slower for
        # another reason (longer contexts, say).
        self._usual, self._recent = {}, deque(maxlen=self.window)
        self._trying, self._trial, self._against, self._since_trial = None, [], [], 0


def _size_class(num_seqs: int) -> int:
    """Batch sizes within about a quarter of each other share a class."""
    return round(4 * math.log2(num_seqs))
