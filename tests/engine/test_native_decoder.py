"""The decode step in one native call (`engine.models.native_decoder`) against the PyTorch
path it replaces: the same hidden states and the same cache writes, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import native
from engine.config import EngineConfig
from engine.layers.paged_attention import AttentionMetadata
from engine.llm_engine import LLMEngine
from engine.model_dirs.tiny import init_tiny_model
from engine.model_runner import ModelRunner
from engine.models.native_decoder import NativeDecoder, native_decoder
from engine.sampling import SamplingParams
from tests.engine.helpers import run_all, tokens_of

pytestmark = pytest.mark.skipif(
    native.kernels() is None, reason="the native kernels did not build here"
)


class BothWays:
    """Stands in for the runner's native decoder: computes each step through the model's
    PyTorch path too, on the same cache, and checks that the two agree."""

    def __init__(self, runner: ModelRunner) -> None:
        assert runner.native_decoder is not None
        self.runner = runner
        self.native: NativeDecoder = runner.native_decoder
        self.steps = 0
        self.rows = 0

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        caches = self.runner.kv_caches
        before = [cache.clone() for cache in caches]
        expected = self.runner.model(input_ids, positions, caches, meta)
        written = [cache.clone() for cache in caches]
        for cache, saved in zip(caches, before, strict=True):
            cache.copy_(saved)
        hidden = self.native(input_ids, positions, meta)
        assert torch.equal(hidden, expected)
        for cache, wanted in zip(caches, written, strict=True):
            assert torch.equal(cache, wanted)
        self.steps += 1
        self.rows += input_ids.shape[0]
        return hidden


def _engine(model_dir: Path, **settings: object) -> LLMEngine:
    config = EngineConfig(num_kv_blocks=64, block_size=4, max_num_batched_tokens=64, **settings)  # type: ignore[arg-type]
    return LLMEngine.from_model_dir(model_dir, config)


@pytest.mark.parametrize(
    ("model", "settings"),
    [
        pytest.param({}, {}, id="fp32"),
        pytest.param({}, {"quantization": "int8"}, id="int8"),
        pytest.param({}, {"kv_dtype": "bfloat16"}, id="bf16-cache"),
        # 48 inputs: int8 panels widened in registers, not the integer ones; with biases.
        pytest.param(
            {"hidden": 48, "architecture": "qwen2"}, {"quantization": "int8"}, id="int8-widened"
        ),
    ],
)
def test_a_decode_step_matches_the_pytorch_path(
    tmp_path: Path, model: dict[str, object], settings: dict[str, object]
) -> None:
    engine = _engine(init_tiny_model(tmp_path, **model), **settings)  # type: ignore[arg-type]
    both = BothWays(engine.runner)
    engine.runner.native_decoder = both  # type: ignore[assignment]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    # Different lengths: contexts of several blocks, padded block tables, rows that finish.
    for i, length in enumerate((3, 9, 17)):
        engine.add_request(f"r{i}", list(range(5, 5 + length)), params)
    outputs = run_all(engine)
    assert all(len(tokens_of(outputs[f"r{i}"])) == 12 for i in range(3))
    assert both.steps >= 10 and both.rows > both.steps


@pytest.mark.parametrize("budget", [64, 2], ids=["whole-prompts", "one-token-prompt-chunks"])
def test_decode_steps_take_the_native_call_and_generate_the_same_tokens(
    make_engine: object, budget: int
) -> None:
    """With a budget of 2 tokens a step can hold one sequence's decode and one token of
    another's prompt: both one-token chunks, so the native call takes the step, and only
    the decode's row samples."""
    native_run = make_engine(max_num_batched_tokens=budget)  # type: ignore[operator]
    pytorch_run = make_engine(max_num_batched_tokens=budget)  # type: ignore[operator]
    runner = native_run.runner
    assert runner.native_decoder is not None
    pytorch_run.runner.native_decoder = None
    decoder, execute = runner.native_decoder, runner.execute
    rows: list[int] = []
    partial_steps = []

    def counted(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        rows.append(input_ids.shape[0])
        return decoder(input_ids, *args)

    def watched(*args: object) -> object:
        calls = len(rows)
        executed = execute(*args)
        if len(rows) > calls and len(executed.sampled) < rows[-1]:
            partial_steps.append(rows[-1])
        return executed

    runner.native_decoder = counted
    runner.execute = watched
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    results = []
    for engine in (native_run, pytorch_run):
        for i, prompt in enumerate(([5, 6, 7], [8, 9, 10, 11, 12])):
            engine.add_request(f"r{i}", prompt, params)
        results.append({rid: tokens_of(out) for rid, out in run_all(engine).items()})
    assert results[0] == results[1]
    assert len(rows) >= 15
    assert bool(partial_steps) == (budget == 2)


def test_a_model_with_unpacked_layers_keeps_the_pytorch_path(make_engine: object) -> None:
    engine = make_engine()  # type: ignore[operator]
    model = engine.runner.model
    layer = model.model.layers[0].mlp
    layer.down_proj = torch.nn.Identity()  # a module the kernel does not read
    assert native_decoder(model, engine.runner.kv_caches) is None


def test_a_step_with_a_slot_outside_the_cache_is_refused(make_engine: object) -> None:
    engine = make_engine()  # type: ignore[operator]
    decoder = engine.runner.native_decoder
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    seen: list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]] = []

    def keep(*args: object) -> torch.Tensor:
        seen.append(args)  # type: ignore[arg-type]
        return decoder(*args)

    engine.runner.native_decoder = keep
    run_all(engine)
    input_ids, positions, meta = seen[0]
    slots = engine.runner.kv_caches[0].shape[2]
    broken = AttentionMetadata(
        slot_mapping=torch.full_like(meta.slot_mapping, slots),
        decode_batch=meta.decode_batch,
        decode_groups=(),
        prefills=(),
        workspace=meta.workspace,
    )
    with pytest.raises(ValueError, match="outside the cache"):
        decoder(input_ids, positions, broken)
