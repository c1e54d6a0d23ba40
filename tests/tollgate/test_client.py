"""The synchronous SDK against the scripted fake gateway.

The fake runs on the session event loop; the blocking client runs in a thread.
"""

import asyncio
import uuid
from collections import deque

import pytest

from services.core.errors import (
    FieldViolation,
    IdempotencyKeyReused,
    InvalidArgument,
    QuotaExceeded,
)
from tests.tollgate.fake_gateway import Break, FakeServer, start_fake
from tollgate.client import AdminClient, Client
from tollgate.errors import (
    IdempotencyKeyReusedError,
    InvalidArgumentError,
    NotFoundError,
    QuotaExceededError,
    RunFailedError,
    StreamGapError,
    UnavailableError,
)
from tollgate.types import RetryPolicy

FAST = RetryPolicy(max_attempts=5, initial_backoff=0.01, max_backoff=0.05)
PIECES = ("Hel", "lo", ", ", "wor", "ld")
ALL_SEQS = list(range(1, len(PIECES) + 5))  # queued, prefill, pieces, completed, billed


def client(fake: FakeServer, **kwargs) -> Client:  # type: ignore[no-untyped-def]
    return Client(fake.address, "key-1", retry=FAST, timeout=5, **kwargs)


def collect(fake: FakeServer, **kwargs) -> tuple[list[int], str, str | None]:  # type: ignore[no-untyped-def]
    with client(fake) as c, c.generate("hi", model="tiny", **kwargs) as stream:
        seqs = [event.seq for event in stream]
        return seqs, stream.text, stream.run_id


async def test_a_whole_stream_with_the_api_key_and_a_fresh_idempotency_key(
    fake: FakeServer,
) -> None:
    def run() -> tuple[list[int], str, int, str]:
        with client(fake) as c, c.generate("hi", model="tiny", max_tokens=5, seed=7) as stream:
            seqs = [event.seq for event in stream]
            assert stream.usage is not None
            return seqs, stream.text, stream.usage.output_tokens, stream.finish_reason

    seqs, text, output_tokens, finish_reason = await asyncio.to_thread(run)
    assert seqs == ALL_SEQS
    assert (text, output_tokens, finish_reason) == ("Hello, world", 5, "length")
    [(method, request, metadata)] = fake.gateway.calls
    assert method == "Generate"
    assert metadata["authorization"] == "Bearer key-1"
    assert uuid.UUID(request.idempotency_key)
    assert (request.sampling.max_tokens, request.sampling.seed) == (5, 7)
    assert not request.sampling.HasField("temperature")


@pytest.mark.parametrize(
    "breaks",
    [
        [Break(after=3)],
        [Break(after=2), Break(after=1, replay=2), Break(after=2, how="end")],
        [Break(after=4, how="cancel"), Break(after=1, how="abort", replay=3)],
        [Break(after=3, skip_seq=3)],
    ],
    ids=["abort", "abort-replay-end", "cancel-replay", "gap-filled"],
)
async def test_a_broken_stream_resumes_without_repeats_or_gaps(
    fake: FakeServer, breaks: list[Break]
) -> None:
    fake.gateway.breaks = deque(breaks)
    seqs, text, run_id = await asyncio.to_thread(collect, fake)
    assert seqs == ALL_SEQS
    assert text == "Hello, world"
    assert len(fake.gateway.runs) == 1
    resumes = [(m, r, md) for m, r, md in fake.gateway.calls if m == "StreamRun"]
    assert len(resumes) == len(breaks)
    assert all(r.run_id == run_id for _, r, _ in resumes)
    assert all(md["authorization"] == "Bearer key-1" for _, _, md in resumes)


async def test_resume_asks_after_the_last_seq_seen(fake: FakeServer) -> None:
    fake.gateway.breaks = deque([Break(after=3)])
    await asyncio.to_thread(collect, fake)
    [resume] = [r for m, r, _ in fake.gateway.calls if m == "StreamRun"]
    assert resume.starting_after == 3


async def test_live_tokens_come_once_across_a_break(fake: FakeServer) -> None:
    fake.gateway.live = True
    # queued, prefill, "Hel", then "lo" live: the stream breaks before seq 4.
    fake.gateway.breaks = deque([Break(after=4)])

    def run() -> tuple[list[tuple[int, bool, str]], str]:
        with client(fake) as c, c.generate("hi", model="tiny") as stream:
            return [(e.seq, e.live, e.text) for e in stream], stream.text

    events, text = await asyncio.to_thread(run)
    assert text == "".join(t for _, _, t in events) == "Hello, world"
    assert [seq for seq, live, _ in events if not live] == ALL_SEQS
    assert [seq for seq, live, _ in events if live] == [3, 4, 5, 6]
    [generate] = [r for m, r, _ in fake.gateway.calls if m == "Generate"]
    [resume] = [r for m, r, _ in fake.gateway.calls if m == "StreamRun"]
    assert generate.live and resume.live
    assert (resume.starting_after, resume.after_tokens, resume.after_chars) == (3, 2, 5)


