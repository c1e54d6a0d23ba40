"""Test helpers that drive the model below the engine."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.batch_inputs import build_inputs
from engine.batcher import ScheduledChunk, StepPlan
from engine.block_manager import BlockManager
from engine.llm_engine import LLMEngine
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.native import DecodeKernel
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams
from engine.sequence import Sequence as Seq


def paged_logits(
    model: LlamaForCausalLM,
    token_ids: list[int],
    chunks: Sequence[int],
    block_size: int = 4,
    kv_dtype: torch.dtype = torch.float32,
    decode_kernel: DecodeKernel | None = None,
) -> torch.Tensor:
    """Logits [len(token_ids), V] computed chunk by chunk through a fresh paged KV cache;
    single-token chunks go through `decode_kernel` when given."""
    assert sum(chunks) == len(token_ids)
    num_blocks = -(-len(token_ids) // block_size) + 2
    runner = ModelRunner(model, block_size, num_blocks, torch.float32, kv_dtype)
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    seq = Seq("parity", token_ids, SamplingParams())
    logits = []
    for size in chunks:
        start = seq.num_computed_tokens
        manager.allocate(seq, size)
        inputs = build_inputs(
            StepPlan((ScheduledChunk(seq, start, size),)),
            runner.shape,
            runner.workspace,
            decode_kernel,
        )
        with torch.inference_mode():
            hidden = model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.attention)
            logits.append(model.compute_logits(hidden))
        seq.num_computed_tokens += size
    return torch.cat(logits)


def run_all(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    """Step until idle; every request's outputs in order."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def text_of(outputs: list[RequestOutput]) -> str:
    return "".join(out.text_delta for out in outputs)
