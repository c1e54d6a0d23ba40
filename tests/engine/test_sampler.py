from __future__ import annotations

import pytest
import torch

from engine.errors import RequestError
from engine.layers.sampler import masked, penalized, sample
from engine.sampling import GREEDY_TEMPERATURE, SamplingParams


def gens(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    assert sample(logits, [SamplingParams(temperature=0)] * 2, gens(2)).token_ids == [1, 0]


def test_a_temperature_below_the_greedy_one_is_greedy_not_nan() -> None:
    # A subnormal float32 temperature would overflow the scaled logits into NaN.
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    params = [SamplingParams(temperature=1e-40), SamplingParams(temperature=GREEDY_TEMPERATURE / 2)]
    assert all(p.is_greedy for p in params)
    assert sample(logits, params, gens(2)).token_ids == [1, 0]


def test_top_k_limits_draws_to_the_k_best() -> None:
    logits = torch.tensor([[4.0, 3.9, 3.8, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=5.0, top_k=2)
    draws = {sample(logits, [params], [g]).token_ids[0] for g in gens(200)}
    assert draws == {0, 1}


def test_top_p_keeps_the_smallest_set_holding_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    params = SamplingParams(temperature=1.0, top_p=0.75)
    draws = {sample(probs.log(), [params], [g]).token_ids[0] for g in gens(300)}
    assert draws == {0, 1}


def test_temperature_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.7, 0.2, 0.1])
    params = SamplingParams(temperature=1.0)
    draws = [sample(probs.log().unsqueeze(0), [params], [g]).token_ids[0] for g in gens(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    assert torch.allclose(freq, probs, atol=0.03)


def test_a_row_draw_depends_only_on_its_own_generator_and_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    target = SamplingParams(temperature=0.9, top_p=0.95)
    alone = sample(logits[2:3], [target], [torch.Generator().manual_seed(42)]).token_ids[0]
    neighbours = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=5),
        target,
        SamplingParams(top_p=0.5, top_k=900),
        SamplingParams(temperature=2.0),
    ]
    rngs = gens(5, seed=7)
    rngs[2] = torch.Generator().manual_seed(42)
    assert sample(logits, neighbours, rngs).token_ids[2] == alone


def reference_penalties(
    logits: torch.Tensor, params: SamplingParams, tokens: list[int], num_prompt: int
) -> torch.Tensor:
    """One row's penalties and biases, token by token, as OpenAI and vLLM define them."""
    out = logits.clone()
    output = tokens[num_prompt:]
    for token in range(logits.shape[0]):
        count = output.count(token)
        out[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
        if token in tokens and params.repetition_penalty != 1.0:
            value = out[token]
            out[token] = (
                value / params.repetition_penalty
                if value > 0
                else value * params.repetition_penalty
            )
    for token, bias in params.logit_bias:
        out[token] += bias
    return out


def test_penalties_and_biases_match_their_definition_row_by_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 12)
    rows = [
        (SamplingParams(frequency_penalty=0.7, presence_penalty=-0.3), [1, 2, 3, 3, 5, 3], 2),
        (SamplingParams(), [4, 4, 4], 1),  # no penalty: left as it is
        (SamplingParams(repetition_penalty=1.8, logit_bias=((7, 5.0), (0, -100.0))), [7, 9, 1], 1),
        (SamplingParams(frequency_penalty=2.0, repetition_penalty=0.5), [11, 11], 0),
    ]
    params = [p for p, _, _ in rows]
    histories = [(tokens, num_prompt) for _, tokens, num_prompt in rows]
    got = penalized(logits, params, histories)
    for i, (p, tokens, num_prompt) in enumerate(rows):
        assert torch.allclose(got[i], reference_penalties(logits[i], p, tokens, num_prompt)), i


def test_a_penalty_steers_greedy_decoding_and_no_penalty_changes_nothing() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]])
    greedy = SamplingParams(temperature=0)
    assert sample(logits, [greedy], [torch.Generator()], [([1, 1], 1)]).token_ids == [1]
    repeated = SamplingParams(temperature=0, presence_penalty=0.5)
    assert sample(logits, [repeated], [torch.Generator()], [([1, 1], 1)]).token_ids == [2]
    banned = SamplingParams(temperature=0, logit_bias=((1, -100.0),))
    assert sample(logits, [banned], [torch.Generator()], [([0], 1)]).token_ids == [2]


