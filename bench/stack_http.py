"""`bench.stack --front http`: the same stack driven through its HTTP front door and
through gRPC, in one run: throughput at the workload's concurrency, and TTFT at one
stream; the fronts take turns, round by round and request by request, so that drift of
the machine falls on both.

The HTTP client is a bare asyncio one (a socket, chunked transfer decoding, SSE
framing), so what it measures is the server's cost rather than a client library's.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from bench.cpu import CpuWindow
from bench.report import percentile, progress
from bench.stack_sides import (
    MODEL_NAME,
    RequestTiming,
    SideResult,
    StackWorkload,
    stack_request,
    warm_up,
)
from tollgate import AsyncClient

THROUGHPUT_TARGET = 0.95
ADDED_TTFT_P50_TARGET_MS = 2.0
TTFT_TOKENS = 4


async def sse_post(
    url: str, path: str, body: dict[str, Any], api_key: str = ""
) -> AsyncIterator[str]:
    """The `data:` payloads of the server-sent events a POST answers with (a chunked
    body: the stack's HTTP API, llama-server's `/completion`)."""
    address = urlsplit(url)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    payload = json.dumps(body).encode()
    authorization = f"authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {address.netloc}\r\ncontent-type: application/json\r\n"
        f"{authorization}content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
    )
    writer.write(head.encode() + payload)
    try:
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP {status.decode().strip()}: {await reader.read()!r}")
        while (await reader.readline()).strip():
            pass  # the headers: the body is chunked
        buffer = b""
        async for chunk in _chunks(reader):
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data: "):
                        yield line[6:].decode()
    finally:
        writer.close()


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        size = int((await reader.readline()).strip(), 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # the chunk's CRLF


def completion_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    """A streamed, greedy `/v1/completions` body of exactly `max_tokens` (EOS ignored),
    its usage in the last chunk."""
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def http_request(url: str, api_key: str, prompt: str, max_tokens: int) -> RequestTiming:
    timing = RequestTiming(time.perf_counter())
    body = completion_body(prompt, max_tokens)
    async for data in sse_post(url, "/v1/completions", body, api_key):
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"run failed: {chunk['error']}")
        if chunk["choices"] and not timing.first_token:
            timing.first_token = time.perf_counter()
        if chunk.get("usage"):
            timing.finished = time.perf_counter()
            timing.num_tokens = chunk["usage"]["completion_tokens"]
    if not timing.finished:
        raise RuntimeError("the stream ended before its usage chunk")
    return timing


async def run_fronts(
    gateway: str, url: str, api_key: str, work: StackWorkload, ttft_prompts: list[str]
) -> tuple[SideResult, SideResult, list[float], list[float]]:
    """Both fronts' workload results, then each front's TTFTs at one stream (ms)."""
    async with AsyncClient(gateway, api_key) as client:
        await warm_up(client, work.prompts[0][:24])
        rounds: dict[str, list[list[RequestTiming]]] = {"grpc": [], "http": []}
        progress(
            f"{len(work.waves())} rounds of {work.concurrency} streams, the fronts alternating"
        )
        with CpuWindow() as cpu:
            for i, wave in enumerate(work.waves()):
                if i % 2 == 0:
                    requests = [stack_request(client, work.prompts[j], work.max_tokens) for j in wave]  # fmt: skip
                else:
                    requests = [http_request(url, api_key, work.prompts[j], work.max_tokens) for j in wave]  # fmt: skip
                rounds["http" if i % 2 else "grpc"].append(list(await asyncio.gather(*requests)))
        sides = [SideResult(name, waves, cpu) for name, waves in rounds.items()]
        progress(f"TTFT at one stream: {len(ttft_prompts)} requests, the fronts alternating")
        grpc_ttft, http_ttft = [], []
        for i, prompt in enumerate(ttft_prompts):
            if i % 2 == 0:
                grpc_ttft.append((await stack_request(client, prompt, TTFT_TOKENS)).ttft_ms)
            else:
                http_ttft.append((await http_request(url, api_key, prompt, TTFT_TOKENS)).ttft_ms)
    return sides[0], sides[1], grpc_ttft, http_ttft


def report_fronts(
    work: StackWorkload,
    grpc: SideResult,
    http: SideResult,
    grpc_ttft: list[float],
    http_ttft: list[float],
) -> dict[str, Any]:
    print(
        f"{'front':<8}{'tokens':>8}{'seconds':>9}{'tok/s':>9}{'ttft@1 p50':>12}{'ttft@1 p99':>12}"
    )
    for side, ttft in ((grpc, grpc_ttft), (http, http_ttft)):
        print(
            f"{side.name:<8}{side.output_tokens:>8}{side.seconds:>9.2f}"
            f"{side.tokens_per_second:>9.1f}{percentile(ttft, 50):>12.2f}{percentile(ttft, 99):>12.2f}"
        )
    ratio = http.tokens_per_second / grpc.tokens_per_second
    added = percentile(http_ttft, 50) - percentile(grpc_ttft, 50)
    print(
        f"http/grpc throughput {ratio:.3f} (target >= {THROUGHPUT_TARGET}); added TTFT p50 at"
        f" one stream {added:.2f} ms (target <= {ADDED_TTFT_P50_TARGET_MS:.0f})"
    )
    print(f"CPU seconds, both fronts' rounds: {grpc.cpu.describe()}")
    return {
        "front": "http",
        "concurrency": work.concurrency,
        "rounds_per_front": len(grpc.rounds),
        "max_tokens": work.max_tokens,
        "grpc_tokens_per_s": round(grpc.tokens_per_second, 1),
        "http_tokens_per_s": round(http.tokens_per_second, 1),
        "throughput_ratio": round(ratio, 3),
        "ttft_samples_per_front": len(grpc_ttft),
        "grpc_ttft_p50_ms": round(percentile(grpc_ttft, 50), 2),
        "http_ttft_p50_ms": round(percentile(http_ttft, 50), 2),
        "added_ttft_p50_ms": round(added, 2),
        "cpu_s": grpc.cpu.rounded(),
        "meets_throughput_target": ratio >= THROUGHPUT_TARGET,
        "meets_ttft_target": added <= ADDED_TTFT_P50_TARGET_MS,
    }
