from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.prefix_hash import PrefixKey
from engine.sampling import SamplingParams
from engine.sequence import Sequence

KEY = PrefixKey("tenant-a", "model", "tok", "tmpl", "", "float32", 4)


def make_seq(tokens: list[int], root: bytes = KEY.root(), rid: str = "r") -> Sequence:
    return Sequence(rid, tokens, SamplingParams(), cache_root=root)


def compute(manager: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """What a step does: allocate, 'compute', publish full blocks."""
    n = seq.num_uncomputed_tokens if num_tokens is None else num_tokens
    manager.allocate(seq, n)
    seq.num_computed_tokens += n
    manager.commit(seq)


def assert_all_free(manager: BlockManager) -> None:
    assert manager.num_free_blocks == manager.num_total_blocks
    assert all(manager.ref_count(b) == 0 for b in range(manager.num_total_blocks))


def test_allocate_and_free_return_every_block() -> None:
    manager = BlockManager(8, 4)
    seq = make_seq(list(range(10)))
    compute(manager, seq)
    assert len(seq.block_table) == 3 and manager.num_free_blocks == 5
    assert all(manager.ref_count(b) == 1 for b in seq.block_table)
    manager.free(seq)
    assert_all_free(manager)
    assert seq.block_table == [] and seq.num_computed_tokens == 0


def test_blocks_needed_rounds_up() -> None:
    manager = BlockManager(8, 16)
    assert [manager.blocks_needed(n) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_prefix_hit_shares_full_blocks_and_leaves_a_token_to_compute() -> None:
    manager = BlockManager(16, 4)
    first = make_seq(list(range(12)), rid="a")
    compute(manager, first)
    second = make_seq(list(range(12)) + [99], rid="b")
    assert manager.match_prefix(second) == 12
    assert second.block_table == first.block_table
    assert all(manager.ref_count(b) == 2 for b in first.block_table)
    exact = make_seq(list(range(12)), rid="c")
    # A 12-token prompt may reuse only 2 blocks: the last token must be computed for logits.
    assert manager.match_prefix(exact) == 8
    for seq in (first, second, exact):
        manager.free(seq)
    assert_all_free(manager)


def test_chained_hash_needs_the_whole_prefix_to_match() -> None:
    manager = BlockManager(16, 4)
    compute(manager, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], rid="a"))
    other = make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9], rid="b")  # second block equal, first not
    assert manager.match_prefix(other) == 0


def test_every_key_field_separates_caches() -> None:
    manager = BlockManager(64, 4)
    tokens = list(range(9))
    compute(manager, make_seq(tokens, rid="origin"))
    variants = [
        replace(KEY, namespace="tenant-b"),
        replace(KEY, model_fingerprint="m2"),
        replace(KEY, tokenizer_fingerprint="t2"),
        replace(KEY, template_fingerprint="x"),
        replace(KEY, adapter_fingerprint="lora"),
        replace(KEY, kv_dtype="bfloat16"),
        replace(KEY, block_size=8),
    ]
    for i, key in enumerate(variants):
        assert manager.match_prefix(make_seq(tokens, key.root(), rid=f"v{i}")) == 0
    assert manager.match_prefix(make_seq(tokens, KEY.root(), rid="same")) == 8


def test_free_cached_blocks_survive_until_plain_ones_run_out_then_lru() -> None:
    manager = BlockManager(4, 2)
    old = make_seq([1, 2, 3], rid="old")
    compute(manager, old)  # 2 blocks, 1 full and cached
    manager.free(old)
    new = make_seq([5, 6, 7], rid="new")
    compute(manager, new)  # takes the 2 plain blocks
    assert manager.match_prefix(make_seq([1, 2, 3], rid="hit")) == 2
    manager.free(new)


def test_least_recently_freed_cached_block_is_evicted_first() -> None:
    manager = BlockManager(3, 2)
    a, b, c = (
        make_seq([1, 1, 0], rid="a"),
        make_seq([2, 2, 0], rid="b"),
        make_seq([3, 3, 0], rid="c"),
    )
    for seq in (a, b, c):
        compute(manager, seq, 2)
    for seq in (a, b, c):
        manager.free(seq)
    compute(manager, make_seq([9, 9, 9], rid="d"), 2)  # evicts a's block
    assert manager.match_prefix(make_seq([1, 1, 0], rid="a2")) == 0
    assert manager.match_prefix(make_seq([2, 2, 0], rid="b2")) == 2


TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=14)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["tenant-a", "tenant-b"]), TOKENS, st.booleans()), max_size=25
    )
)
def test_two_namespaces_never_share_a_block(requests: list[tuple[str, list[int], bool]]) -> None:
    manager = BlockManager(24, 2)
    roots = {ns: replace(KEY, namespace=ns).root() for ns in ("tenant-a", "tenant-b")}
    written_by: dict[int, str] = {}
    live: list[tuple[str, Sequence]] = []
    for i, (namespace, tokens, keep) in enumerate(requests):
        seq = make_seq(tokens, roots[namespace], rid=str(i))
        manager.match_prefix(seq)
        # Every block a prefix hit hands out was last written by the same namespace.
        assert all(written_by[b] == namespace for b in seq.block_table)
        if not manager.can_allocate(seq, seq.num_uncomputed_tokens):
            manager.free(seq)
            continue
        reused = len(seq.block_table)
        compute(manager, seq)
        written_by.update(dict.fromkeys(seq.block_table[reused:], namespace))
        holders = {ns for ns, s in live if set(s.block_table) & set(seq.block_table)}
        assert holders <= {namespace}
        if keep:
            live.append((namespace, seq))
        else:
            manager.free(seq)
    for _, seq in live:
        manager.free(seq)
    assert_all_free(manager)
