"""Continuous batching: which tokens of which requests the next step computes (pure Python).

Each step has a token budget. Running sequences that decode (one uncomputed token) are
served first, in rank order (interactive before batch, then arrival), then prompts being
prefilled, in chunks that fit what is left of the budget, then waiting requests are
admitted. Prefills and admissions take turns by tenant within a priority: each tenant's
first prompt before any tenant's second, and while several tenants' prompts wait, none
takes more than an even part of what the decodes left of the step until the others have
theirs; while other tenants' sequences decode, a tenant's prompts take no more than an
even part among the decoding tenants in all (so a long prompt does not make every other
tenant's next token wait behind it); the waiting request admitted next is of the tenant
that runs the fewest. So a tenant with one request is not held behind
another's hundred. A sequence's tenant is its
request's cache namespace (the worker gives the tenant's id).

When the pool runs out of blocks, the lowest-ranked running sequence is
preempted (its blocks are freed and it is recomputed later); a sequence is only ever
preempted in favour of a higher-ranked one, so the highest-ranked request always makes
progress and preemptions cannot cycle. The engine's owner may also suspend a sequence
(`suspend`: its blocks are freed, it keeps its tokens, and nothing of it is computed
until `resume` queues it again, to be recomputed like a preempted one).
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter, defaultdict, deque
from collections.abc import Iterator
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

    def suspend(self, seq: Sequence) -> None:
        """Takes `seq` out of the running or waiting ones and frees its blocks; it keeps
        its tokens, and `add` queues it again."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.num_preemptions += 1
        seq.status = SeqStatus.SUSPENDED

    def schedule(self) -> StepPlan:
        draft = _StepDraft(self.max_num_batched_tokens)
        decodes = sorted((s for s in self.running if s.num_uncomputed_tokens <= 1), key=_rank)
        for seq in decodes:
            self._schedule(seq, draft.budget, draft)
        prefills = in_turns([s for s in self.running if s.num_uncomputed_tokens > 1])
        tenants = {s.tenant for s in prefills} | {s.tenant for s in self.waiting}
        decoding = {s.tenant for s in decodes}
        # What each tenant's prompts may take of the step in all: an even part among the
        # tenants whose sequences decode while another's do, else what the decodes left;
        # and before the others have theirs, an even part among those with prompts.
        most = {
            t: max(1, draft.budget // len(decoding | {t})) if decoding - {t} else draft.budget
            for t in tenants
        }
        share = draft.budget // len(tenants) if len(tenants) > 1 else draft.budget
        first = {t: min(share, most[t]) for t in tenants}
        given: Counter[str] = Counter()
        for seq in prefills:
            given[seq.tenant] += self._schedule(seq, first[seq.tenant] - given[seq.tenant], draft)
        if not draft.preempted:
            prefills += self._admit_waiting(draft, first, given)
        for seq in prefills:  # what is left of the step, in the same turns
            given[seq.tenant] += self._schedule(seq, most[seq.tenant] - given[seq.tenant], draft)
        if len(tenants) > 1 and not draft.preempted and draft.budget > 0:
            self._admit_waiting(draft, most, given)  # the parts some tenants left
        return draft.plan()

    def on_executed(self, plan: StepPlan) -> None:
        """Record that the plan's tokens are now in the KV cache."""
        for chunk in plan.chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.commit(chunk.seq)

    def _schedule(self, seq: Sequence, most: int, draft: _StepDraft) -> int:
        """Schedules up to `most` more of `seq`'s uncomputed tokens in this step (after
        those scheduled already); how many it did."""
        if seq.status is not SeqStatus.RUNNING:
            return 0  # preempted earlier in this step
        had = draft.tokens.get(seq.request_id, 0)
        more = min(seq.num_uncomputed_tokens - had, draft.budget, most)
        if more <= 0 or not self._make_room(seq, had + more, draft):
            return 0
        self.block_manager.allocate(seq, had + more)
        draft.drop(seq)
        draft.add(seq, had + more)
        return more

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

    def _admit_waiting(
        self, draft: _StepDraft, most: dict[str, int], given: Counter[str]
    ) -> list[Sequence]:
        """Admits what fits, each with a first chunk of its tenant's part of the step (the
        `most` it may take less what it was `given`); the sequences admitted."""
        manager = self.block_manager
        admitted: list[Sequence] = []
        for seq in self._admission_order():
            if draft.budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            room = min(most[seq.tenant] - given[seq.tenant], draft.budget)
            if room <= 0:
                continue  # its tenant has had its part; another's may come next
            cached = manager.match_prefix(seq)
            # Admit only what can finish its prefill without preempting anyone; keep a
            # reserve for the running sequences' next blocks.
            reserve = self.watermark_blocks if self.running else 0
            if not manager.can_allocate(seq, seq.num_uncomputed_tokens, reserve):
                manager.free(seq)
                break
            num_tokens = min(seq.num_uncomputed_tokens, room)
            manager.allocate(seq, num_tokens)
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            seq.kv_clock = None
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = min(cached, seq.num_prompt_tokens)
            self.running.append(seq)
            draft.add(seq, num_tokens)
            given[seq.tenant] += num_tokens
            admitted.append(seq)
        return admitted

    def _admission_order(self) -> Iterator[Sequence]:
        """The waiting sequences in the order they are admitted: by rank while one tenant
        has all of them and all that runs; else, within a priority, the next of the tenant
        that runs the fewest (counting those admitted meanwhile), first come first served
        among equals."""
        tenants = {s.tenant for s in self.waiting} | {s.tenant for s in self.running}
        if len(tenants) <= 1:
            yield from list(self.waiting)
            return
        queues: defaultdict[tuple[int, str], deque[Sequence]] = defaultdict(deque)
        for seq in self.waiting:
            queues[(int(seq.priority), seq.tenant)].append(seq)
        running = Counter(s.tenant for s in self.running)
        heap = [(p, running[t], q[0].arrival_index, t) for (p, t), q in queues.items()]
        heapq.heapify(heap)
        while heap:
            priority, num_running, _, tenant = heapq.heappop(heap)
            queue = queues[(priority, tenant)]
            yield queue.popleft()
            if queue:
                heapq.heappush(heap, (priority, num_running + 1, queue[0].arrival_index, tenant))


def _rank(seq: Sequence) -> tuple[int, int]:
    return seq.rank


def in_turns(seqs: list[Sequence]) -> list[Sequence]:
    """`seqs` in rank order, but within a priority each tenant's first before any tenant's
    second, and so on."""
    turns: Counter[tuple[int, str]] = Counter()
    keyed = []
    for seq in sorted(seqs, key=_rank):
        key = (int(seq.priority), seq.tenant)
        keyed.append(((int(seq.priority), turns[key], seq.arrival_index), seq))
        turns[key] += 1
    keyed.sort(key=lambda item: item[0])
    return [seq for _, seq in keyed]
