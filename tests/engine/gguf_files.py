"""GGUF files written as llama.cpp's converter writes them, from a Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import load_file

# Hugging Face Llama name (after `model.layers.N.`) -> GGUF name (after `blk.N.`).
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter gives a query or key projection."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, _, index, rest = name.split(".", 3)
    return f"blk.{index}.{LAYER_NAMES[rest]}"


def write_gguf(model_dir: Path, path: Path, *, quantized: bool = False) -> Path:
    """`model_dir` (a Llama with a byte-level BPE tokenizer) as a GGUF file; with
    `quantized`, the 2-D weights whose rows are whole Q8_0 blocks in Q8_0."""
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    writer = GGUFWriter(str(path), "llama")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    _add_tokenizer(writer, tokenizer, config)
    for name, array in load_file(str(model_dir / "model.safetensors")).items():
        array = array.astype(np.float32)
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, heads)
        elif name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, kv_heads)
        if quantized and array.ndim == 2 and array.shape[1] % 32 == 0:  # Q8_0's block
            data = quantize(array, GGMLQuantizationType.Q8_0)
            writer.add_tensor(
                gguf_name(name), data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType.Q8_0
            )
        else:
            writer.add_tensor(gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: GGUFWriter, tokenizer: dict, config: dict) -> None:  # type: ignore[type-arg]
    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {added["content"] for added in tokenizer.get("added_tokens", [])}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    )
