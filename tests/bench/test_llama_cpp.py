"""The GGUF files bench.engine's llama.cpp baseline runs, written from the shipped one.

llama.cpp itself is a bench extra (never installed for the tests); what is checked here
is that the F32 and Q8_0 files hold the shipped file's model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from bench.llama_cpp import F32, Q8_0, variants
from engine.model_dirs.tiny import init_tiny_model
from tests.engine.gguf_files import write_gguf


def _weights(path: Path) -> dict[str, tuple[GGMLQuantizationType, np.ndarray]]:
    return {
        t.name: (t.tensor_type, dequantize(t.data, t.tensor_type).astype(np.float32))
        for t in GGUFReader(path).tensors
    }


def _fields(path: Path) -> dict[str, object]:
    skipped = ("general.file_type",)
    return {
        name: field.contents()
        for name, field in GGUFReader(path).fields.items()
        if not name.startswith("GGUF.") and name not in skipped
    }


def test_f32_and_q8_0_files_hold_the_shipped_model(tmp_path: Path) -> None:
    model_dir = init_tiny_model(tmp_path / "model")
    shipped = write_gguf(model_dir, tmp_path / "tiny.shipped.gguf", quantized=True)
    files = variants(shipped)
    assert files[F32] == tmp_path / "tiny.F32.gguf"
    assert files[Q8_0] == tmp_path / "tiny.Q8_0.gguf"
    source = _weights(shipped)
    f32, q8 = _weights(files[F32]), _weights(files[Q8_0])
    assert source.keys() == f32.keys() == q8.keys()
    for name, (_, values) in source.items():
        assert f32[name][0] == GGMLQuantizationType.F32
        np.testing.assert_array_equal(f32[name][1], values)  # the very weights, widened
        kind, requantized = q8[name]
        if values.ndim == 2 and values.shape[-1] % 32 == 0:
            assert kind == GGMLQuantizationType.Q8_0
            # Half a step of each block's scale at most.
            step = np.abs(values).reshape(-1, 32).max(axis=1) / 127
            error = np.abs(requantized - values).reshape(-1, 32).max(axis=1)
            assert (error <= step / 2 + 1e-6).all()
        else:
            assert kind == GGMLQuantizationType.F32
    assert _fields(files[F32]) == _fields(shipped) == _fields(files[Q8_0])
    assert GGUFReader(files[F32]).fields["general.file_type"].contents() == 0
    assert GGUFReader(files[Q8_0]).fields["general.file_type"].contents() == 7
    mtime = files[F32].stat().st_mtime_ns
    assert variants(shipped)[F32].stat().st_mtime_ns == mtime  # written once
