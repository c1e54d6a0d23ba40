from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import engine.llm_engine
from bench.report import percentile
from bench.timing import TokenTimes
from bench.workload import (
    FIRST_ORDINARY_ID,
    decode_flops,
    linear_params,
    make_workload,
    matmul_flops,
)
from engine.config import EngineConfig
from engine.layers.linear import Linear
from engine.llm_engine import LLMEngine
from engine.loader import load_model, load_model_config
from engine.model_dirs.tiny import init_tiny_model
from engine.sampling import SamplingParams


def test_a_workload_is_seeded_and_within_its_ranges() -> None:
    work = make_workload("w", 32, 1000, 7, (16, 40), (3, 9), prefix_len=20)
    assert work == make_workload("w", 32, 1000, 7, (16, 40), (3, 9), prefix_len=20)
    assert all(36 <= len(p) <= 60 for p in work.prompts)
    assert all(p[:20] == work.prompts[0][:20] for p in work.prompts)
    assert all(FIRST_ORDINARY_ID <= t < 1000 for p in work.prompts for t in p)
    assert all(3 <= n <= 9 for n in work.output_lens)


def test_linear_params_counts_every_linear_weight(tmp_path: Path) -> None:
    tiny_dir = init_tiny_model(tmp_path, model_vocab=1000)
    config = load_model_config(tiny_dir)
    model = load_model(tiny_dir, config, 4, torch.float32)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear))
    assert linear_params(config) == weights
    assert decode_flops(config, 2, 0) == 4 * weights


def test_matmul_flops_are_what_the_engine_multiplies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny_dir = init_tiny_model(tmp_path, model_vocab=1000)
    # Unpacked layers multiply through aten.mm and aten.addmm, which the counter sees.
    monkeypatch.setattr(engine.llm_engine, "pack_linear_layers", lambda model: 0)
    llm = LLMEngine.from_model_dir(tiny_dir, EngineConfig(max_num_batched_tokens=64))
    work = make_workload("w", 5, 1000, 3, (10, 90), (1, 12))
    counter = FlopCounterMode(display=False)
    with counter:
        for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
            llm.add_request(str(i), prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        while llm.has_unfinished_requests():
            llm.step()
    counts = counter.get_flop_counts()["Global"]
    multiplied = counts.get(torch.ops.aten.mm, 0) + counts.get(torch.ops.aten.addmm, 0)
    assert multiplied == matmul_flops(load_model_config(tiny_dir), work)


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([], 50) == 0.0


def test_token_times_summary() -> None:
    times = TokenTimes(start=10.0, times=[[11.0, 11.5, 12.0], [12.0, 13.0]], end=14.0)
    summary = times.summary(num_output_tokens=6)
    assert summary["output_tokens_per_s"] == 1.5
    assert summary["ttft_p50_s"] == 1.5
    assert summary["itl_p50_ms"] == 500.0
