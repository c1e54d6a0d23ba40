from __future__ import annotations

import torch

from engine.layers.sampler import sample
from engine.sampling import GREEDY_TEMPERATURE, SamplingParams


def gens(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    assert sample(logits, [SamplingParams(temperature=0)] * 2, gens(2)) == [1, 0]


def test_a_temperature_below_the_greedy_one_is_greedy_not_nan() -> None:
    # A subnormal float32 temperature would overflow the scaled logits into NaN.
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 1.0]])
    params = [SamplingParams(temperature=1e-40), SamplingParams(temperature=GREEDY_TEMPERATURE / 2)]
    assert all(p.is_greedy for p in params)
    assert sample(logits, params, gens(2)) == [1, 0]


def test_top_k_limits_draws_to_the_k_best() -> None:
    logits = torch.tensor([[4.0, 3.9, 3.8, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=5.0, top_k=2)
    draws = {sample(logits, [params], [g])[0] for g in gens(200)}
    assert draws == {0, 1}


def test_top_p_keeps_the_smallest_set_holding_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    params = SamplingParams(temperature=1.0, top_p=0.75)
    draws = {sample(probs.log(), [params], [g])[0] for g in gens(300)}
    assert draws == {0, 1}


def test_temperature_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.7, 0.2, 0.1])
    params = SamplingParams(temperature=1.0)
    draws = [sample(probs.log().unsqueeze(0), [params], [g])[0] for g in gens(3000)]
    freq = torch.bincount(torch.tensor(draws), minlength=3).float() / len(draws)
    assert torch.allclose(freq, probs, atol=0.03)


def test_a_row_draw_depends_only_on_its_own_generator_and_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 300)
    target = SamplingParams(temperature=0.9, top_p=0.95)
    alone = sample(logits[2:3], [target], [torch.Generator().manual_seed(42)])[0]
    neighbours = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=5),
        target,
        SamplingParams(top_p=0.5, top_k=900),
        SamplingParams(temperature=2.0),
    ]
    rngs = gens(5, seed=7)
    rngs[2] = torch.Generator().manual_seed(42)
    assert sample(logits, neighbours, rngs)[2] == alone
