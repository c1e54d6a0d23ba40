"""llama.cpp as a baseline for bench.engine, through llama-cpp-python's low-level API.

`pip install -e '.[bench]'` builds llama-cpp-python from source with this machine's
compiler and CMake. The model is the very GGUF file `tollgate models fetch` converts
(the shipped Q4_1), and two files written from it once into the model cache: F32 (its
weights dequantized, the weights our engine runs in fp32) and Q8_0 (those quantized again
in llama.cpp's 8-bit blocks, beside our int8).

Requests are decoded as llama-server decodes them: continuous batching over `parallel`
sequences in one context, each step one `llama_decode` of every running sequence's next
token plus prompt tokens of newly started ones up to the batch size; a finished sequence's
cache is dropped and the next waiting request takes its place. Sampling is greedy (the
argmax of each row of logits) and EOS is ignored, as in the engine's runs.
"""

from __future__ import annotations

import ctypes
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import progress
from bench.timing import TokenTimes
from bench.workload import Workload

F32 = "F32"
Q8_0 = "Q8_0"
SHIPPED = "Q4_1"
# llama.cpp's file types (`general.file_type`) for the files written here.
FILE_TYPES = {F32: 0, Q8_0: 7}
BATCH_TOKENS = 512


def unavailable() -> str | None:
    """Why llama.cpp cannot be measured here, or None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as error:
        return f"llama-cpp-python is not installed ({error}); pip install -e '.[bench]'"
    return None


def write_variant(source: Path, target: Path, kind: str) -> Path:
    """`source`'s model written to `target` with every weight matrix as `kind` (F32 or
    Q8_0; a matrix whose rows are not whole Q8_0 blocks stays F32); vectors (norms) stay
    F32, as llama.cpp keeps them. Written once."""
    import gguf

    if target.is_file():
        return target
    progress(f"writing {target.name} from {source.name}")
    reader = gguf.GGUFReader(source)
    architecture = str(reader.fields["general.architecture"].contents())
    partial = target.with_name(target.name + ".partial")
    writer = gguf.GGUFWriter(partial, architecture)
    for name, value in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        sub_type = value.types[1] if value.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value.contents(), value.types[0], sub_type=sub_type)
    writer.add_file_type(FILE_TYPES[kind])
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]
        if kind == Q8_0 and weights.ndim == 2 and weights.shape[-1] % block == 0:
            blocks = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(tensor.name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(tensor.name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return partial.replace(target)


def variants(shipped: Path) -> dict[str, Path]:
    """The shipped file and the F32 and Q8_0 files written beside it."""
    stem = shipped.name.removesuffix(".gguf").rsplit(".", 1)[0]
    return {
        F32: write_variant(shipped, shipped.with_name(f"{stem}.{F32}.gguf"), F32),
        Q8_0: write_variant(shipped, shipped.with_name(f"{stem}.{Q8_0}.gguf"), Q8_0),
        SHIPPED: shipped,
    }


@dataclass
class _Slot:
    """One running sequence: its request, the tokens still to feed, how many it produced."""

    request: int
    pending: list[int]
    position: int = 0
    produced: int = 0


class LlamaCpp:
    """One llama.cpp model and context of `parallel` sequences, `threads` threads."""

    # llama.cpp's log goes nowhere; the callback lives as long as the library may call it.
    log_callback: Any = None

    def __init__(self, path: Path, *, threads: int, parallel: int, context_tokens: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        if LlamaCpp.log_callback is None:
            LlamaCpp.log_callback = llama_cpp.llama_log_callback(_ignore_log)
        llama_cpp.llama_log_set(LlamaCpp.log_callback, ctypes.c_void_p())
        model_params = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = context_tokens
        params.n_batch = BATCH_TOKENS
        params.n_ubatch = BATCH_TOKENS
        params.n_seq_max = parallel
        params.n_threads = threads
        params.n_threads_batch = threads
        params.kv_unified = True  # one cache shared by the sequences, as llama-server's
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create its context")
        self.parallel = parallel
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(vocab)
        self.batch = llama_cpp.llama_batch_init(BATCH_TOKENS, 0, parallel)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def serve(self, work: Workload) -> tuple[TokenTimes, list[list[int]]]:
        """The workload greedily, all requests arriving at once: timings and tokens."""
        lib, batch = self.lib, self.batch
        memory = lib.llama_get_memory(self.ctx)
        lib.llama_memory_clear(memory, True)
        result = TokenTimes(start=time.perf_counter(), times=[[] for _ in work.prompts])
        waiting = deque(range(len(work.prompts)))
        slots: dict[int, _Slot] = {}
        free = list(reversed(range(self.parallel)))
        tokens: list[list[int]] = [[] for _ in work.prompts]
        while waiting or slots:
            while waiting and free:
                request = waiting.popleft()
                slots[free.pop()] = _Slot(request, list(work.prompts[request]))
            batch.n_tokens = 0
            sampled: list[tuple[int, int]] = []  # (sequence, row of the batch)
            # Running sequences first (one token each), then prompt tokens in the room left.
            for seq_id, slot in sorted(slots.items(), key=lambda item: len(item[1].pending)):
                take = min(len(slot.pending), BATCH_TOKENS - batch.n_tokens)
                for i in range(take):
                    row = batch.n_tokens
                    batch.token[row] = slot.pending[i]
                    batch.pos[row] = slot.position + i
                    batch.n_seq_id[row] = 1
                    batch.seq_id[row][0] = seq_id
                    batch.logits[row] = i == len(slot.pending) - 1
                    batch.n_tokens += 1
                if take and take == len(slot.pending):
                    sampled.append((seq_id, batch.n_tokens - 1))
                del slot.pending[:take]
                slot.position += take
            if lib.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            now = time.perf_counter()
            for seq_id, row in sampled:
                logits = np.ctypeslib.as_array(
                    lib.llama_get_logits_ith(self.ctx, row), shape=(self.vocab_size,)
                )
                token = int(logits.argmax())
                slot = slots[seq_id]
                tokens[slot.request].append(token)
                result.times[slot.request].append(now)
                slot.produced += 1
                if slot.produced == work.output_lens[slot.request]:
                    lib.llama_memory_seq_rm(memory, seq_id, -1, -1)
                    del slots[seq_id]
                    free.append(seq_id)
                else:
                    slot.pending.append(token)
        result.end = time.perf_counter()
        return result, tokens


def _ignore_log(level: int, text: bytes, user_data: Any) -> None:
    return None


SINGLE_PROMPT_TOKENS = 64
SINGLE_OUTPUT_TOKENS = 128
SINGLE_RUNS = 3


def decode_rate(times: TokenTimes) -> float:
    """One request's decode tokens/s: the tokens after its first over the time they took."""
    (stamps,) = times.times
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def single_stream(prompt: list[int]) -> Workload:
    return Workload("single stream", [prompt[:SINGLE_PROMPT_TOKENS]], [SINGLE_OUTPUT_TOKENS])


