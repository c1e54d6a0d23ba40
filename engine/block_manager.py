"""The KV block pool: allocation, reference counts and the prefix cache (pure Python)."""

from __future__ import annotations

from collections import OrderedDict, deque

from engine.prefix_hash import hash_block
from engine.sequence import Sequence


class BlockManager:
    """Hands out fixed-size KV blocks to sequences and shares full blocks by content hash.

    A free block either holds nothing reusable (plain) or still holds a full, hashed block
    that a later request with the same key and prefix may pick up (cached). New blocks come
    from the plain list first, then from the cached ones, least recently freed first.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._free_plain: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` must gain to hold `num_new_tokens` more computed tokens."""
        total = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> bool:
        return self.num_new_blocks(seq, num_new_tokens) + reserve <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self.num_new_blocks(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(f"{needed} blocks needed, {self.num_free_blocks} free")
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks matching `seq`'s leading full blocks; return the tokens covered.

        At least one token is left uncomputed so the step that finishes the prompt has
        logits to sample from.
        """
        if seq.block_table:
            raise RuntimeError(f"{seq.request_id} already holds blocks")
        if not self.enable_prefix_caching:
            return 0
        limit = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, limit)
        for block_hash in seq.block_hashes[:limit]:
            block_id = self._by_hash.get(block_hash)
            if block_id is None:
                break
            self._acquire(block_id)
            seq.block_table.append(block_id)
        seq.num_hashed_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def commit(self, seq: Sequence) -> None:
        """Publish the full, computed blocks of `seq` to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        self._extend_hashes(seq, num_full)
        for index in range(seq.num_hashed_blocks, num_full):
            block_hash = seq.block_hashes[index]
            block_id = seq.block_table[index]
            # A twin computed concurrently keeps its entry; this block stays private.
            if block_hash not in self._by_hash and self._block_hash[block_id] is None:
                self._by_hash[block_hash] = block_id
                self._block_hash[block_id] = block_hash
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    def free(self, seq: Sequence) -> None:
        """Drop every block of `seq`; its computed state is lost."""
        # Tail blocks are the least likely to be shared, so they are freed (and evicted) first.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_hashed_blocks = 0
        seq.num_computed_tokens = 0

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        size = self.block_size
        for index in range(len(seq.block_hashes), num_blocks):
            parent = seq.block_hashes[index - 1] if index else seq.cache_root
            seq.block_hashes.append(
                hash_block(parent, seq.token_ids[index * size : (index + 1) * size])
            )

    def _acquire(self, block_id: int) -> None:
        if self._ref_counts[block_id] == 0:
            del self._free_cached[block_id]
        self._ref_counts[block_id] += 1

    def _release(self, block_id: int) -> None:
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] < 0:
            raise RuntimeError(f"block {block_id} released more often than acquired")
        if self._ref_counts[block_id] == 0:
            if self._block_hash[block_id] is None:
                self._free_plain.append(block_id)
            else:
                self._free_cached[block_id] = None

    def _take_free_block(self) -> int:
        if self._free_plain:
            block_id = self._free_plain.popleft()
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            evicted = self._block_hash[block_id]
            if evicted is not None and self._by_hash.get(evicted) == block_id:
                del self._by_hash[evicted]
            self._block_hash[block_id] = None
        self._ref_counts[block_id] = 1
        return block_id
