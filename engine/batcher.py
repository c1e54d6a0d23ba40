"""Continuous batching: which tokens of which requests the next step computes (pure Python).

Each step has a token budget. Running sequences that decode (one uncomputed token) are
served first, in rank order (interactive before batch, then arrival), then prompts being
prefilled, in chunks that fit what is left of the budget, then waiting requests are
admitted. When the pool runs out of blocks, the lowest-ranked running sequence is
preempted (its blocks are freed and it is recomputed later); a sequence is only ever
preempted in favour of a higher-ranked one, so the highest-ranked request always makes
progress and preemptions cannot cycle.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import SeqStatus, Sequence


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at position `start`, computed in one step."""

    seq: Sequence
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when the chunk reaches the sequence's last token, so a new token is sampled."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The work of one step: single-token chunks first, then longer prefill chunks."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Sequence, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)


class _StepDraft:
    """Mutable working state while one plan is built."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.tokens: dict[str, int] = {}
        self.seqs: dict[str, Sequence] = {}
        self.preempted: list[Sequence] = []

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.tokens[seq.request_id] = num_tokens
        self.seqs[seq.request_id] = seq
        self.budget -= num_tokens

    def drop(self, seq: Sequence) -> None:
        self.budget += self.tokens.pop(seq.request_id, 0)
        self.seqs.pop(seq.request_id, None)

    def plan(self) -> StepPlan:
        chunks = [
            ScheduledChunk(seq, seq.num_computed_tokens, self.tokens[rid])
            for rid, seq in self.seqs.items()
        ]
        chunks.sort(key=lambda chunk: chunk.num_tokens > 1)
        return StepPlan(tuple(chunks), tuple(self.preempted))


class Batcher:
    """Keeps the waiting and running sequences and plans each step."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        watermark_blocks: int = 1,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.watermark_blocks = watermark_blocks
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.rank)

    def finish(self, seq: Sequence) -> None:
        """Remove `seq` from whichever queue holds it and return its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SeqStatus.FINISHED

    def schedule(self) -> StepPlan:
        draft = _StepDraft(self.max_num_batched_tokens)
        self._schedule_running(draft)
        if not draft.preempted:
            self._admit_waiting(draft)
        return draft.plan()

    def on_executed(self, plan: StepPlan) -> None:
        """Record that the plan's tokens are now in the KV cache."""
        for chunk in plan.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.commit(chunk.seq)

    def _schedule_running(self, draft: _StepDraft) -> None:
        order = sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.rank))
        for seq in order:
            if seq.status is not SeqStatus.RUNNING:
                continue  # preempted earlier in this step
            num_tokens = min(seq.num_uncomputed_tokens, draft.budget)
            if num_tokens <= 0:
                break
            if self._make_room(seq, num_tokens, draft):
                self.block_manager.allocate(seq, num_tokens)
                draft.add(seq, num_tokens)

    def _make_room(self, seq: Sequence, num_tokens: int, draft: _StepDraft) -> bool:
        """Preempt lower-ranked sequences until `seq` fits; False if `seq` itself had to go."""
        while not self.block_manager.can_allocate(seq, num_tokens):
            victim = max(self.running, key=lambda s: s.rank)
            if victim is seq:
                self._preempt(seq, draft)
                return False
            self._preempt(victim, draft)
        return True

    def _preempt(self, seq: Sequence, draft: _StepDraft) -> None:
        draft.drop(seq)
        draft.preempted.append(seq)
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_preemptions += 1
        self.add(seq)

    def _admit_waiting(self, draft: _StepDraft) -> None:
        manager = self.block_manager
        while self.waiting and draft.budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = manager.match_prefix(seq)
            # Admit only what can finish its prefill without preempting anyone; keep a
            # reserve for the running sequences' next blocks.
            reserve = self.watermark_blocks if self.running else 0
            if not manager.can_allocate(seq, seq.num_uncomputed_tokens, reserve):
                manager.free(seq)
                break
            num_tokens = min(seq.num_uncomputed_tokens, draft.budget)
            manager.allocate(seq, num_tokens)
            self.waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            seq.kv_clock = None
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
            self.running.append(seq)
            draft.add(seq, num_tokens)
