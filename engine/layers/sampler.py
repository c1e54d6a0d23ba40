"""Turning logits into next tokens: penalties and biases, grammar masks, logprobs, greedy,
temperature, top-k, top-p, min-p, per-request generators."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.sampling import SamplingParams

# Beyond this k a full sort is as cheap as topk.
_MAX_TOPK_SHORTCUT = 1024


# A row's tokens so far: all of them (prompt, then output) and how many are the prompt's.
History = tuple[Sequence[int], int]


@dataclass(frozen=True, slots=True)
class Samples:
    """The sampler's answer for N rows: a token each, and its TokenLogprob for the rows
    whose request asked for logprobs (None for the others)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    histories: Sequence[History] = (),
    masks: Sequence[torch.Tensor | None] = (),
) -> Samples:
    """logits: [N, V] -> N token ids. Row i draws only from `generators[i]`, so a seeded
    request gets the same tokens whatever else is in the batch. `histories` (one per row)
    are needed only by rows with penalties; `masks` (one per row, or none at all) are
    grammar bitmasks, [ceil(V / 32)] int32 with bit t % 32 of word t // 32 set where
    token t is allowed, None for a row without a grammar.

    Per row: penalties and biases, the mask, logprobs, then temperature and the filters."""
    logits = logits.float()
    if any(p.penalized for p in params):
        logits = penalized(logits, params, histories)
    if any(m is not None for m in masks):
        logits = masked(logits, masks)
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    log_probs = torch.log_softmax(logits[asking], dim=-1) if asking else None
    tokens = _draw(logits, params, generators)
    logprobs: list[TokenLogprob | None] = [None] * len(tokens)
    if log_probs is not None:
        for i, entry in zip(asking, token_logprobs(log_probs, asking, params, tokens), strict=True):
            logprobs[i] = entry
    return Samples(tokens, logprobs)


def _draw(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> list[int]:
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


def masked(logits: torch.Tensor, masks: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """The logits with each masked row's disallowed tokens at -inf (masks as in `sample`),
    all masked rows at once."""
    rows = [i for i, m in enumerate(masks) if m is not None]
    bitmask = torch.stack([m for m in masks if m is not None])  # [n, W] int32
    shifts = torch.arange(32, dtype=torch.int32)
    # [n, W, 32] -> [n, W * 32]: bit b of word w is token 32 * w + b.
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = torch.ones(logits.shape, dtype=torch.bool)
    allowed[rows] = bits.flatten(1)[:, : logits.shape[-1]].bool()
    # One pass over all rows: cheaper than gathering the masked ones and scattering back.
    return torch.where(allowed, logits, float("-inf"))


def token_logprobs(
    log_probs: torch.Tensor,
    rows: Sequence[int],
    params: Sequence[SamplingParams],
    tokens: Sequence[int],
) -> list[TokenLogprob]:
    """log_probs: [n, V], the distribution of each of `rows` -> each row's TokenLogprob
    for its sampled token, with its request's k likeliest alternatives (one topk for all)."""
    sampled = torch.tensor([tokens[i] for i in rows]).unsqueeze(1)
    chosen = log_probs.gather(1, sampled).squeeze(1).tolist()
    widest = min(max(params[i].logprobs or 0 for i in rows), log_probs.shape[-1])
    values, ids = log_probs.topk(widest, dim=-1)
    top_values, top_ids = values.tolist(), ids.tolist()
    entries = []
    for j, i in enumerate(rows):
        k = params[i].logprobs or 0
        top = tuple(
            (t, v)
            for t, v in zip(top_ids[j][:k], top_values[j][:k], strict=True)
            if v != float("-inf")  # a token the grammar forbids
        )
        entries.append(TokenLogprob(tokens[i], chosen[j], top))
    return entries


def penalized(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[History]
) -> torch.Tensor:
    """The logits with each penalized row's penalties and biases applied (SamplingParams),
    all rows at once: one scatter builds the output counts, one the tokens seen."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    vocab = logits.shape[-1]
    chosen = [params[i] for i in rows]
    out_rows, out_ids, seen_rows, seen_ids = [], [], [], []
    for j, i in enumerate(rows):
        tokens, num_prompt = histories[i]
        output = tokens[num_prompt:]
        out_rows.append(torch.full((len(output),), j, dtype=torch.long))
        out_ids.append(torch.as_tensor(output, dtype=torch.long))
        if chosen[j].repetition_penalty != 1.0:
            seen_rows.append(torch.full((len(tokens),), j, dtype=torch.long))
            seen_ids.append(torch.as_tensor(tokens, dtype=torch.long))
    sub = logits[rows]
    counts = torch.zeros_like(sub)
    counts.index_put_(
        (torch.cat(out_rows), torch.cat(out_ids)),
        torch.ones(sum(map(len, out_ids))),
        accumulate=True,
    )
    frequency = torch.tensor([p.frequency_penalty for p in chosen]).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in chosen]).unsqueeze(1)
    sub = sub - frequency * counts - presence * (counts > 0)
    if seen_rows:
        seen = torch.zeros(sub.shape, dtype=torch.bool)
        seen[torch.cat(seen_rows), torch.cat(seen_ids)] = True
        penalty = torch.tensor([p.repetition_penalty for p in chosen]).unsqueeze(1)
        sub = torch.where(seen, torch.where(sub > 0, sub / penalty, sub * penalty), sub)
    biased = [
        (j, token, bias)
        for j, p in enumerate(chosen)
        for token, bias in p.logit_bias
        if 0 <= token < vocab
    ]
    if biased:
        bias_rows, bias_ids, values = zip(*biased, strict=True)
        sub.index_put_(
            (torch.tensor(bias_rows), torch.tensor(bias_ids)), torch.tensor(values), accumulate=True
        )
    logits = logits.clone()
    logits[rows] = sub
    return logits


def _filter(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits: [n, V] with tokens outside each row's top-k / top-p / min-p set to -inf."""
    vocab = logits.shape[-1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if all(k == vocab for k in top_k) and all(p.top_p >= 1 and p.min_p <= 0 for p in params):
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
    # Less likely than min_p times the likeliest token (values are sorted: it is the first).
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32).unsqueeze(1)
    removed |= values < values[:, :1] + torch.log(min_p)
    kept = values.masked_fill(removed, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, ids, kept)
