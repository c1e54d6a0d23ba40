"""The real model, fetched as `tollgate models fetch` fetches it, against `transformers`
on the same converted directory: logits, greedy tokens and the chat template."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.loader import load_model, load_model_config, load_tokenizer  # noqa: E402
from engine.model_dirs.fetch import FetchError, resolve_model  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from tests.engine.helpers import paged_logits  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "How are you?"},
    ],
]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    try:
        return resolve_model(MODEL)[1]
    except FetchError as exc:
        pytest.skip(f"cannot fetch {MODEL}: {exc}")


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):  # type: ignore[no-untyped-def]
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def test_logits_match_transformers(model_dir: Path, hf_model) -> None:  # type: ignore[no-untyped-def]
    config = load_model_config(model_dir)
    tokenizer = load_tokenizer(model_dir, config)
    ids = tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    ours = paged_logits(load_model(model_dir, config, 16, torch.float32), ids, [len(ids)], 16)
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    assert torch.allclose(ours, expected, atol=1e-3, rtol=0), (ours - expected).abs().max()


def test_greedy_answer_matches_transformers(model_dir: Path, hf_model) -> None:  # type: ignore[no-untyped-def]
    engine = LLMEngine.from_model_dir(model_dir, EngineConfig(num_kv_blocks=64, block_size=16))
    prompt = engine.tokenizer.encode_chat(CONVERSATIONS[0])
    [result] = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0))
    with torch.no_grad():
        generated = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=24,
            do_sample=False,
        )
    expected = generated[0, len(prompt) :].tolist()
    assert list(result.token_ids) == expected[: len(result.token_ids)]
    assert "Paris" in engine.tokenizer.decode(list(result.token_ids))


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(
    model_dir: Path, messages: list[dict[str, str]]
) -> None:
    ours = load_tokenizer(model_dir, load_model_config(model_dir))
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == expected
    assert ours.encode_chat(messages) == theirs.encode(expected, add_special_tokens=False)


def test_an_adapters_logits_match_peft(model_dir: Path, tmp_path: Path) -> None:
    """A random adapter on every projection, in a batch beside a base-model request; peft
    wraps a model of its own (it changes the model it is given)."""
    peft = pytest.importorskip("peft")
    from engine.adapters import load_adapter
    from engine.layers.lora import attach_adapters
    from engine.model_dirs.adapter_init import init_adapter
    from tests.engine.test_adapters import _batch_logits

    adapter_dir = init_adapter(tmp_path / "adapter", model_dir, rank=8, seed=1)
    config = load_model_config(model_dir)
    tokenizer = load_tokenizer(model_dir, config)
    ids = tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    model = load_model(model_dir, config, 16, torch.float32)
    batch = attach_adapters(model, [load_adapter("a", adapter_dir, model)])
    ours, base = _batch_logits(model, batch, [(ids, 1), (ids, 0)])
    fresh = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    tuned = peft.PeftModel.from_pretrained(fresh, str(adapter_dir)).eval()
    with torch.no_grad():
        expected = tuned(torch.tensor([ids])).logits[0]
        with tuned.disable_adapter():
            expected_base = tuned(torch.tensor([ids])).logits[0]
    assert torch.allclose(ours, expected, atol=1e-3, rtol=0), (ours - expected).abs().max()
    assert torch.allclose(base, expected_base, atol=1e-3, rtol=0)
    assert (expected - expected_base).abs().max() > 0.1
