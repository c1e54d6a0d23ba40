"""The `transformers` baselines: generate() in static batches, and its continuous batching."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from bench.timing import TokenTimes
from bench.workload import Workload

PAD_ID = 2


def load_hf_model(model_dir: Path) -> Any:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    return model.eval()


class _StepClock:
    """A generate() streamer that keeps the time of each decoding step (the first `put`
    is the prompt)."""

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self._seen_prompt:
            self.step_times.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        pass


def run_static(model: Any, work: Workload, batch_size: int) -> TokenTimes:
    """Batches of `batch_size` in arrival order, left-padded, each run to its longest output;
    a request's tokens are the first `output_len` steps of its batch."""
    _static_batch(model, [[7] * 32], 4)  # warm-up
    result = TokenTimes(start=time.perf_counter(), times=[])
    for i in range(0, len(work.prompts), batch_size):
        lens = work.output_lens[i : i + batch_size]
        steps = _static_batch(model, work.prompts[i : i + batch_size], max(lens))
        result.times.extend(steps[:n] for n in lens)
    result.end = time.perf_counter()
    return result


def _static_batch(model: Any, prompts: list[list[int]], max_new_tokens: int) -> list[float]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = _StepClock()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=PAD_ID,
            streamer=clock,
        )
    return clock.step_times


def continuous_batching_api(model: Any) -> str | None:
    """Why `transformers`' continuous batching cannot run here, or None when it can."""
    if not hasattr(model, "generate_batch") or not hasattr(
        model, "continuous_batching_context_manager"
    ):
        import transformers

        return f"transformers {transformers.__version__} has no generate_batch()"
    return None


def run_continuous(model: Any, work: Workload, max_batch_tokens: int) -> TokenTimes:
    """`transformers`' continuous batching, through the manager generate_batch() wraps:
    generate_batch() gives every request one max_new_tokens, the workload does not."""
    import transformers

    generation = transformers.GenerationConfig(
        do_sample=False, eos_token_id=-1, pad_token_id=PAD_ID, max_new_tokens=max(work.output_lens)
    )
    batching = transformers.ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens)
    # Warm-up, as the engine's own.
    model.generate_batch(
        [[7] * 32], generation_config=generation, continuous_batching_config=batching
    )
    with model.continuous_batching_context_manager(
        generation_config=generation, continuous_batching_config=batching, block=True, timeout=60
    ) as manager:
        result = TokenTimes(start=time.perf_counter(), times=[])
        ids = [
            manager.add_request(prompt, max_new_tokens=n, record_timestamps=True)
            for prompt, n in zip(work.prompts, work.output_lens, strict=True)
        ]
        finished: dict[str, Any] = {}
        while len(finished) < len(ids):
            output = manager.get_result(timeout=1)
            if output is not None and output.is_finished():
                finished[output.request_id] = output
            elif output is None and not manager.is_running():
                raise RuntimeError("the continuous batching loop stopped early")
        result.end = time.perf_counter()
    for request_id, n in zip(ids, work.output_lens, strict=True):
        output = finished[request_id]
        if output.error is not None or len(output.generated_tokens) != n:
            raise RuntimeError(f"request {request_id} failed: {output.error}")
        result.times.append(list(output.timestamps or []))
    return result
