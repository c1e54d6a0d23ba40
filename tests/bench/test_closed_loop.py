"""bench.closed_loop keeps its streams busy until every request has run, and counts steps."""

from __future__ import annotations

from pathlib import Path

from bench.closed_loop import run
from bench.stack_anchor import MAX_TOKENS
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def test_every_request_runs_and_each_step_is_counted_once(tiny_model_dir: Path) -> None:
    engine = LLMEngine.from_model_dir(tiny_model_dir, EngineConfig(num_kv_blocks=256))
    figures = run(engine, streams=2, requests=3)

    assert not engine.has_unfinished_requests()
    # Two streams at first, the third request added as one ends: it decodes alone at the end.
    assert figures["mixed_steps"] >= 2
    assert figures["decode_steps"] + figures["mixed_steps"] >= 2 * MAX_TOKENS
    assert figures["tokens_per_s"] > 0
