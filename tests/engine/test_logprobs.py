"""Logprobs from the engine: the model's own distribution at each step, as the request's
penalties, biases and grammar left it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.sampling import SamplingParams
from tests.engine.helpers import paged_logits, run_all
from tests.engine.test_engine import prompt

MakeEngine = Callable[..., LLMEngine]


def test_greedy_logprobs_are_the_log_softmax_of_the_models_logits(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    ids = prompt(11)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=4)
    [result] = engine.generate([ids], params)
    assert len(result.logprobs) == len(result.token_ids) == 8
    tokens = ids + list(result.token_ids)
    logits = paged_logits(engine.runner.model, tokens[:-1], [len(tokens) - 1])
    # Row p predicts token p + 1: the outputs are predicted by the last 8 rows.
    expected = torch.log_softmax(logits[len(ids) - 1 :], dim=-1)
    for row, token, entry in zip(expected, result.token_ids, result.logprobs, strict=True):
        values, top_ids = row.topk(4)
        assert entry.token_id == token == top_ids[0]
        assert entry.logprob == entry.top[0][1]
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert torch.allclose(torch.tensor([v for _, v in entry.top]), values, atol=1e-4)


def test_sampled_tokens_carry_their_own_logprob_and_k_zero_gives_it_alone(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    sampled = SamplingParams(max_tokens=12, temperature=1.5, seed=3, ignore_eos=True, logprobs=0)
    listed = SamplingParams(max_tokens=12, temperature=1.5, seed=3, ignore_eos=True, logprobs=20)
    bare = SamplingParams(max_tokens=12, temperature=1.5, seed=3, ignore_eos=True)
    alone, ranked, none = engine.generate([prompt(6)] * 3, [sampled, listed, bare])
    assert alone.token_ids == ranked.token_ids == none.token_ids
    assert none.logprobs == ()
    assert all(entry.top == () for entry in alone.logprobs)
    assert [e.logprob for e in alone.logprobs] == [e.logprob for e in ranked.logprobs]
    for token, entry in zip(ranked.token_ids, ranked.logprobs, strict=True):
        top = dict(entry.top)
        assert len(top) == 20 and entry.token_id == token
        assert list(top.values()) == sorted(top.values(), reverse=True)
        if token in top:
            assert top[token] == entry.logprob
        else:
            assert entry.logprob <= min(top.values())


def test_each_streamed_output_carries_its_tokens_logprobs(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.add_request("r", prompt(5), SamplingParams(max_tokens=5, temperature=0, logprobs=2))
    engine.add_request("plain", prompt(5), SamplingParams(max_tokens=5, temperature=0))
    outputs = run_all(engine)
    for out in outputs["r"]:
        assert [e.token_id for e in out.logprobs] == list(out.new_token_ids)
    assert all(out.logprobs == () for out in outputs["plain"])


def test_under_a_grammar_they_are_the_masked_distribution(make_engine: MakeEngine) -> None:
    params = SamplingParams(max_tokens=5, temperature=0, grammar='start: "yes" | "no"', logprobs=20)
    [result] = make_engine().generate([prompt(4)], params)
    for entry in result.logprobs:
        mass = sum(torch.tensor([v for _, v in entry.top]).exp().tolist())
        assert abs(mass - 1.0) < 1e-4
        assert len(entry.top) < 20


@pytest.mark.parametrize("budget", [64, 7])
def test_prompt_logprobs_are_the_model_s_distribution_over_its_whole_prompt(
    make_engine: MakeEngine, budget: int
) -> None:
    """Chunked or not, and though the prompt is in the prefix cache already."""
    engine = make_engine(max_num_batched_tokens=budget)
    ids = prompt(29, seed=5)
    engine.generate([ids], SamplingParams(max_tokens=1))  # its blocks now cached
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3, logprobs=1)
    [result] = engine.generate([ids], params)
    assert result.metrics.num_cached_prompt_tokens == 0
    assert len(result.prompt_logprobs) == len(ids) - 1
    # Row p predicts token p + 1.
    expected = torch.log_softmax(paged_logits(engine.runner.model, ids, [len(ids)]), dim=-1)
    for p, entry in enumerate(result.prompt_logprobs):
        assert entry.token_id == ids[p + 1]
        assert abs(entry.logprob - expected[p, ids[p + 1]].item()) < 1e-4
        values, top_ids = expected[p].topk(3)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert torch.allclose(torch.tensor([v for _, v in entry.top]), values, atol=1e-4)
    # The output's own logprobs are as without prompt_logprobs.
    [plain] = engine.generate([ids], replace(params, prompt_logprobs=None))
    assert plain.prompt_logprobs == () and plain.token_ids == result.token_ids


def test_prompt_logprobs_survive_preemption_once_each(make_engine: MakeEngine) -> None:
    prompts = [prompt(n, seed=n) for n in (3, 30, 57, 21, 44)]
    roomy = make_engine(max_num_batched_tokens=512)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=0)
    expected = roomy.generate(prompts, params)
    cramped = make_engine(num_kv_blocks=40, max_num_batched_tokens=16)
    results = cramped.generate(prompts, params)
    assert sum(r.metrics.num_preemptions for r in results) > 0
    for got, want, ids in zip(results, expected, prompts, strict=True):
        assert [e.token_id for e in got.prompt_logprobs] == ids[1:]
        assert all(e.top == () for e in got.prompt_logprobs)
        for a, b in zip(got.prompt_logprobs, want.prompt_logprobs, strict=True):
            assert abs(a.logprob - b.logprob) < 1e-4


def test_a_one_token_prompt_has_no_prompt_logprobs(make_engine: MakeEngine) -> None:
    [result] = make_engine().generate([[7]], SamplingParams(max_tokens=2, prompt_logprobs=2))
    assert result.prompt_logprobs == () and len(result.token_ids) == 2
