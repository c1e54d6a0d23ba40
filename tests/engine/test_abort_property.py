"""Random adds, steps and aborts never leak a KV block."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams

ADD = st.tuples(
    st.just("add"),
    st.lists(st.integers(6, 9), min_size=1, max_size=30),  # few distinct ids: prefix hits happen
    st.integers(1, 12),
    st.sampled_from(["interactive", "batch"]),
    st.sampled_from(["tenant-a", "tenant-b"]),
)
ACTION = st.one_of(ADD, st.tuples(st.just("step")), st.tuples(st.just("abort"), st.integers(0, 30)))


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(ACTION, max_size=40))
def test_random_aborts_leave_the_pool_free(
    make_engine: Callable[..., LLMEngine], actions: list[tuple]
) -> None:
    engine = make_engine(num_kv_blocks=20, max_num_batched_tokens=16, max_num_seqs=4)
    added: list[str] = []
    finished: dict[str, str] = {}
    for action in actions:
        if action[0] == "add":
            _, ids, max_tokens, priority, namespace = action
            rid = f"r{len(added)}"
            engine.add_request(
                rid,
                ids,
                SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=1),
                cache_namespace=namespace,
                priority=priority,
            )
            added.append(rid)
        elif action[0] == "abort" and added:
            engine.abort(added[action[1] % len(added)])
        else:
            for out in engine.step():
                if out.finished:
                    assert out.request_id not in finished
                    finished[out.request_id] = out.finish_reason or ""
    for rid in added:
        engine.abort(rid)
    for out in engine.step():
        assert out.finished and out.request_id not in finished
        finished[out.request_id] = out.finish_reason or ""
    assert sorted(finished) == sorted(added)
    assert set(finished.values()) <= {"stop", "length", "stop_sequence", "abort"}
    manager = engine.block_manager
    assert manager.num_free_blocks == manager.num_total_blocks
    assert all(manager.ref_count(b) == 0 for b in range(manager.num_total_blocks))
    assert not engine.has_unfinished_requests()
