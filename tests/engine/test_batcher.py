"""Batching policy, driven without a model: each sampled token is a fake id."""

from __future__ import annotations

from itertools import count

from engine.batcher import Batcher, StepPlan
from engine.block_manager import BlockManager
from engine.sampling import Priority, SamplingParams
from engine.sequence import Sequence

_ids = count()


def make_seq(
    rid: str, prompt_len: int, max_tokens: int, priority: Priority = Priority.INTERACTIVE
) -> Sequence:
    # Distinct tokens per request keep the prefix cache out of these tests.
    base = next(_ids) * 100_000
    return Sequence(
        rid,
        [base + i for i in range(prompt_len)],
        SamplingParams(max_tokens=max_tokens),
        priority=priority,
        arrival_index=next(_ids),
    )


def step(batcher: Batcher) -> StepPlan:
    """Schedule, 'execute', append a token to every sampling chunk, retire finished sequences."""
    plan = batcher.schedule()
    batcher.on_executed(plan)
    for chunk in plan.chunks:
        if chunk.samples:
            seq = chunk.seq
            seq.append_token(7, 0.0)
            if seq.num_output_tokens >= seq.params.max_tokens:
                batcher.finish(seq)
    return plan


def run_until_idle(batcher: Batcher, max_steps: int = 10_000) -> int:
    for steps in range(max_steps):
        if not batcher.has_unfinished:
            return steps
        step(batcher)
    raise AssertionError("batcher did not drain")


