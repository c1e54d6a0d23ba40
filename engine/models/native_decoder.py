"""A Llama model's decode-only steps in one native call (`engine/native/decode_step.c`).

`native_decoder(model, kv_caches)` describes the model's weights and caches to the kernel
once. A step whose every chunk adds one token then runs all its layers in that one call,
with the kernels the PyTorch path calls one by one from Python, in the same
order on the same values. Any other step takes the PyTorch path; so does every step of a
model the kernel cannot read: weights not packed for the native kernels, LoRA adapters
attached, a dtype other than float32.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from engine import native
from engine.layers.linear import PanelLinear
from engine.layers.paged_attention import AttentionMetadata
from engine.layers.quantized import Int8Linear
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM

# Mirrors of decode_step.c's projection kinds and structs, field for field.
FLOAT_PANELS, INT8_PANELS, INTEGER_PANELS = 0, 1, 2


class Projection(ctypes.Structure):
    """A linear layer's packed weight, as decode_step.c reads it."""

    _fields_ = [
        ("kind", ctypes.c_int64),  # FLOAT_PANELS, INT8_PANELS or INTEGER_PANELS
        ("panels", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("out_features", ctypes.c_int64),
        ("in_features", ctypes.c_int64),
    ]


class DecoderLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_attention_norm", ctypes.c_void_p),
        ("qkv", Projection),
        ("o", Projection),
        ("gate_up", Projection),
        ("down", Projection),
        ("cache", ctypes.c_void_p),
    ]


class Decoder(ctypes.Structure):
    """A whole decoder's sizes and weights, as decode_step.c reads them; `cos` and `sin`
    are set for each step (the tables grow)."""

    _fields_ = [
        *[
            (name, ctypes.c_int64)
            for name in (
                "num_layers",
                "hidden",
                "heads",
                "kv_heads",
                "head_dim",
                "intermediate",
                "block_size",
                "slots",
                "bf16",
            )
        ],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layers", ctypes.POINTER(DecoderLayer)),
        ("final_norm", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
    ]


class NativeDecoder:
    """Runs a decode-only step's layers and final norm in one call."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        decoder: Decoder,
        held: list[object],
        kernel: native.DecodeStepKernel,
    ) -> None:
        self.model = model
        self.decoder = decoder
        # The decoder points into these (tensors, its array of layers): holding them keeps
        # the pointers valid.
        self._held = held
        self._kernel = kernel
        self._num_blocks = decoder.slots // decoder.block_size

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """A step of `decodes_alone` -> the final hidden states [rows, hidden]."""
        batch = meta.decode_batch
        if batch is None or not decodes_alone(meta):
            raise ValueError("native decoder: the step is not decodes alone")
        slots, tables = meta.slot_mapping, batch.block_tables
        # The kernel writes where these point: out of range would be outside the cache.
        if int(slots.max()) >= self.decoder.slots or int(tables.max()) >= self._num_blocks:
            raise ValueError("native decoder: a slot or block lies outside the cache")
        cos, sin = self.model.rotary.tables(positions)
        self.decoder.cos, self.decoder.sin = cos.data_ptr(), sin.data_ptr()
        x = self.model.model.embed_tokens(input_ids).contiguous()
        return self._kernel(self.decoder, x, positions, slots, tables, batch.context_lens)


def decodes_alone(meta: AttentionMetadata) -> bool:
    """Whether a step is decodes alone, what `NativeDecoder` takes: one token per chunk, all
    in the decode batch."""
    return meta.decode_batch is not None and not meta.prefills


def native_decoder(model: nn.Module, kv_caches: list[torch.Tensor]) -> NativeDecoder | None:
    """The model's decode steps as one native call, or None when the kernel cannot read its
    layers (see the module's docstring) or native kernels are off."""
    kernels = native.kernels()
    if kernels is None or not isinstance(model, LlamaForCausalLM) or not kv_caches:
        return None
    held: list[object] = []
    layers = []
    for layer, cache in zip(model.model.layers, kv_caches, strict=True):
        if not isinstance(layer, LlamaDecoderLayer):
            return None
        described = _layer(layer, cache, kernels.integer_panels, held)
        if described is None:
            return None
        layers.append(described)
        attention = layer.self_attn.attn
    cfg = model.config
    final_norm = _vector(model.model.norm.weight, cfg.hidden_size, held)
    if final_norm is None:
        return None
    array = (DecoderLayer * len(layers))(*layers)
    held.append(array)
    decoder = Decoder(
        num_layers=len(layers),
        hidden=cfg.hidden_size,
        heads=cfg.num_heads,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate=cfg.intermediate_size,
        block_size=attention.block_size,
        slots=kv_caches[0].shape[2],
        bf16=int(kv_caches[0].dtype == torch.bfloat16),
        eps=cfg.rms_norm_eps,
        scale=attention.scale,
        layers=ctypes.cast(array, ctypes.POINTER(DecoderLayer)),
        final_norm=final_norm,
    )
    return NativeDecoder(model, decoder, held, kernels.decode_step)


def _layer(
    layer: LlamaDecoderLayer, cache: torch.Tensor, integer: bool, held: list[object]
) -> DecoderLayer | None:
    attention, mlp = layer.self_attn, layer.mlp
    hidden = layer.input_layernorm.weight.shape[0]
    norms = [
        _vector(norm.weight, hidden, held)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm)
    ]
    projections = [
        _projection(module, integer, held)
        for module in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    ]
    if (
        None in norms
        or None in projections
        or not native.supports(torch.float32, cache.dtype)
        or cache.dim() != 4
        or cache.shape[:2] != (2, attention.num_kv_heads)
        or cache.shape[3] != attention.head_dim
        or not cache.is_contiguous()
    ):
        return None
    held.append(cache)
    qkv, o, gate_up, down = projections
    return DecoderLayer(norms[0], norms[1], qkv, o, gate_up, down, cache.data_ptr())


def _projection(module: nn.Module, integer: bool, held: list[object]) -> Projection | None:
    """The layer's packed weight, when it is one the kernel multiplies (integer panels only
    where the CPU has integer dot products: `integer`)."""
    if isinstance(module, PanelLinear):
        kind, panels, scale, out_features = FLOAT_PANELS, module.panels, None, module.out_features
    elif isinstance(module, Int8Linear) and module.gemm is not None and module.qweight.dim() > 2:
        panels, scale, out_features = module.qweight, module.scale, module.out_features
        kind = INTEGER_PANELS if panels.dtype == torch.uint8 else INT8_PANELS
    else:
        return None
    depth = panels.shape[1] * (native.GROUP_DEPTH if kind == INTEGER_PANELS else 1)
    bias = module.bias
    pointers = [_vector(v, out_features, held) if v is not None else 0 for v in (scale, bias)]
    if None in pointers or not panels.is_contiguous() or (kind == INTEGER_PANELS and not integer):
        return None
    held.append(panels)
    return Projection(kind, panels.data_ptr(), pointers[0], pointers[1], out_features, depth)


def _vector(values: torch.Tensor, size: int, held: list[object]) -> int | None:
    """The address of float32 `values` [size], or None when they are not that."""
    if values.dtype != torch.float32 or values.shape != (size,) or not values.is_contiguous():
        return None
    held.append(values)
    return values.data_ptr()
