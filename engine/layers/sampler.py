"""Turning logits into next tokens: greedy, temperature, top-k, top-p, per-request generators."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling import SamplingParams

# Beyond this k a full sort is as cheap as topk.
_MAX_TOPK_SHORTCUT = 1024


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> list[int]:
    """logits: [N, V] -> N token ids. Row i draws only from `generators[i]`, so a seeded
    request gets the same tokens whatever else is in the batch."""
    logits = logits.float()
    tokens: list[int] = logits.argmax(dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not rows:
        return tokens
    chosen = [params[i] for i in rows]
    temperature = torch.tensor([p.temperature for p in chosen], dtype=torch.float32)
    scaled = logits[rows] / temperature.unsqueeze(1)
    probs = torch.softmax(_filter(scaled, chosen), dim=-1)
    for j, row in enumerate(rows):
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws index i with probability p_i.
        # The noise always spans the whole vocabulary in id order, so a row's draw depends
        # only on its own generator and logits, never on its neighbours' parameters.
        noise = torch.empty_like(probs[j]).exponential_(generator=generators[row])
        tokens[row] = int(torch.argmax(probs[j] / noise))
    return tokens


def _filter(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits: [n, V] with tokens outside each row's top-k / top-p set to -inf."""
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if all(k == vocab for k in top_k) and all(p.top_p >= 1 for p in params):
        return logits
    widest = max(top_k)
    if widest <= _MAX_TOPK_SHORTCUT:
        values, ids = logits.topk(widest, dim=-1)
    else:
        values, ids = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(values.shape[-1])
    removed = ranks.unsqueeze(0) >= torch.tensor(top_k).unsqueeze(1)
    values = values.masked_fill(removed, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32).unsqueeze(1)
    probs = torch.softmax(values, dim=-1)
    # Drop a token once the better tokens before it already hold top_p of the mass.
    removed |= (probs.cumsum(dim=-1) - probs) >= top_p
    kept = values.masked_fill(removed, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, ids, kept)
