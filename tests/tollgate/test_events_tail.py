"""`tollgate events tail` against the real broker, fed RunEvents produced here directly."""

import asyncio
import json
import uuid

import pytest
from aiokafka import AIOKafkaProducer

from tests.tollgate.fake_gateway import script
from tollgate.cli import main


async def produce(bootstrap: str, topic: str, values: list[tuple[str, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for key, value in values:
            await producer.send_and_wait(topic, value, key=key.encode())
    finally:
        await producer.stop()


def records(run_id: str, *, end: str = "completed") -> list[tuple[str, bytes]]:
    return [(run_id, e.SerializeToString()) for e in script(run_id, ("a", "b"), end=end)]


async def tail(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(main, ["events", "tail", *argv])
    out, err = capsys.readouterr()
    return code, out, err


async def test_from_the_beginning_each_event_once(
    kafka_bootstrap: str, kafka_topic: str, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = records("run-a"), records("run-b", end="failed")
    # At-least-once delivery: seq 2 and 3 of run-a arrive twice, and one record is junk.
    values = first[:4] + first[1:3] + [("run-a", b"\xff\xff")] + first[4:] + second
    await produce(kafka_bootstrap, kafka_topic, values)
    code, out, err = await tail(
        capsys, "--kafka", kafka_bootstrap, "--topic", kafka_topic, "--from-beginning",
        "--max-events", "12", "--timeout", "30",
    )  # fmt: skip
    assert code == 0
    lines = out.splitlines()
    keys = [tuple(line.split()[:2]) for line in lines]
    assert len(lines) == 12 and len(set(keys)) == 12
    for run_id in ("run-a", "run-b"):
        seqs = [int(seq) for rid, seq in keys if rid == run_id]
        assert seqs == [1, 2, 3, 4, 5, 6]
    assert 'run-a 3 streaming tokens=1 text="a"' in lines
    assert any(line.startswith("run-b 5 failed code=WORKER_LOST") for line in lines)
    assert any(line.startswith("run-a 6 billed amount=0.001234 USD") for line in lines)
    assert "not a RunEvent" in err


async def test_json_lines_from_the_stack_settings(
    kafka_bootstrap: str,
    kafka_topic: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    monkeypatch.delenv("TOLLGATE_KAFKA_BOOTSTRAP", raising=False)
    stack = tmp_path / "stack.json"
    stack.write_text(json.dumps({"kafka_bootstrap": kafka_bootstrap}))
    await produce(kafka_bootstrap, kafka_topic, records("run-j"))
    code, out, _ = await tail(
        capsys, "--stack", str(stack), "--topic", kafka_topic, "--from-beginning", "--json",
        "--max-events", "6", "--timeout", "30",
    )  # fmt: skip
    events = [json.loads(line) for line in out.splitlines()]
    assert code == 0
    assert [(e["run_id"], e["seq"], e["kind"]) for e in events][:2] == [
        ("run-j", 1, "queued"),
        ("run-j", 2, "prefill"),
    ]
    assert events[4]["finish_reason"] == "length" and events[4]["usage"]["output_tokens"] == 2


async def test_by_default_only_new_events(
    kafka_bootstrap: str, kafka_topic: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await produce(kafka_bootstrap, kafka_topic, records("old-run"))
    tailing = asyncio.ensure_future(
        tail(capsys, "--kafka", kafka_bootstrap, "--topic", kafka_topic,
             "--max-events", "1", "--timeout", "30")
    )  # fmt: skip
    # Keep publishing until the tail, which starts at the end, has seen one.
    while not tailing.done():
        await produce(kafka_bootstrap, kafka_topic, records(f"new-{uuid.uuid4().hex[:8]}")[:1])
        await asyncio.wait([tailing], timeout=0.3)
    code, out, _ = await tailing
    assert code == 0
    assert out.startswith("new-") and out.count("\n") == 1


async def test_the_timeout_ends_a_quiet_tail(
    kafka_bootstrap: str, kafka_topic: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = await tail(
        capsys, "--kafka", kafka_bootstrap, "--topic", kafka_topic, "--timeout", "0.5"
    )
    assert (code, out) == (0, "")