def measure(
    shipped: Path, work: Workload, single: Workload, *, threads: int, parallel: int
) -> dict[str, dict[str, Any]]:
    """Per file (F32, Q8_0, the shipped Q4_1): best single-stream decode tokens/s of
    `SINGLE_RUNS`, and the workload's summary with `parallel` sequences."""
    rows: dict[str, dict[str, Any]] = {}
    longest = max(len(p) + n for p, n in zip(work.prompts, work.output_lens, strict=True))
    for kind, path in variants(shipped).items():
        progress(f"[llama.cpp {kind}] single stream")
        one = LlamaCpp(path, threads=threads, parallel=1, context_tokens=1024)
        try:
            one.serve(Workload("warm-up", [[7] * 32], [4]))
            rate = max(decode_rate(one.serve(single)[0]) for _ in range(SINGLE_RUNS))
        finally:
            one.close()
        progress(f"[llama.cpp {kind}] {len(work.prompts)} requests, {parallel} sequences")
        many = LlamaCpp(path, threads=threads, parallel=parallel, context_tokens=parallel * longest)
        try:
            times, _ = many.serve(work)
        finally:
            many.close()
        rows[kind] = {
            "single_stream_decode_tokens_per_s": round(rate, 1),
            **times.summary(work.num_output_tokens),
        }
    return rows