async def test_a_break_before_the_first_event_retries_generate_with_the_same_key(
    fake: FakeServer,
) -> None:
    fake.gateway.breaks = deque([Break(after=0), Break(after=0, how="cancel")])
    seqs, _, _ = await asyncio.to_thread(collect, fake, idempotency_key=None)
    assert seqs == ALL_SEQS
    generates = [r for m, r, _ in fake.gateway.calls if m == "Generate"]
    assert len(generates) == 3
    assert len({r.idempotency_key for r in generates}) == 1
    assert len(fake.gateway.runs) == 1


async def test_a_gap_that_persists_raises(fake: FakeServer) -> None:
    fake.gateway.breaks = deque(Break(after=10, skip_seq=2) for _ in range(10))
    with pytest.raises(StreamGapError):
        await asyncio.to_thread(collect, fake)


async def test_out_of_retries_raises_unavailable(fake: FakeServer) -> None:
    fake.gateway.breaks = deque([Break(after=1)] + [Break(after=0)] * 10)
    with pytest.raises(UnavailableError):
        await asyncio.to_thread(collect, fake)
    # The broken Generate and the StreamRun attempts after it, max_attempts in all.
    assert len(fake.gateway.calls) == FAST.max_attempts


async def test_invalid_argument_maps_with_field_violations_and_is_not_retried(
    fake: FakeServer,
) -> None:
    fake.gateway.generate_error = InvalidArgument(
        [FieldViolation("sampling.max_tokens", "must be > 0")]
    )
    with pytest.raises(InvalidArgumentError) as caught:
        await asyncio.to_thread(collect, fake, max_tokens=0)
    assert caught.value.code == "INVALID_ARGUMENT"
    assert caught.value.field_violations == [("sampling.max_tokens", "must be > 0")]
    assert caught.value.summary() == "INVALID_ARGUMENT: sampling.max_tokens: must be > 0"
    assert len(fake.gateway.calls) == 1


async def test_quota_exceeded_carries_retry_after_and_violations(fake: FakeServer) -> None:
    fake.gateway.generate_error = QuotaExceeded("too many runs", "tenant:tenant-1", 2.5)
    with pytest.raises(QuotaExceededError) as caught:
        await asyncio.to_thread(collect, fake)
    assert caught.value.retry_after == pytest.approx(2.5)
    assert caught.value.violations == [("tenant:tenant-1", "too many runs")]
    assert len(fake.gateway.calls) == 1


async def test_idempotency_key_reused(fake: FakeServer) -> None:
    fake.gateway.generate_error = IdempotencyKeyReused("run-7")
    with pytest.raises(IdempotencyKeyReusedError) as caught:
        await asyncio.to_thread(collect, fake, idempotency_key="k1")
    assert caught.value.code == "FAILED_PRECONDITION"
    assert caught.value.reason == "IDEMPOTENCY_KEY_REUSED"
    assert caught.value.run_id == "run-7"


async def test_generate_text_and_a_failed_run(fake: FakeServer) -> None:
    def text() -> str:
        with client(fake) as c:
            return c.generate_text("hi", model="tiny")

    assert await asyncio.to_thread(text) == "Hello, world"
    [(_, request, _)] = fake.gateway.calls
    assert request.until_terminal
    fake.gateway.end = "failed"
    with pytest.raises(RunFailedError) as caught:
        await asyncio.to_thread(text)
    assert caught.value.code == "WORKER_LOST"


async def test_closing_a_stream_early_stops_it(fake: FakeServer) -> None:
    fake.gateway.delay = 0.01

    def first_two() -> tuple[list[int], int]:
        with client(fake) as c, c.generate("hi", model="tiny") as stream:
            seqs = [next(stream).seq, next(stream).seq]
        return seqs, stream.last_seq

    assert await asyncio.to_thread(first_two) == ([1, 2], 2)
    await asyncio.sleep(0.05)
    # The cancel was the caller's own: nothing is resumed.
    assert [m for m, _, _ in fake.gateway.calls] == ["Generate"]


