"""The mutable state of one request as it moves through the engine (pure Python)."""

from __future__ import annotations

from enum import Enum

from engine.sampling import Priority, SamplingParams


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # Held back by its worker (`LLMEngine.suspend`): no blocks, no steps until resumed.
    SUSPENDED = "suspended"
    FINISHED = "finished"


class Sequence:
    """Token ids, KV blocks and timing of one request.

    `num_computed_tokens` counts the tokens whose keys and values are in the cache; the
    tokens after it are computed by the next steps. The last sampled token is never
    computed until the following step, so a decoding sequence has exactly one uncomputed token.
    """

    __slots__ = (
        "request_id",
        "params",
        "priority",
        "tenant",
        "arrival_index",
        "cache_root",
        "adapter_slot",
        "num_prompt_tokens",
        "token_ids",
        "status",
        "num_computed_tokens",
        "block_table",
        "block_hashes",
        "num_hashed_blocks",
        "finish_reason",
        "num_cached_tokens",
        "num_preemptions",
        "arrival_time",
        "first_scheduled_time",
        "first_token_time",
        "last_token_time",
        "itl_sum",
        "itl_max",
        "kv_clock",
        "kv_block_seconds",
        "kv_blocks_peak",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: Priority = Priority.INTERACTIVE,
        tenant: str = "",
        arrival_index: int = 0,
        cache_root: bytes = b"",
        arrival_time: float = 0.0,
        adapter_slot: int = 0,
    ) -> None:
        self.request_id = request_id
        self.params = params
        self.priority = priority
        self.tenant = tenant  # whose request: prefills and admissions take turns by it
        self.arrival_index = arrival_index
        self.cache_root = cache_root
        self.adapter_slot = adapter_slot  # 0: the base model; i: the engine's adapter i
        self.num_prompt_tokens = len(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.status = SeqStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_hashed_blocks = 0
        self.finish_reason: str | None = None
        self.num_cached_tokens: int | None = None
        self.num_preemptions = 0
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.itl_sum = 0.0
        self.itl_max = 0.0
        self.kv_clock: float | None = None
        self.kv_block_seconds = 0.0
        self.kv_blocks_peak = 0

    @property
    def rank(self) -> tuple[int, int]:
        """Service order: interactive before batch, then first come first served."""
        return (int(self.priority), self.arrival_index)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def append_token(self, token_id: int, now: float) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.last_token_time is not None:
            gap = now - self.last_token_time
            self.itl_sum += gap
            self.itl_max = max(self.itl_max, gap)
        self.last_token_time = now

    def account_kv(self, now: float) -> None:
        """Charge the blocks held since the last call; call before the block table changes."""
        if self.kv_clock is not None:
            self.kv_block_seconds += len(self.block_table) * max(0.0, now - self.kv_clock)
        self.kv_clock = now
        self.kv_blocks_peak = max(self.kv_blocks_peak, len(self.block_table))

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
