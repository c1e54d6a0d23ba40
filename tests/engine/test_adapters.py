"""LoRA adapters: our per-request LoRA against `peft` on the same base and adapter, a
mixed batch of base and adapter rows, merged weights, and prefix-cache isolation."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from engine.adapters import load_adapter, merge_adapter  # noqa: E402
from engine.batch_inputs import build_inputs  # noqa: E402
from engine.batcher import ScheduledChunk, StepPlan  # noqa: E402
from engine.block_manager import BlockManager  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.errors import ModelLoadError, RequestError, UnsupportedModelError  # noqa: E402
from engine.layers.lora import attach_adapters  # noqa: E402
from engine.layers.quantized import quantize_int8  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader import load_model, load_model_config  # noqa: E402
from engine.model_dirs.adapter_init import init_adapter  # noqa: E402
from engine.model_dirs.tiny import init_tiny_model  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.models.llama import LlamaForCausalLM  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from engine.sequence import Sequence as Seq  # noqa: E402
from tests.engine.helpers import paged_logits, run_all, tokens_of  # noqa: E402

ATOL = 1e-4
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapter_dirs(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "every-module": init_adapter(root / "every-module", tiny_dir, rank=4, seed=1),
        "attention-qv": init_adapter(
            root / "attention-qv",
            tiny_dir,
            rank=8,
            alpha=4,
            seed=2,
            target_modules=("q_proj", "v_proj"),
        ),
    }


def _hf(model_dir: Path) -> Any:
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _peft_logits(model_dir: Path, adapter_dir: Path, ids: list[int]) -> torch.Tensor:
    model = peft.PeftModel.from_pretrained(_hf(model_dir), str(adapter_dir)).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (length,), generator=gen).tolist()


def _batch_logits(
    model: LlamaForCausalLM, batch: Any, prompts: Sequence[tuple[list[int], int]]
) -> list[torch.Tensor]:
    """Every prompt's logits [len, V] from ONE step that prefills them all together; each
    prompt is (token ids, adapter slot)."""
    block_size = 4
    num_blocks = sum(-(-len(ids) // block_size) for ids, _ in prompts) + 2
    runner = ModelRunner(model, block_size, num_blocks, torch.float32, lora=batch)
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    chunks = []
    for i, (ids, slot) in enumerate(prompts):
        seq = Seq(f"p{i}", ids, SamplingParams(), adapter_slot=slot)
        manager.allocate(seq, len(ids))
        chunks.append(ScheduledChunk(seq, 0, len(ids)))
    inputs = build_inputs(StepPlan(tuple(chunks)), runner.shape, runner.workspace)
    batch.set_step(inputs.adapter_slots, None)
    with torch.inference_mode():
        hidden = model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.attention)
        logits = model.compute_logits(hidden)
    return list(logits.split([len(ids) for ids, _ in prompts]))


def test_mixed_batch_matches_peft_per_row(tiny_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    config = load_model_config(tiny_dir)
    model = load_model(tiny_dir, config, 4, torch.float32)
    adapters = [load_adapter(name, path, model) for name, path in adapter_dirs.items()]
    batch = attach_adapters(model, adapters)
    prompts = [(_prompt(23, 1), 1), (_prompt(17, 2), 0), (_prompt(30, 3), 2), (_prompt(9, 4), 1)]
    got = _batch_logits(model, batch, prompts)
    with torch.no_grad():
        base = _hf(tiny_dir)
        expected_base = base(torch.tensor([prompts[1][0]])).logits[0]
    assert torch.allclose(got[1], expected_base, atol=ATOL, rtol=0)
    dirs = list(adapter_dirs.values())
    for (ids, slot), logits in zip(prompts, got, strict=True):
        if slot == 0:
            continue
        expected = _peft_logits(tiny_dir, dirs[slot - 1], ids)
        assert torch.allclose(logits, expected, atol=ATOL, rtol=0), (logits - expected).abs().max()
        assert not torch.allclose(logits, base(torch.tensor([ids])).logits[0], atol=1e-2)


def test_merged_weights_match_peft(tiny_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    config = load_model_config(tiny_dir)
    model = load_model(tiny_dir, config, 4, torch.float32)
    merge_adapter(model, load_adapter("a", adapter_dirs["every-module"], model))
    ids = _prompt(40, 5)
    got = paged_logits(model, ids, [25, 1, 1, 13])
    expected = _peft_logits(tiny_dir, adapter_dirs["every-module"], ids)
    assert torch.allclose(got, expected, atol=ATOL, rtol=0)


def _engine(tiny_dir: Path, adapter_dirs: dict[str, Path], **overrides: Any) -> LLMEngine:
    settings: dict[str, Any] = {"num_kv_blocks": 256, "block_size": 4, "max_num_batched_tokens": 64}
    settings.update(overrides)
    adapters = tuple((name, str(path)) for name, path in adapter_dirs.items())
    return LLMEngine.from_model_dir(tiny_dir, EngineConfig(adapters=adapters, **settings))


def _greedy(engine: LLMEngine, requests: dict[str, tuple[list[int], str]]) -> dict[str, Any]:
    for request_id, (ids, adapter) in requests.items():
        engine.add_request(request_id, ids, GREEDY, adapter=adapter)
    outputs = run_all(engine)
    return {
        rid: (tokens_of(outs), outs[-1].metrics.num_cached_prompt_tokens)
        for rid, outs in outputs.items()
    }


def test_base_requests_are_unaffected_by_adapters_beside_them(
    tiny_dir: Path, adapter_dirs: dict[str, Path], make_engine: Any
) -> None:
    prompt = _prompt(21, 6)
    [alone] = make_engine().generate([prompt], GREEDY)
    with_adapters = _engine(tiny_dir, adapter_dirs)
    # The one-call decode step does not see adapters' rows: such a model keeps PyTorch's path.
    assert with_adapters.runner.native_decoder is None
    results = _greedy(
        with_adapters,
        {"base": (prompt, ""), "a": (prompt, "every-module"), "b": (prompt, "attention-qv")},
    )
    assert results["base"][0] == list(alone.token_ids)
    assert results["a"][0] != results["base"][0]


def test_adapter_request_matches_merged_model(
    tiny_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    """Greedy tokens of an adapter in a mixed batch equal those of its merged model."""
    prompt = _prompt(19, 7)
    config = EngineConfig(num_kv_blocks=64, block_size=4)
    model = load_model(tiny_dir, load_model_config(tiny_dir), 4, torch.float32)
    merge_adapter(model, load_adapter("a", adapter_dirs["every-module"], model))
    merged = LLMEngine(model, LLMEngine.from_model_dir(tiny_dir, config).tokenizer, config)
    [expected] = merged.generate([prompt], GREEDY)
    results = _greedy(
        _engine(tiny_dir, adapter_dirs),
        {
            "a": (prompt, "every-module"),
            "base": (_prompt(11, 8), ""),
            "b": (prompt, "attention-qv"),
        },
    )
    assert results["a"][0] == list(expected.token_ids)


def test_an_adapter_on_an_int8_base_stays_close_to_peft(
    tiny_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    """The int8 base layer plus the adapter in full precision (as QLoRA applies one)."""
    model = load_model(tiny_dir, load_model_config(tiny_dir), 4, torch.float32)
    adapter = load_adapter("a", adapter_dirs["every-module"], model)
    assert quantize_int8(model) > 0
    batch = attach_adapters(model, [adapter])
    ids = _prompt(30, 10)
    [got, _] = _batch_logits(model, batch, [(ids, 1), (_prompt(8, 11), 0)])
    expected = _peft_logits(tiny_dir, adapter_dirs["every-module"], ids)
    assert (got - expected).abs().max() < 0.3


def test_prefix_cache_is_shared_within_an_adapter_only(
    tiny_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    engine = _engine(tiny_dir, adapter_dirs)
    prompt = _prompt(24, 9)
    assert _greedy(engine, {"first": (prompt, "every-module")})["first"][1] == 0
    again = _greedy(
        engine,
        {"same": (prompt, "every-module")},
    )
    assert again["same"][1] == 20  # every full block of the prompt but the last token's
    others = _greedy(engine, {"other": (prompt, "attention-qv"), "base": (prompt, "")})
    assert others["other"][1] == 0
    assert others["base"][1] == 0


def test_unknown_adapter_is_refused(tiny_dir: Path, adapter_dirs: dict[str, Path]) -> None:
    engine = _engine(tiny_dir, adapter_dirs)
    with pytest.raises(RequestError, match="adapter 'nope' is not loaded"):
        engine.add_request("r", [5, 6, 7], GREEDY, adapter="nope")


def test_an_adapter_of_another_base_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    other_base = init_tiny_model(tmp_path / "wide", hidden=96, heads=4, kv_heads=2)
    adapter = init_adapter(tmp_path / "wide-adapter", other_base, rank=2)
    with pytest.raises(ModelLoadError, match="not this base model"):
        _engine(tiny_dir, {"wide": adapter})


def test_unsupported_adapter_options_are_refused(
    tiny_dir: Path, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    adapter = init_adapter(tmp_path / "dora", tiny_dir, rank=2)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(UnsupportedModelError, match="use_dora"):
        _engine(tiny_dir, {"dora": adapter})