def test_min_p_drops_tokens_less_likely_than_its_share_of_the_best() -> None:
    # Probabilities 0.5, 0.25, 0.125, 0.125: min_p 0.3 keeps those at least 0.15.
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    params = [SamplingParams(min_p=0.3)]
    draws = {
        sample(logits, params, [torch.Generator().manual_seed(s)]).token_ids[0] for s in range(200)
    }
    assert draws == {0, 1}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 2.5),
        ("presence_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("min_p", 1.5),
        ("logit_bias", ((1, 101.0),)),
    ],
)
def test_out_of_range_penalties_are_refused_naming_them(field: str, value: object) -> None:
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def bitmask(allowed: set[int], vocab: int) -> torch.Tensor:
    """A grammar's bitmask row: bit t % 32 of word t // 32 set where token t is allowed."""
    words = [0] * -(-vocab // 32)
    for token in allowed:
        words[token // 32] |= 1 << (token % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def test_a_mask_leaves_only_its_tokens_and_spares_unmasked_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    allowed = {3, 31, 32, 63, 69}  # word edges and the sign bit
    masks = [bitmask(allowed, 70), None, bitmask({5}, 70)]
    got = masked(logits, masks)
    assert torch.isinf(got[0]).sum() == 70 - len(allowed)
    assert torch.equal(got[0][sorted(allowed)], logits[0][sorted(allowed)])
    assert torch.equal(got[1], logits[1])
    assert got[2].argmax() == 5 and torch.isinf(got[2]).sum() == 69
    hot = [SamplingParams(temperature=2.0, top_p=0.9)]
    draws = {sample(logits[:1], hot, [g], masks=masks[:1]).token_ids[0] for g in gens(300)}
    assert draws <= allowed and len(draws) > 1
    greedy = sample(logits, [SamplingParams(temperature=0)] * 3, gens(3), masks=masks).token_ids
    assert greedy == [int(got[0].argmax()), int(logits[1].argmax()), 5]


def test_logprobs_are_the_log_softmax_after_biases_and_before_temperature() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0, logprobs=5),
        SamplingParams(temperature=0),
        SamplingParams(temperature=3.0, top_k=2, logprobs=0),
        SamplingParams(temperature=0, logprobs=20, logit_bias=((7, 100.0),)),
    ]
    result = sample(logits, params, gens(4), [([], 0)] * 4)
    assert result.logprobs[1] is None
    first, third, fourth = result.logprobs[0], result.logprobs[2], result.logprobs[3]
    assert first is not None and third is not None and fourth is not None
    expected = torch.log_softmax(logits, dim=-1)
    values, ids = expected[0].topk(5)
    assert first.token_id == result.token_ids[0] == ids[0]
    assert first.top == tuple(zip(ids.tolist(), values.tolist(), strict=True))
    assert first.logprob == first.top[0][1]
    # Temperature and top-k do not change them; k = 0 gives the sampled token's alone.
    assert third.top == ()
    assert third.logprob == pytest.approx(expected[2, third.token_id].item())
    # A bias does.
    biased = logits[3].clone()
    biased[7] += 100.0
    assert fourth.token_id == 7 and len(fourth.top) == 20
    assert fourth.logprob == pytest.approx(torch.log_softmax(biased, -1)[7].item())
    assert [v for _, v in fourth.top] == sorted((v for _, v in fourth.top), reverse=True)


def test_logprobs_name_no_token_the_mask_forbids() -> None:
    logits = torch.zeros(1, 40)
    params = [SamplingParams(temperature=0, logprobs=10)]
    [entry] = sample(logits, params, gens(1), masks=[bitmask({2, 33}, 40)]).logprobs
    assert entry is not None
    assert sorted(t for t, _ in entry.top) == [2, 33]
    assert entry.logprob == pytest.approx(-0.6931, abs=1e-4)


@pytest.mark.parametrize("logprobs", [-1, 21])
def test_out_of_range_logprobs_are_refused(logprobs: int) -> None:
    with pytest.raises(RequestError, match="logprobs"):
        SamplingParams(logprobs=logprobs)
