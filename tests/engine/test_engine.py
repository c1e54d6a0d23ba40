from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch

from engine.batcher import StepPlan
from engine.errors import RequestError
from engine.llm_engine import LLMEngine
from engine.model_runner import Executed, Sampled
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from tests.engine.helpers import run_all, text_of, tokens_of

MakeEngine = Callable[..., LLMEngine]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(6, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def force_tokens(engine: LLMEngine, choose: Callable[[Sequence, int], int]) -> None:
    """Replace each sampled token with choose(seq, sampled): drives the stop logic exactly."""
    execute = engine.runner.execute

    def forced(
        plan: StepPlan,
        generators: Mapping[str, torch.Generator],
        masks: Mapping[str, torch.Tensor] | None = None,
    ) -> Executed:
        executed = execute(plan, generators, masks)
        sampled: list[Sampled] = [
            (seq, choose(seq, token), logprob) for seq, token, logprob in executed.sampled
        ]
        return Executed(sampled, executed.scored)

    engine.runner.execute = forced  # type: ignore[method-assign]


def generate_one(
    engine: LLMEngine, params: SamplingParams, ids: list[int], rid: str = "r"
) -> tuple[list[int], str, str]:
    engine.add_request(rid, ids, params)
    outs = run_all(engine)[rid]
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    return tokens_of(outs), text_of(outs), outs[-1].finish_reason or ""


def test_length_finish_and_token_accounting(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.add_request("r", prompt(10), GREEDY)
    outs = run_all(engine)["r"]
    assert outs[-1].finish_reason == "length"
    assert len(tokens_of(outs)) == 24
    metrics = outs[-1].metrics
    assert (
        metrics.num_prompt_tokens,
        metrics.num_output_tokens,
        metrics.num_cached_prompt_tokens,
    ) == (10, 24, 0)
    assert engine.num_free_blocks == engine.num_total_blocks


def test_stop_token_id_ends_with_stop_and_is_not_in_the_text(make_engine: MakeEngine) -> None:
    engine = make_engine()
    tokens, _, _ = generate_one(engine, GREEDY, prompt(12))
    k = next(i for i in range(3, 24) if tokens[i] not in tokens[:i])
    stopped, text, reason = generate_one(
        engine,
        SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(tokens[k],)),
        prompt(12),
        "s",
    )
    assert (stopped, reason) == (tokens[: k + 1], "stop")
    assert text == engine.tokenizer.decode(tokens[:k])


def test_eos_ends_with_stop_unless_ignored(make_engine: MakeEngine) -> None:
    engine = make_engine()
    eos = engine.tokenizer.eos_token_ids[0]
    force_tokens(engine, lambda seq, token: eos if seq.num_output_tokens == 2 else token)
    tokens, _, reason = generate_one(
        engine, SamplingParams(max_tokens=10, temperature=0), prompt(5)
    )
    assert (len(tokens), tokens[-1], reason) == (3, eos, "stop")
    tokens, _, reason = generate_one(
        engine, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), prompt(5), "i"
    )
    assert (len(tokens), reason) == (10, "length")


def test_stop_string_spanning_tokens_is_cut_and_not_emitted(make_engine: MakeEngine) -> None:
    engine = make_engine()
    engine.add_request(
        "free", prompt(8, seed=3), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    )
    deltas = [o.text_delta for o in run_all(engine)["free"]]
    full = "".join(deltas)
    for k in range(2, len(deltas) - 1):
        pos = len("".join(deltas[: k + 1])) - 1
        stop = full[pos : pos + 2]
        if deltas[k] and deltas[k + 1] and "\ufffd" not in stop and full.find(stop) == pos:
            break
    else:
        pytest.skip("no suitable token boundary in this output")
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop,))
    engine.add_request("cut", prompt(8, seed=3), params)
    outs = run_all(engine)["cut"]
    assert outs[-1].finish_reason == "stop_sequence"
    assert text_of(outs) == full[:pos]
    assert len(outs) == k + 2


