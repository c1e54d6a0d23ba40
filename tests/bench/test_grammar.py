"""bench.grammar's timing of the grammar's work, on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

from bench.grammar import SCHEMA, GrammarTime, _greedy, _serve, _timed
from bench.workload import Workload
from engine import decoding
from engine.config import EngineConfig
from engine.grammar import Grammars
from engine.layers import sampler
from engine.llm_engine import LLMEngine


def test_the_constrained_run_is_timed_by_part_and_the_engine_restored(
    tiny_model_dir: Path,
) -> None:
    engine = LLMEngine.from_model_dir(tiny_model_dir, EngineConfig(num_kv_blocks=128))
    work = Workload("w", [[5, 6, 7], [8, 9, 10, 11]], [12, 12])
    originals = (decoding.consume, sampler.masked, Grammars.masks)
    timing = GrammarTime()
    with _timed(timing):
        timing.run, lengths = _serve(engine, work, [_greedy(12, json.dumps(SCHEMA)), _greedy(12)])
    assert (decoding.consume, sampler.masked, Grammars.masks) == originals
    assert lengths[1] == 12 and 0 < lengths[0] <= 12
    assert 0 < timing.masks and 0 < timing.apply and 0 < timing.consume
    assert timing.total < timing.run
