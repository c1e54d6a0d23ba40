"""Random-weight Llama / Qwen2 models in Hugging Face format, with a trained tokenizer and a
chat template: the models of the tests, the benchmarks and `tollgate models init-tiny`."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, PAD, "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
_SYLLABLES = [
    "ka",
    "to",
    "ri",
    "men",
    "sul",
    "pa",
    "dor",
    "vi",
    "le",
    "qua",
    "ths",
    "ing",
    "er",
    "on",
    "an",
    "bo",
    "ze",
    "ly",
    "gra",
    "nt",
    "sh",
    "ou",
    "ex",
    "pri",
    "ck",
    "fu",
    "wi",
    "mo",
    "ste",
    "ju",
]
_WORDS = [
    "the",
    "a",
    "gate",
    "toll",
    "token",
    "model",
    "run",
    "tenant",
    "cache",
    "block",
    "is",
    "and",
    "of",
]
_EXTRA = [
    "café",
    "naïve",
    "Ærø",
    "日本語",
    "こんにちは",
    "😀",
    "🎉",
    "Ω≈ç",
    "ß",
    "€",
    "\n",
    "  ",
    "12",
    "3.5",
]


def init_tiny_model(
    model_dir: str | Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 512,
    intermediate: int | None = None,
    seed: int = 0,
    max_position_embeddings: int = 8192,
    architecture: str = "llama",
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool = False,
    attention_bias: bool = False,
    num_shards: int = 1,
    model_vocab: int | None = None,
) -> Path:
    """Write config, random weights, a trained byte-level BPE tokenizer and a chat template.

    `architecture` is "llama" or "qwen2" (q/k/v biases). The config's vocabulary size is
    the trained tokenizer's, at most `vocab`, unless `model_vocab` sets a larger one: the
    embedding and LM head then have rows for ids the tokenizer never produces.
    """
    root = Path(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab)
    tokenizer.save(str(root / "tokenizer.json"))
    if model_vocab is not None and model_vocab < tokenizer.get_vocab_size():
        raise ValueError(
            f"model_vocab {model_vocab} is smaller than the tokenizer's {tokenizer.get_vocab_size()}"
        )
    config = _config(
        architecture,
        model_vocab or tokenizer.get_vocab_size(),
        layers,
        hidden,
        heads,
        kv_heads,
        intermediate or _round_up(hidden * 8 // 3, 16),
        max_position_embeddings,
        rope_theta,
        rope_scaling,
        tie_word_embeddings,
        attention_bias,
    )
    _write_json(root / "config.json", config)
    _write_json(root / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1})
    _write_json(
        root / "tokenizer_config.json",
        {
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "add_bos_token": True,
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": max_position_embeddings,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
        },
    )
    _write_weights(root, random_weights(config, seed), num_shards)
    return root


def train_tokenizer(vocab: int = 512) -> Tokenizer:
    """A byte-level BPE tokenizer trained on generated text; BOS is added to single inputs."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tokenizer


def random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint tensors named as in `transformers`, scaled so activations neither vanish
    nor explode and greedy decoding does not collapse onto one token."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config["head_dim"]
    q_size, kv_size = (
        config["num_attention_heads"] * head_dim,
        config["num_key_value_heads"] * head_dim,
    )
    qwen2 = config["architectures"][0] == "Qwen2ForCausalLM"
    qkv_bias, o_bias = (
        qwen2 or config.get("attention_bias", False),
        config.get("attention_bias", False),
    )

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    tensors = {"model.embed_tokens.weight": normal(config["vocab_size"], hidden, std=1.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = 1 + normal(hidden, std=0.1)
        tensors[p + "post_attention_layernorm.weight"] = 1 + normal(hidden, std=0.1)
        for name, rows, cols in (
            ("q_proj", q_size, hidden),
            ("k_proj", kv_size, hidden),
            ("v_proj", kv_size, hidden),
            ("o_proj", hidden, q_size),
        ):
            tensors[p + f"self_attn.{name}.weight"] = normal(rows, cols, std=cols**-0.5)
            if (name != "o_proj" and qkv_bias) or (name == "o_proj" and o_bias):
                tensors[p + f"self_attn.{name}.bias"] = normal(rows, std=0.1)
        for name, rows, cols in (
            ("gate_proj", inter, hidden),
            ("up_proj", inter, hidden),
            ("down_proj", hidden, inter),
        ):
            tensors[p + f"mlp.{name}.weight"] = normal(rows, cols, std=cols**-0.5)
    tensors["model.norm.weight"] = 1 + normal(hidden, std=0.1)
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = normal(config["vocab_size"], hidden, std=2.0 * hidden**-0.5)
    return tensors


def _config(
    architecture: str,
    vocab: int,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    max_positions: int,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None,
    tie: bool,
    attention_bias: bool,
) -> dict[str, Any]:
    if architecture not in ("llama", "qwen2"):
        raise ValueError(f"architecture must be 'llama' or 'qwen2', not {architecture!r}")
    if hidden % heads or heads % kv_heads:
        raise ValueError("hidden must divide by heads, and heads by kv_heads")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if architecture == "llama" else "Qwen2ForCausalLM"],
        "model_type": architecture,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": tie,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    }
    if architecture == "llama":
        config.update(attention_bias=attention_bias, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
    return config


def _corpus() -> list[str]:
    rng = random.Random(1234)
    words = _WORDS + ["".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4))) for _ in range(3000)]
    lines = []
    for _ in range(4000):
        picked = rng.choices(words, k=rng.randint(4, 12))
        if rng.random() < 0.3:
            picked.insert(rng.randrange(len(picked) + 1), rng.choice(_EXTRA))
        lines.append(" ".join(picked).capitalize() + rng.choice([".", "!", "?", ","]))
    return lines


def _write_weights(root: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    names = list(tensors)
    if num_shards <= 1:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for shard in range(num_shards):
        file_name = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[shard::num_shards]}
        save_file(part, str(root / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(
        root / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