def test_multibyte_output_is_never_split(make_engine: MakeEngine) -> None:
    engine = make_engine()
    target = engine.tokenizer.encode("中文 🚀∑ 한국어", add_special_tokens=False)
    force_tokens(engine, lambda seq, _: target[seq.num_output_tokens])
    engine.add_request("mb", prompt(4), SamplingParams(max_tokens=len(target), temperature=0))
    outs = run_all(engine)["mb"]
    assert all("\ufffd" not in o.text_delta for o in outs)
    assert text_of(outs) == "中文 🚀∑ 한국어"


def test_seeded_request_gives_the_same_tokens_whatever_else_is_batched(
    make_engine: MakeEngine,
) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = make_engine()
    alone.add_request("x", prompt(9), params)
    expected = tokens_of(run_all(alone)["x"])
    busy = make_engine()
    for i in range(3):
        busy.add_request(
            f"n{i}",
            prompt(5 + 11 * i, seed=i),
            SamplingParams(max_tokens=30, top_k=20, ignore_eos=True),
        )
    busy.step()
    busy.add_request("x", prompt(9), params)
    busy.add_request("late", prompt(40, seed=9), SamplingParams(max_tokens=5, temperature=0.5))
    assert tokens_of(run_all(busy)["x"]) == expected
    other_seed = make_engine()
    other_seed.add_request(
        "x", prompt(9), SamplingParams(max_tokens=20, temperature=0.9, seed=99, ignore_eos=True)
    )
    assert tokens_of(run_all(other_seed)["x"]) != expected


def test_chunked_prefill_and_preemption_do_not_change_greedy_output(
    make_engine: MakeEngine,
) -> None:
    prompts = [prompt(n, seed=n) for n in (3, 30, 57, 21, 44)]
    roomy = make_engine(max_num_batched_tokens=512)
    expected = [r.token_ids for r in roomy.generate(prompts, GREEDY)]
    cramped = make_engine(num_kv_blocks=40, max_num_batched_tokens=16)
    results = cramped.generate(prompts, GREEDY)
    assert [r.token_ids for r in results] == expected
    assert sum(r.metrics.num_preemptions for r in results) > 0
    assert cramped.num_free_blocks == cramped.num_total_blocks


def test_prefix_cache_is_shared_within_a_namespace_only(make_engine: MakeEngine) -> None:
    engine = make_engine()
    shared = prompt(41, seed=5)
    results = {}
    for rid, namespace in (("first", "tenant-a"), ("again", "tenant-a"), ("other", "tenant-b")):
        engine.add_request(rid, shared, GREEDY, cache_namespace=namespace)
        outs = run_all(engine)[rid]
        results[rid] = (tokens_of(outs), outs[-1].metrics.num_cached_prompt_tokens)
    assert results["first"][1] == 0
    assert results["again"] == (results["first"][0], 40)
    assert results["other"] == (results["first"][0], 0)


def test_abort_in_every_state_frees_everything(make_engine: MakeEngine) -> None:
    engine = make_engine(max_num_batched_tokens=8, max_num_seqs=2)
    engine.add_request("decoding", prompt(3), GREEDY)
    engine.step()
    engine.add_request("prefilling", prompt(30), GREEDY)
    engine.add_request("waiting", prompt(5), GREEDY)
    engine.step()
    assert engine.abort("decoding") and engine.abort("prefilling") and engine.abort("waiting")
    assert not engine.abort("waiting") and not engine.abort("unknown")
    outs = engine.step()
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [
        ("decoding", "abort"),
        ("prefilling", "abort"),
        ("waiting", "abort"),
    ]
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.num_total_blocks


