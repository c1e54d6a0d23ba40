"""Stored events → protobuf `RunEvent`, checked against protobuf's own JSON mapping."""

from datetime import UTC, datetime

import pytest
from google.protobuf import json_format

from services.core.codec import from_proto, to_proto
from services.core.runs import RunState, StoredEvent

NOW = datetime(2026, 1, 2, 3, 4, 5, 678_000, tzinfo=UTC)


def event(kind: RunState, payload: dict[str, object]) -> StoredEvent:
    return StoredEvent("run_1", 3, kind, "ten_1", payload, NOW)


@pytest.mark.parametrize(
    ("kind", "payload"),
    [
        (
            RunState.QUEUED,
            {
                "model": "tiny",
                "priority": "PRIORITY_BATCH",
                "sampling": {"max_tokens": 8, "stop": ["\n"], "stop_token_ids": [2, 3]},
                "prompt_token_ids": list(range(300)),
                "idempotency_key": "k",
                "num_kv_blocks": 20,
            },
        ),
        (RunState.STREAMING, {"token_ids": [5, 0, 2**31 - 1], "text": "a\u0000é"}),
        (RunState.STREAMING, {"token_ids": [], "text": ""}),
        # Not all plain integers: the JSON mapping converts them.
        (RunState.STREAMING, {"token_ids": ["5", 6], "text": "x"}),
        (
            RunState.COMPLETED,
            {
                "finish_reason": "length",
                "usage": {"prompt_tokens": 3, "output_tokens": 2, "kv_block_seconds": 0.25},
                "ttft_seconds": 0.125,
            },
        ),
        (RunState.BILLED, {"amount_micros": "12", "currency": "USD"}),
        (RunState.FAILED, {"code": "X", "message": "m", "usage": {}}),
    ],
)
def test_the_message_is_the_one_the_json_mapping_gives(
    kind: RunState, payload: dict[str, object]
) -> None:
    message = to_proto(event(kind, payload))
    assert message.run_id == "run_1" and message.seq == 3 and message.tenant_id == "ten_1"
    assert message.time.ToDatetime(UTC) == NOW
    reference = getattr(message.__class__(), str(kind))
    json_format.ParseDict(payload, reference)
    assert getattr(message, str(kind)) == reference


def test_an_out_of_range_integer_is_refused() -> None:
    with pytest.raises(ValueError):
        to_proto(event(RunState.STREAMING, {"token_ids": [2**31], "text": "x"}))
    with pytest.raises(ValueError):
        to_proto(event(RunState.BILLED, {"amount_micros": 2**63, "currency": "USD"}))


def test_an_empty_payload_still_names_the_kind() -> None:
    assert to_proto(event(RunState.PREFILL, {})).WhichOneof("kind") == "prefill"


@pytest.mark.parametrize(
    ("kind", "payload"),
    [
        (
            RunState.QUEUED,
            {
                "model": "tiny",
                "priority": "PRIORITY_BATCH",
                "sampling": {"temperature": 0.5, "max_tokens": 8, "stop": ["\n"], "seed": 7},
                "prompt_token_ids": list(range(300)),
                "num_kv_blocks": 20,
            },
        ),
        (RunState.STREAMING, {"token_ids": [5, 2**31 - 1], "text": "a\u0000é"}),
        (RunState.PREFILL, {}),
        (RunState.FAILED, {"code": "X", "message": "m", "usage": {}}),
        (
            RunState.BILLED,
            {
                "amount_micros": 12,
                "currency": "USD",
                "entries": [{"entry_id": "e", "create_time": "2026-01-02T03:04:05Z"}],
            },
        ),
    ],
)
def test_from_proto_gives_back_the_stored_event(kind: RunState, payload: dict[str, object]) -> None:
    stored = StoredEvent("run_1", 3, kind, "ten_1", payload, NOW, "00-abc-def-01")
    assert from_proto(to_proto(stored), "00-abc-def-01") == stored


def test_from_proto_leaves_out_what_the_message_cannot_carry() -> None:
    stored = event(RunState.COMPLETED, {"finish_reason": "", "usage": {"output_tokens": 0}})
    assert from_proto(to_proto(stored)).payload == {"usage": {}}
    # 64-bit integers stored as strings (the JSON mapping's form) come back as integers.
    assert from_proto(to_proto(event(RunState.BILLED, {"amount_micros": "12"}))).payload == {
        "amount_micros": 12
    }
