"""A GGUF file (llama.cpp's format) as a Hugging Face model directory the engine loads.

Llama-architecture files only, with a byte-level BPE (`gpt2`) tokenizer. Quantized
weights are dequantized to float32: the engine quantizes at load on its own terms
(`TOLLGATE_QUANTIZATION`). llama.cpp's converter interleaves the rows of the query and
key projections for its rotary layout; they are put back in Hugging Face's order here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import decoders, models, pre_tokenizers

from engine.errors import ModelLoadError

# GGUF tensor name (after `blk.N.`) -> Hugging Face Llama name (after `model.layers.N.`).
_LAYER_TENSORS: Mapping[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_TENSORS: Mapping[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp's token types that are not plain vocabulary.
_CONTROL, _USER_DEFINED = 3, 4
# llama.cpp's pre-tokenizer names whose digits are split one by one before the GPT-2 split.
_DIGIT_SPLITTING = frozenset({"smollm", "starcoder", "refact", "codeshell"})

Progress = Callable[[str], None]


def convert(gguf_path: Path, out_dir: Path, *, progress: Progress = lambda _: None) -> Path:
    """Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
    generation_config.json for `gguf_path` into `out_dir`; returns `out_dir`."""
    try:
        reader = GGUFReader(gguf_path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{gguf_path}: not a readable GGUF file: {exc}") from exc
    meta = _metadata(reader)
    if meta.get("general.architecture") != "llama":
        raise ModelLoadError(
            f"{gguf_path}: architecture {meta.get('general.architecture')!r} is not supported"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    config = hf_config(meta, has_output=any(t.name == "output.weight" for t in reader.tensors))
    _write_json(out_dir / "config.json", config)
    progress(f"dequantizing {len(reader.tensors)} tensors")
    save_file(_weights(reader, config), str(out_dir / "model.safetensors"))
    progress("writing the tokenizer")
    tokenizer_of(meta).save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(meta))
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]},
    )
    return out_dir


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()}


def hf_config(meta: Mapping[str, Any], *, has_output: bool) -> dict[str, Any]:
    """The Hugging Face `config.json` of a llama GGUF's metadata."""
    hidden = int(meta["llama.embedding_length"])
    num_heads = int(meta["llama.attention.head_count"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", num_heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // num_heads)),
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": not has_output,
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "torch_dtype": "float32",
    }


def _weights(reader: GGUFReader, config: Mapping[str, Any]) -> dict[str, np.ndarray]:
    weights = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        array = _dequantized(tensor)
        if name.endswith("q_proj.weight"):
            array = unpermute_rotary(array, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            array = unpermute_rotary(array, config["num_key_value_heads"])
        weights[name] = np.ascontiguousarray(array, dtype=np.float32)
    return weights


def hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_TENSORS:
        return _TOP_TENSORS[gguf_name]
    block, _, rest = gguf_name.partition(".")
    index, _, rest = rest.partition(".")
    if block != "blk" or not index.isdigit() or rest not in _LAYER_TENSORS:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")
    return f"model.layers.{index}.{_LAYER_TENSORS[rest]}"


def _dequantized(tensor: ReaderTensor) -> np.ndarray:
    # GGUF lists dimensions fastest first; PyTorch's shape is the reverse.
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if tensor.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(tensor.data, dtype=np.float32).reshape(shape)
    return dequantize(tensor.data, tensor.tensor_type).reshape(shape)


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's row order of a query or key projection: within each head it
    stores the rotary pairs' rows interleaved, Hugging Face stores each half together.
    weight: [num_heads * head_dim, hidden]"""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def tokenizer_of(meta: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """The `tokenizers` form of a GGUF's `gpt2` (byte-level BPE) vocabulary."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"GGUF tokenizer {kind!r} is not supported (only byte-level BPE)")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab={token: i for i, token in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=bool(meta.get("tokenizer.ggml.add_space_prefix", False)),
        use_regex=True,
    )
    if meta.get("tokenizer.ggml.pre") in _DIGIT_SPLITTING:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type", []))
    backend.add_special_tokens(
        [
            tokenizers.AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, types, strict=False)
            if kind in (_CONTROL, _USER_DEFINED)
        ]
    )
    return backend


def _tokenizer_config(meta: Mapping[str, Any]) -> dict[str, Any]:
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "bos_token": tokens[int(meta["tokenizer.ggml.bos_token_id"])],
        "eos_token": tokens[int(meta["tokenizer.ggml.eos_token_id"])],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if "tokenizer.ggml.padding_token_id" in meta:
        config["pad_token"] = tokens[int(meta["tokenizer.ggml.padding_token_id"])]
    if "tokenizer.ggml.unknown_token_id" in meta:
        config["unk_token"] = tokens[int(meta["tokenizer.ggml.unknown_token_id"])]
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


def _write_json(path: Path, value: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
