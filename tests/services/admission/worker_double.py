"""Plays worker and ledger for one run by appending its events to the store.

The events have the kinds, order and payload keys of a run the real worker ran and the
real ledger billed (tests/services/admission/test_worker_double_contract.py holds it to
that): `prefill` under a lease of its own, one `streaming` event per token, `completed`
with the worker's usage, then `billed` with one ledger entry per billing type.
"""

from datetime import UTC, datetime
from typing import Any

from services.core.event_store import EventStore
from services.core.runs import NewEvent, RunState

WORKER_ID = "worker-double"
BLOCK_SIZE = 16
# Micro-units per token, by billing type.
PRICES = {"input_tokens": 1, "cached_input_tokens": 0, "output_tokens": 2}


async def finish_run(store: EventStore, run_id: str, tokens: list[int], texts: list[str]) -> None:
    seq, usage = await complete_run(store, run_id, tokens, texts)
    run = await store.get_run(run_id)
    assert run is not None
    entries = ledger_entries(run.tenant_id, run_id, run.idempotency_key or "", usage)
    billed = {
        "amount_micros": sum(entry["amount_micros"] for entry in entries),
        "currency": "USD",
        "entries": entries,
    }
    await store.append(run_id, seq, [NewEvent(RunState.BILLED, billed)])


async def complete_run(
    store: EventStore, run_id: str, tokens: list[int], texts: list[str]
) -> tuple[int, dict[str, Any]]:
    """Plays the worker only, up to `completed`; returns the run's last seq and its usage."""
    run = await store.get_run(run_id)
    assert run is not None
    [queued] = await store.read(run_id, limit=1)
    epoch = await store.acquire_lease(run_id, WORKER_ID)
    prefill = NewEvent(RunState.PREFILL, {"worker_id": WORKER_ID, "lease_epoch": epoch})
    seq = run.last_seq
    await store.append(run_id, seq, [prefill], lease_epoch=epoch)
    seq += 1
    made = (0, 0)
    for token, text in zip(tokens, texts, strict=True):
        payload = {"token_ids": [token], "text": text, "at": list(made)}
        await store.append(run_id, seq, [NewEvent(RunState.STREAMING, payload)], lease_epoch=epoch)
        made = (made[0] + 1, made[1] + len(text))
        seq += 1
    usage = worker_usage(len(queued.payload.get("prompt_token_ids", [])), len(tokens))
    completed = {"finish_reason": "length", "usage": usage, "ttft_seconds": 0.01}
    await store.append(run_id, seq, [NewEvent(RunState.COMPLETED, completed)], lease_epoch=epoch)
    return seq + 1, usage


def worker_usage(num_prompt: int, num_output: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "cached_prompt_tokens": 0,
        "output_tokens": num_output,
        "kv_blocks_peak": -(-(num_prompt + num_output) // BLOCK_SIZE),
        "kv_block_seconds": 0.0,
    }


def ledger_entries(
    tenant_id: str, run_id: str, idempotency_key: str, usage: dict[str, Any]
) -> list[dict[str, Any]]:
    quantities = {
        "input_tokens": usage["prompt_tokens"] - usage["cached_prompt_tokens"],
        "cached_input_tokens": usage["cached_prompt_tokens"],
        "output_tokens": usage["output_tokens"],
    }
    now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    return [
        {
            "entry_id": f"{run_id}:{billing_type}",
            "tenant_id": tenant_id,
            "run_id": run_id,
            "idempotency_key": idempotency_key,
            "billing_type": billing_type,
            "quantity": quantity,
            "unit_price_micros": PRICES[billing_type],
            "amount_micros": quantity * PRICES[billing_type],
            "create_time": now,
        }
        for billing_type, quantity in quantities.items()
    ]