async def test_stream_run_get_cancel_and_list(fake: FakeServer) -> None:
    for _ in range(3):
        await asyncio.to_thread(collect, fake)
    run_ids = list(reversed(fake.gateway.runs))  # newest first, as ListRuns pages them

    def calls() -> None:
        with client(fake) as c:
            with c.stream_run(run_ids[0], starting_after=5) as stream:
                assert [e.seq for e in stream] == ALL_SEQS[5:]
            run = c.get_run(run_ids[0])
            assert (run.state, run.last_seq, run.priority) == ("billed", 9, "interactive")
            assert c.cancel_run(run_ids[1]).state == "billed"  # it had ended: unchanged
            assert [r.run_id for r in c.iter_runs(page_size=2)] == run_ids
            page = c.list_runs(page_size=2)
            assert len(page.runs) == 2 and page.next_page_token
            with pytest.raises(NotFoundError):
                c.get_run("nope")

    await asyncio.to_thread(calls)


async def test_admin_and_a_separate_ledger_address(fake: FakeServer) -> None:
    ledger = await start_fake()
    try:

        def calls() -> None:
            with AdminClient(fake.address, "admin-1", ledger_address=ledger.address) as admin:
                tenant = admin.create_tenant("acme", weight=3)
                assert (tenant.name, tenant.weight) == ("acme", 3)
                assert admin.get_tenant(tenant.tenant_id) == tenant
                assert admin.list_tenants() == [tenant]
                key = admin.create_api_key(tenant.tenant_id)
                assert key.secret == "tg_secret_1" and "tg_secret_1" not in repr(key)
                assert admin.revoke_api_key(key.key_id).revoked
                quota = admin.set_quota(tenant.tenant_id, max_kv_blocks=64)
                assert (quota.max_kv_blocks, quota.max_concurrent_runs) == (64, 0)
                report = admin.get_usage(tenant_id=tenant.tenant_id)
                assert (report.amount_micros, report.currency) == (1_500_300, "USD")
                assert [e.entry_id for e in admin.iter_ledger_entries()] == ["e1"]
                assert admin.get_reconciliation().ok

        await asyncio.to_thread(calls)
        assert fake.admin.calls[0][2]["authorization"] == "Bearer admin-1"
        assert [m for m, _, _ in ledger.ledger.calls] == ["GetUsage", "ListLedgerEntries"]
        assert not fake.ledger.calls
    finally:
        await ledger.server.stop(0)


async def test_the_client_repr_hides_the_key(fake: FakeServer) -> None:
    with client(fake) as c:
        assert "key-1" not in repr(c)


async def test_tools_and_logprobs_go_out_and_the_calls_and_logprobs_come_back(
    fake: FakeServer,
) -> None:
    fake.gateway.pieces = ('{"tool_calls": [{"name": "now", ', '"arguments": {}}]}')
    tool = {"type": "function", "function": {"name": "now"}}

    def run() -> tuple[object, tuple[float, ...], object]:
        with client(fake) as c, c.generate(
            "What time is it?", model="tiny", tools=[tool], tool_choice="required",
            logprobs=True, top_logprobs=1, until_terminal=True,
        ) as stream:  # fmt: skip
            before = stream.tool_calls
            stream.wait()
            return before, tuple(x.logprob for x in stream.logprobs), stream.tool_calls

    before, logprobs, calls = await asyncio.to_thread(run)
    [(_, request, _)] = fake.gateway.calls
    assert [t.name for t in request.sampling.tools] == ["now"]
    assert request.sampling.tool_choice.mode == "required"
    assert (request.sampling.logprobs, request.sampling.top_logprobs) == (True, 1)
    assert before is None and logprobs == (-0.5, -0.5)
    assert isinstance(calls, tuple) and [(c.name, c.arguments) for c in calls] == [("now", "{}")]


async def test_a_text_answer_or_a_run_offered_no_tools_has_no_calls(fake: FakeServer) -> None:
    fake.gateway.pieces = ('{"tool_calls": [{"name": "now"}]}',)

    def calls(**kwargs) -> object:  # type: ignore[no-untyped-def]
        with client(fake) as c, c.generate("hi", model="tiny", **kwargs) as stream:
            stream.wait()
            return stream.tool_calls, stream.logprobs

    assert await asyncio.to_thread(calls) == (None, ())
    fake.gateway.pieces = ("It is noon.",)
    tool = {"type": "function", "function": {"name": "now"}}
    assert await asyncio.to_thread(calls, tools=[tool]) == (None, ())