def test_metrics_follow_the_clock(tiny_dir: Path) -> None:
    from engine.config import EngineConfig

    ticks = iter(i * 0.5 for i in range(1000))
    engine = LLMEngine.from_model_dir(
        tiny_dir, EngineConfig(num_kv_blocks=16, block_size=4), clock=lambda: next(ticks)
    )
    engine.add_request(
        "r", prompt(3), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    )  # t=0
    metrics = run_all(engine)["r"][-1].metrics  # steps at (0.5, 1.0), (1.5, 2.0), (2.5, 3.0)
    assert (metrics.queue_time, metrics.ttft, metrics.itl_mean, metrics.itl_max) == (
        0.5,
        1.0,
        1.0,
        1.0,
    )
    # One block from 0.5 to 2.5, two once the fifth token needs a second block.
    assert (metrics.kv_blocks_peak, metrics.kv_block_seconds) == (2, 3.0)


def test_capacity_queries_and_request_validation(make_engine: MakeEngine) -> None:
    engine = make_engine(num_kv_blocks=10, max_model_len=64)
    assert engine.limits.blocks_needed(17) == 5 and engine.num_total_blocks == 10
    # 40 tokens fill the ten blocks exactly; 50 would need thirteen.
    engine.add_request("fits", prompt(20), SamplingParams(max_tokens=20))
    with pytest.raises(RequestError, match="needs 13 KV blocks"):
        engine.add_request("big", prompt(30), SamplingParams(max_tokens=20))
    engine.add_request("r", prompt(5), GREEDY)
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("r", prompt(5), GREEDY)
    with pytest.raises(RequestError, match="at most 63"):
        engine.add_request("long", prompt(64), GREEDY)
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("empty", [], GREEDY)
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request("oov", [1, 100_000], GREEDY)
    with pytest.raises(RequestError, match="priority"):
        engine.add_request("p", prompt(5), GREEDY, priority="urgent")


def test_text_prompts_and_model_fingerprint(make_engine: MakeEngine) -> None:
    engine = make_engine()
    assert len(engine.model_fingerprint) == 32
    engine.add_request(
        "t", "the toll gate", SamplingParams(max_tokens=4, temperature=0), priority="batch"
    )
    outs = run_all(engine)["t"]
    assert outs[-1].metrics.num_prompt_tokens == len(engine.tokenizer.encode("the toll gate"))


def test_a_suspended_request_goes_on_after_resume_with_the_same_tokens(
    make_engine: MakeEngine,
) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3, ignore_eos=True)
    alone = make_engine()
    alone.add_request("a", prompt(30), params)
    expected = tokens_of(run_all(alone)["a"])
    engine = make_engine()
    engine.add_request("a", prompt(30), params)
    engine.add_request("b", prompt(20, seed=2), GREEDY)
    made: list[int] = []
    while len(made) < 8:
        made += [t for out in engine.step() if out.request_id == "a" for t in out.new_token_ids]
    assert engine.suspend("a")
    while_suspended = [engine.step() for _ in range(5)]
    assert all(out.request_id != "a" for outs in while_suspended for out in outs)
    assert engine.num_free_blocks > 0 and engine.resume("a") and not engine.resume("a")
    outs = run_all(engine)["a"]
    assert made + list(tokens_of(outs)) == list(expected)
    assert outs[-1].metrics.num_preemptions == 1
    assert outs[-1].metrics.num_prompt_tokens == 30
    assert engine.num_free_blocks == engine.num_total_blocks


def test_an_aborted_suspended_request_ends_and_several_answers_are_not_suspended(
    make_engine: MakeEngine,
) -> None:
    engine = make_engine()
    engine.add_request("a", prompt(30), GREEDY)
    engine.add_request("n", prompt(10), SamplingParams(max_tokens=4, n=2, temperature=1.0))
    engine.step()
    assert engine.suspend("a") and not engine.suspend("n") and not engine.suspend("nope")
    assert engine.abort("a")
    outs = run_all(engine)
    assert outs["a"][-1].finish_reason == "abort"
    assert engine.num_free_blocks == engine.num_total_blocks
