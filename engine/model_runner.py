"""Runs one planned step on the model: packed inputs, paged KV cache, sampling."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from engine import huge_pages, native
from engine.batch_inputs import AttentionShape, BatchInputs, build_inputs
from engine.batcher import StepPlan
from engine.config import ModelConfig
from engine.layers.lora import LoraBatch
from engine.layers.paged_attention import Workspace
from engine.layers.sampler import sample, token_logprobs
from engine.models.llama import LlamaForCausalLM
from engine.models.native_decoder import decodes_alone, native_decoder
from engine.outputs import TokenLogprob
from engine.sequence import Sequence

# What a step gives each chunk that samples: its sequence, the new token, and the token's
# logprobs when its request asked for them.
Sampled = tuple[Sequence, int, TokenLogprob | None]
# Rows of prompt positions scored at once: bounds the [rows, vocab] logits they make.
_SCORE_ROWS = 256


@dataclass(frozen=True, slots=True)
class Executed:
    """What one step computed: the chunks' new tokens, and for each request that asked
    for prompt logprobs and had prompt positions in the step, the first position scored
    and the logprobs of the prompt tokens from the one after it on."""

    sampled: list[Sampled]
    scored: dict[str, tuple[int, list[TokenLogprob]]]


def kv_cache_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return config.kv_bytes_per_token(dtype.itemsize) * block_size


class ModelRunner:
    """Owns the model and its KV cache tensors; turns a StepPlan into sampled tokens."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        block_size: int,
        num_blocks: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
        lora: LoraBatch | None = None,
    ) -> None:
        """`dtype` is the model's; the KV cache stores `kv_dtype` (default: `dtype`).
        `lora` is told each step which rows belong to which adapter."""
        cfg = model.config
        self.model = model
        self.lora = lora
        self.shape = AttentionShape(block_size, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads)
        slots = num_blocks * block_size
        # One tensor per layer: [2 (keys, values), KVH, slots, D].
        self.kv_caches = [
            huge_pages.zeros(2, cfg.num_kv_heads, slots, cfg.head_dim, dtype=kv_dtype or dtype)
            for _ in range(cfg.num_layers)
        ]
        self.workspace = Workspace(dtype)
        kv_dtype = self.kv_caches[0].dtype
        self.decode_kernel = native.paged_decode() if native.supports(dtype, kv_dtype) else None
        self.prefill_kernel = (
            native.prefill_attention()
            if native.supports_prefill(dtype, kv_dtype, cfg.head_dim)
            else None
        )
        # Decode-only steps in one native call, where it can read the model (not with
        # adapters, whose rows it would not see).
        self.native_decoder = (
            native_decoder(model, self.kv_caches)
            if self.decode_kernel is not None and lora is None
            else None
        )

    @torch.inference_mode()
    def execute(
        self,
        plan: StepPlan,
        generators: Mapping[str, torch.Generator],
        masks: Mapping[str, torch.Tensor] | None = None,
    ) -> Executed:
        """Compute the plan's tokens; return what each chunk that samples drew. `masks`
        holds the grammar bitmask (see `sample`) of each request id that has one."""
        inputs = build_inputs(
            plan, self.shape, self.workspace, self.decode_kernel, self.prefill_kernel
        )
        meta, keep = inputs.attention, inputs.kept_indices
        if self.lora is not None:
            self.lora.set_step(inputs.adapter_slots, keep)
        if self.native_decoder is not None and decodes_alone(meta):
            hidden = self.native_decoder(inputs.input_ids, inputs.positions, meta)
            # A one-token chunk in the middle of a prompt writes its cache but samples nothing.
            if keep.shape[0] != hidden.shape[0]:
                hidden = hidden.index_select(0, keep)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta, keep=keep)
        num_sampled = len(inputs.sampled)
        scored = self._score(inputs, hidden[num_sampled:]) if inputs.scored else {}
        if not inputs.sampled:
            return Executed([], scored)
        logits = self.model.compute_logits(hidden[:num_sampled])
        params = [chunk.seq.params for chunk in inputs.sampled]
        rngs = [generators[chunk.seq.request_id] for chunk in inputs.sampled]
        histories = [(chunk.seq.token_ids, chunk.seq.num_prompt_tokens) for chunk in inputs.sampled]
        row_masks = [masks.get(chunk.seq.request_id) for chunk in inputs.sampled] if masks else []
        samples = sample(logits, params, rngs, histories, row_masks)
        sampled = zip(
            [chunk.seq for chunk in inputs.sampled],
            samples.token_ids,
            samples.logprobs,
            strict=True,
        )
        return Executed(list(sampled), scored)

    def _score(
        self, inputs: BatchInputs, hidden: torch.Tensor
    ) -> dict[str, tuple[int, list[TokenLogprob]]]:
        """The logprobs of the prompt tokens that `inputs.scored`'s rows (`hidden`) predict,
        from the model's own distribution."""
        params, targets = [], []
        for chunk, first, rows in inputs.scored:
            k = chunk.seq.params.prompt_logprobs
            params += [replace(chunk.seq.params, logprobs=k)] * rows
            targets += chunk.seq.token_ids[first + 1 : first + 1 + rows]
        entries: list[TokenLogprob] = []
        for start in range(0, len(targets), _SCORE_ROWS):
            end = min(start + _SCORE_ROWS, len(targets))
            log_probs = torch.log_softmax(self.model.compute_logits(hidden[start:end]), dim=-1)
            entries += token_logprobs(
                log_probs, range(end - start), params[start:end], targets[start:end]
            )
        scored, at = {}, 0
        for chunk, first, rows in inputs.scored:
            scored[chunk.seq.request_id] = (first, entries[at : at + rows])
            at += rows
        return scored