def test_running_streams_get_a_token_every_step_while_a_4k_prompt_prefills() -> None:
    batcher = Batcher(BlockManager(2048, 16), max_num_batched_tokens=512, max_num_seqs=64)
    streams = [make_seq(f"s{i}", 20, 200) for i in range(4)]
    for seq in streams:
        batcher.add(seq)
    while any(s.num_output_tokens == 0 for s in streams):
        step(batcher)
    long = make_seq("long", 4096, 4)
    batcher.add(long)
    prefill_steps = 0
    while long.num_output_tokens == 0:
        before = [s.num_output_tokens for s in streams]
        plan = step(batcher)
        prefill_steps += 1
        # Every running stream advances by exactly one token per step: ITL is one step.
        assert [s.num_output_tokens for s in streams] == [b + 1 for b in before]
        assert plan.num_tokens <= 512
        assert [c.num_tokens for c in plan.chunks[:4]] == [1, 1, 1, 1]
    assert prefill_steps == -(-4096 // (512 - 4))


def test_decodes_come_before_prefill_chunks_in_the_plan() -> None:
    batcher = Batcher(BlockManager(256, 16), max_num_batched_tokens=64, max_num_seqs=8)
    batcher.add(make_seq("a", 10, 50))
    step(batcher)
    batcher.add(make_seq("b", 100, 5))
    plan = step(batcher)
    assert [(c.seq.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1), ("b", 63)]


def test_interactive_is_admitted_before_earlier_batch_requests() -> None:
    batcher = Batcher(BlockManager(256, 16), max_num_batched_tokens=32, max_num_seqs=8)
    batch = make_seq("batch", 32, 4, Priority.BATCH)
    interactive = make_seq("interactive", 32, 4, Priority.INTERACTIVE)
    batcher.add(batch)
    batcher.add(interactive)
    plan = step(batcher)
    assert [c.seq.request_id for c in plan.chunks] == ["interactive"]


def test_a_pool_too_small_for_the_load_preempts_but_everything_finishes() -> None:
    manager = BlockManager(24, 4)  # 96 token slots for 12 requests of up to 70 tokens
    batcher = Batcher(manager, max_num_batched_tokens=64, max_num_seqs=16)
    seqs = [
        make_seq(f"r{i}", 20 + 2 * i, 40, Priority.BATCH if i % 3 == 0 else Priority.INTERACTIVE)
        for i in range(12)
    ]
    for seq in seqs:
        batcher.add(seq)
    run_until_idle(batcher)
    assert all(s.is_finished and s.num_output_tokens == 40 for s in seqs)
    total = sum(s.num_preemptions for s in seqs)
    assert 0 < total <= 3 * len(seqs)
    # The first-ranked request is never a victim.
    assert min(seqs, key=lambda s: s.rank).num_preemptions == 0
    assert manager.num_free_blocks == manager.num_total_blocks


def test_victim_is_the_lowest_ranked_running_sequence() -> None:
    manager = BlockManager(6, 4)
    batcher = Batcher(manager, max_num_batched_tokens=64, max_num_seqs=8, watermark_blocks=0)
    first = make_seq("first", 7, 20)
    late_interactive = make_seq("late", 3, 20)
    batch = make_seq("batch", 3, 20, Priority.BATCH)
    for seq in (first, batch, late_interactive):
        batcher.add(seq)
    while not (first.num_preemptions or batch.num_preemptions or late_interactive.num_preemptions):
        step(batcher)
    assert batch.num_preemptions == 1
    assert first.num_preemptions == late_interactive.num_preemptions == 0


def test_max_num_seqs_caps_the_running_set() -> None:
    batcher = Batcher(BlockManager(256, 16), max_num_batched_tokens=512, max_num_seqs=3)
    for i in range(5):
        batcher.add(make_seq(f"r{i}", 5, 10))
    step(batcher)
    assert len(batcher.running) == 3 and len(batcher.waiting) == 2


def test_finish_in_any_state_returns_blocks() -> None:
    manager = BlockManager(64, 4)
    batcher = Batcher(manager, max_num_batched_tokens=8, max_num_seqs=8)
    prefilling, waiting, decoding = make_seq("p", 30, 5), make_seq("w", 5, 5), make_seq("d", 3, 50)
    batcher.add(decoding)
    step(batcher)
    batcher.add(prefilling)
    batcher.add(waiting)
    step(batcher)
    for seq in (prefilling, waiting, decoding):
        batcher.finish(seq)
    assert not batcher.has_unfinished
    assert manager.num_free_blocks == manager.num_total_blocks


def tenant_seq(rid: str, tenant: str, prompt_len: int, max_tokens: int) -> Sequence:
    seq = make_seq(rid, prompt_len, max_tokens)
    seq.tenant = tenant
    return seq


def test_a_tenants_one_prompt_is_not_held_behind_anothers_many() -> None:
    batcher = Batcher(BlockManager(4096, 16), max_num_batched_tokens=512, max_num_seqs=256)
    flood = [tenant_seq(f"f{i}", "flood", 400, 8) for i in range(20)]
    for seq in flood:
        batcher.add(seq)
    step(batcher)  # the flood's prompts start prefilling
    light = tenant_seq("light", "light", 30, 2)
    batcher.add(light)
    plan = step(batcher)
    # Admitted and prefilled whole at once, the flood's prompts taking the rest.
    assert light.num_output_tokens == 1
    assert plan.num_tokens == 512
    assert {chunk.seq.tenant for chunk in plan.chunks} == {"flood", "light"}


def test_while_two_tenants_prefill_each_gets_an_even_part_of_the_step_first() -> None:
    batcher = Batcher(BlockManager(4096, 16), max_num_batched_tokens=512, max_num_seqs=256)
    first = [tenant_seq(f"a{i}", "a", 1000, 4) for i in range(3)]
    second = tenant_seq("b0", "b", 1000, 4)
    for seq in [*first, second]:
        batcher.add(seq)
    plan = step(batcher)
    by_tenant: dict[str, int] = {}
    for chunk in plan.chunks:
        by_tenant[chunk.seq.tenant] = by_tenant.get(chunk.seq.tenant, 0) + chunk.num_tokens
    assert by_tenant == {"a": 256, "b": 256}


def test_a_lone_tenant_still_takes_the_whole_step_and_the_usual_order() -> None:
    batcher = Batcher(BlockManager(4096, 16), max_num_batched_tokens=512, max_num_seqs=256)
    seqs = [tenant_seq(f"a{i}", "a", 300, 4) for i in range(3)]
    for seq in seqs:
        batcher.add(seq)
    plan = step(batcher)
    assert [(c.seq.request_id, c.num_tokens) for c in plan.chunks] == [("a0", 300), ("a1", 212)]
    assert run_until_idle(batcher) > 0
    assert all(s.num_output_tokens == 4 for s in seqs)


def test_the_waiting_request_admitted_next_is_of_the_tenant_that_runs_the_fewest() -> None:
    # Room for three sequences at a time: each needs two blocks, and one is kept spare.
    batcher = Batcher(BlockManager(7, 16), max_num_batched_tokens=512, max_num_seqs=8)
    # Ending one at a time, so that the flood still runs two when the first ends.
    flood = [tenant_seq(f"f{i}", "flood", 20, 4 + 3 * i) for i in range(6)]
    for seq in flood:
        batcher.add(seq)
    step(batcher)
    assert [s.request_id for s in batcher.running] == ["f0", "f1", "f2"]
    light = tenant_seq("light", "light", 20, 2)
    batcher.add(light)
    admitted: list[str] = []
    while batcher.has_unfinished:
        step(batcher)
        admitted += [s.request_id for s in batcher.running if s.request_id not in admitted]
    # It went ahead of the flood's three waiting since before it.
    assert admitted.index("light") < admitted.index("f3")
    assert all(s.num_output_tokens == s.params.max_tokens for s in [*flood, light])


def prefill_tokens(plan: StepPlan, tenant: str) -> int:
    return sum(c.num_tokens for c in plan.chunks if c.seq.tenant == tenant and c.num_tokens > 1)


def test_while_another_tenant_decodes_a_long_prompt_takes_an_even_part_of_the_step() -> None:
    batcher = Batcher(BlockManager(4096, 16), max_num_batched_tokens=512, max_num_seqs=256)
    light = tenant_seq("light", "light", 20, 50)
    batcher.add(light)
    step(batcher)  # the light tenant's stream decodes from now on
    batcher.add(tenant_seq("long", "flood", 4096, 4))
    plans = [step(batcher) for _ in range(4)]
    # Its decode first, then half of what it left: the prompt's chunks make each step
    # half as long as they would alone.
    assert [prefill_tokens(p, "flood") for p in plans] == [255] * 4
    assert all(any(c.seq is light for c in p.chunks) for p in plans)
    batcher.finish(light)
    assert prefill_tokens(step(batcher), "flood") == 512  # alone again: the whole step
