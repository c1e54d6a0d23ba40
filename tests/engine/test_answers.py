"""Several answers to one prompt (SamplingParams.n): each its own draw, the prompt computed
once, the request ending with its last answer."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import pytest

from engine.errors import RequestError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams, blocks_for_run

PROMPT = list(range(1, 23))  # five full blocks of four and two tokens more


def run(engine: LLMEngine) -> list[RequestOutput]:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def answers_of(outputs: list[RequestOutput], request_id: str) -> dict[int, list[int]]:
    found: dict[int, list[int]] = defaultdict(list)
    for output in outputs:
        if output.request_id == request_id:
            found[output.index] += output.new_token_ids
    return dict(found)


def test_answer_i_is_the_draw_of_seed_plus_i(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    engine.add_request("many", PROMPT, SamplingParams(**{**_fields(params), "n": 3}))
    for i in range(3):
        engine.add_request(
            f"one-{i}", PROMPT, SamplingParams(**{**_fields(params), "seed": 11 + i})
        )
    outputs = run(engine)
    many = answers_of(outputs, "many")
    assert sorted(many) == [0, 1, 2]
    for i in range(3):
        assert many[i] == answers_of(outputs, f"one-{i}")[0]
    assert len({tuple(tokens) for tokens in many.values()}) > 1


def test_the_prompt_is_computed_once_and_the_request_ends_with_its_last_answer(
    make_engine: Callable[..., LLMEngine],
) -> None:
    engine = make_engine()
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=4))
    group = engine._groups["r"]
    outputs = run(engine)
    # The later answers found the first's full prompt blocks in the prefix cache.
    assert [a.seq.num_cached_tokens for a in group.answers] == [0, 20, 20, 20]
    ended = [o for o in outputs if o.finish_reason is not None]
    assert sorted(o.index for o in ended) == [0, 1, 2, 3]
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    last = outputs[-1].metrics
    assert last.num_prompt_tokens == len(PROMPT)
    assert last.num_output_tokens == sum(len(t) for t in answers_of(outputs, "r").values())
    assert engine.num_free_blocks == engine.num_total_blocks


def test_aborting_stops_every_answer(make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine()
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=50, n=3, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.abort("r")
    (aborted,) = engine.step()
    assert (aborted.request_id, aborted.finish_reason, aborted.finished) == ("r", "abort", True)
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_total_blocks
    assert not engine.abort("r")
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=2))  # the id is free again


def test_a_request_is_refused_when_its_answers_cannot_fit(
    make_engine: Callable[..., LLMEngine],
) -> None:
    engine = make_engine(num_kv_blocks=16)
    fits = blocks_for_run(len(PROMPT), 8, 2, 4)
    assert fits <= 16
    engine.add_request("fits", PROMPT, SamplingParams(max_tokens=8, n=2))
    with pytest.raises(RequestError, match="KV blocks"):
        engine.add_request("too-many", PROMPT, SamplingParams(max_tokens=8, n=4))
    with pytest.raises(RequestError, match="n must be"):
        SamplingParams(n=17)


def test_blocks_for_run_shares_the_prompts_full_blocks() -> None:
    assert blocks_for_run(22, 10, 1, 4) == 8
    assert blocks_for_run(22, 10, 3, 4) == 5 + 3 * 3
    assert blocks_for_run(20, 4, 2, 4) == 5 + 2 * 1


def _fields(params: SamplingParams) -> dict[str, object]:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}
