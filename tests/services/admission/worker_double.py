"""Plays worker and ledger for one run by appending its events to the store."""

from services.core.eventstore import EventStore
from services.core.runs import NewEvent, RunState


async def finish_run(store: EventStore, run_id: str, tokens: list[int], texts: list[str]) -> None:
    run = await store.get_run(run_id)
    assert run is not None
    seq = run.last_seq
    await store.append(run_id, seq, [NewEvent(RunState.PREFILL)])
    seq += 1
    for token, text in zip(tokens, texts, strict=True):
        await store.append(
            run_id, seq, [NewEvent(RunState.STREAMING, {"token_ids": [token], "text": text})]
        )
        seq += 1
    usage = {"prompt_tokens": 3, "output_tokens": len(tokens)}
    await store.append(
        run_id, seq, [NewEvent(RunState.COMPLETED, {"finish_reason": "length", "usage": usage})]
    )
    await store.append(
        run_id, seq + 1, [NewEvent(RunState.BILLED, {"amount_micros": 10, "currency": "USD"})]
    )
