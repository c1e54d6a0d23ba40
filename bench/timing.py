"""Latency and throughput figures from per-token timestamps, and the machine's matmul peak."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from bench.report import percentile
from engine.layers.linear import Linear
from engine.layers.quantized import DequantBuffer, Int8Linear


@dataclass(slots=True)
class TokenTimes:
    """When each output token of each request appeared; every request arrived at `start`.

    `decode_*` cover the steps in which every scheduled sequence decoded one token.
    """

    start: float
    times: list[list[float]]
    end: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    decode_flops: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)

    def summary(self, num_output_tokens: int) -> dict[str, float]:
        ttfts = [t[0] - self.start for t in self.times if t]
        itls = [b - a for t in self.times for a, b in zip(t, t[1:], strict=False)]
        seconds = self.end - self.start
        return {
            "seconds": round(seconds, 2),
            "output_tokens_per_s": round(num_output_tokens / seconds, 1),
            "ttft_p50_s": round(percentile(ttfts, 50), 3),
            "ttft_p99_s": round(percentile(ttfts, 99), 3),
            "itl_p50_ms": round(1e3 * percentile(itls, 50), 1),
            "itl_p99_ms": round(1e3 * percentile(itls, 99), 1),
            **self.extra,
        }


def int8_peak_ops(size: int = 2048, rows: int = 512, repeats: int = 5) -> float:
    """Best integer multiply-add rate (2 ops each) of the engine's int8 linear layer on
    `rows` rows of a `size` x `size` weight, with the current thread count: its kernel at
    a batch large enough to be bound by arithmetic, not by reading the weight."""
    torch.manual_seed(0)
    layer = Int8Linear(Linear(size, size), DequantBuffer(torch.float32))
    x = torch.randn(rows, size)
    with torch.inference_mode():
        layer(x)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            layer(x)
            best = min(best, time.perf_counter() - start)
    return 2.0 * rows * size * size / best


def matmul_peak_flops(size: int = 2048, repeats: int = 5) -> float:
    """Best fp32 FLOP/s of a square matmul with the current thread count."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best
