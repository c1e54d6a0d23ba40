"""OpenAI's Responses API through the official `openai` SDK, unchanged, against a running
stack: answers whole and streamed, background responses polled, a cut stream resumed with
`starting_after`, cancel, delete, input items, conversations over `previous_response_id`,
and what another tenant, or anyone after a `store: false` response ended, may not see.

Every streamed event is parsed again with the SDK's own types, which must know each of
its fields and find none missing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from services.admission.attachment_store import LEASE_SECONDS
from services.stack.infra import Endpoints
from services.stack.launcher import Services
from tests.e2e.conftest import Stack, paste_design_snippet, running_stack
from tests.e2e.test_http import engine_suspended
from tests.e2e.test_restarts import kill
from tests.openai_types import parse_event, parse_response

pytestmark = pytest.mark.slow

ENDED = ("completed", "incomplete", "failed", "cancelled")
# A greedy answer that runs to its token limit: the tiny model's noise, spelled long.
LONG = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def sdk(stack: Stack) -> openai.OpenAI:
    key = stack.tenant_key("responses")
    return openai.OpenAI(base_url=f"{stack.http}/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def other(stack: Stack) -> openai.OpenAI:
    key = stack.tenant_key("responses-other")
    return openai.OpenAI(base_url=f"{stack.http}/v1", api_key=key, max_retries=0)


def checked(events: Any) -> list[Any]:
    """The stream's events, each parsed again, strictly, from what was sent."""
    return [parse_event(event.to_dict(mode="json")) for event in events]


def wait_ended(sdk: openai.OpenAI, response_id: str) -> Any:
    deadline = time.monotonic() + 120
    while (response := sdk.responses.retrieve(response_id)).status not in ENDED:
        assert time.monotonic() < deadline, response.status
        time.sleep(0.1)
    return response


def test_a_response_answered_whole(sdk: openai.OpenAI) -> None:
    raw = sdk.responses.with_raw_response.create(
        model="tiny", input="Say hello", instructions="Be brief", max_output_tokens=8
    )
    response = parse_response(raw.http_response.json())
    assert raw.headers["x-request-id"] == "run_" + response.id.removeprefix("resp_")
    assert response.status in ("completed", "incomplete")
    assert response.instructions == "Be brief"
    assert response.output_text
    usage = response.usage
    assert usage is not None and 0 < usage.output_tokens <= 8
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert sdk.responses.retrieve(response.id).output_text == response.output_text


def test_a_streamed_response_is_openais_event_sequence(sdk: openai.OpenAI) -> None:
    events = checked(
        sdk.responses.create(model="tiny", input="Count", max_output_tokens=12, stream=True)
    )
    kinds = [event.type for event in events]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    numbers = [e.sequence_number for e in events]
    assert numbers[0] == 0 and numbers == sorted(set(numbers))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == deltas
    done = [e for e in events if e.type == "response.output_text.done"]
    assert [e.text for e in done] == [deltas]


def test_a_background_response_is_polled_until_it_ends(sdk: openai.OpenAI) -> None:
    created = sdk.responses.create(
        model="tiny", input="Tell a story", background=True, max_output_tokens=40, **LONG
    )
    assert created.background is True and created.status in ("queued", "in_progress")
    response = wait_ended(sdk, created.id)
    assert response.status == "incomplete"
    assert response.usage is not None and response.usage.output_tokens == 40


def read_some(stream: Any, count: int) -> list[Any]:
    """The stream's first `count` events, parsed again; then the connection is cut."""
    seen = []
    for event in stream:
        seen.append(parse_event(event.to_dict(mode="json")))
        if len(seen) == count:
            break
    stream.close()
    return seen


def test_a_cut_background_stream_resumes_after_the_last_event_seen(
    stack: Stack, sdk: openai.OpenAI
) -> None:
    with engine_suspended(stack):
        seen = read_some(
            sdk.responses.create(
                model="tiny",
                input="A long story",
                background=True,
                stream=True,
                max_output_tokens=300,
                extra_headers={"x-tollgate-disconnect-grace": "0.2"},
                **LONG,
            ),
            2,
        )
        # Past the disconnect grace: a background response is never cancelled.
        time.sleep(1.0)
    response_id = seen[0].response.id
    # Cut again mid-answer, then resumed to the end.
    seen += read_some(
        sdk.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number),
        8,
    )
    assert any(e.type == "response.output_text.delta" for e in seen)
    rest = checked(
        sdk.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number)
    )
    whole = checked(sdk.responses.retrieve(response_id, stream=True))
    # The text in whatever pieces it came, each character once; the other events alike.
    assert rest and delta_text(seen + rest) == delta_text(whole)
    assert others(seen + rest) == others(whole)
    assert whole[0].type == "response.created"
    assert whole[-1].type == "response.incomplete"
    assert sdk.responses.retrieve(response_id).status == "incomplete"


def test_cancel_is_idempotent(stack: Stack, sdk: openai.OpenAI) -> None:
    with engine_suspended(stack):
        created = sdk.responses.create(
            model="tiny", input="Go on", background=True, max_output_tokens=500, **LONG
        )
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.responses.create(
                model="tiny", input="next", max_output_tokens=2, previous_response_id=created.id
            )
        assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
        first = sdk.responses.cancel(created.id)
        second = sdk.responses.cancel(created.id)
    assert first.status == second.status == "cancelled"
    assert parse_response(first.to_dict(mode="json")).id == created.id
    assert sdk.responses.retrieve(created.id).status == "cancelled"


def test_delete_then_not_found(sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(model="tiny", input="x", max_output_tokens=2)
    sdk.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.responses.create(
            model="tiny", input="y", max_output_tokens=2, previous_response_id=response.id
        )
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_input_items_list_what_was_sent(sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(
        model="tiny",
        input=[
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "second"},
            {"role": "user", "content": [{"type": "input_text", "text": "third"}]},
        ],
        max_output_tokens=2,
    )
    page = sdk.responses.input_items.list(response.id, order="asc")
    assert [item.role for item in page.data] == ["user", "assistant", "user"]  # type: ignore[union-attr]
    assert page.data[2].content[0].text == "third"  # type: ignore[union-attr]
    newest = sdk.responses.input_items.list(response.id)
    assert [i.id for i in newest.data] == [i.id for i in reversed(page.data)]


def test_previous_response_id_carries_the_conversation(sdk: openai.OpenAI) -> None:
    previous, inputs = None, []
    for turn in ("My name is Ada.", "What did I say?", "And before that?"):
        response = sdk.responses.create(
            model="tiny",
            input=turn,
            max_output_tokens=6,
            previous_response_id=previous or openai.omit,
        )
        assert response.status in ("completed", "incomplete")
        assert response.previous_response_id == previous
        assert response.usage is not None
        inputs.append(response.usage.input_tokens)
        previous = response.id
    # Each turn's prompt holds the turns and answers before it.
    assert inputs[0] < inputs[1] < inputs[2]


def test_another_tenant_sees_nothing(sdk: openai.OpenAI, other: openai.OpenAI) -> None:
    response = sdk.responses.create(model="tiny", input="mine", max_output_tokens=2)
    for call in (
        lambda: other.responses.retrieve(response.id),
        lambda: other.responses.cancel(response.id),
        lambda: other.responses.delete(response.id),
        lambda: other.responses.input_items.list(response.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError) as missing:
        other.responses.create(
            model="tiny", input="x", max_output_tokens=2, previous_response_id=response.id
        )
    assert missing.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert sdk.responses.retrieve(response.id).id == response.id


def test_a_response_not_stored_is_gone_once_it_ended(sdk: openai.OpenAI) -> None:
    response = sdk.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    assert response.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(response.id)


def test_fields_that_cannot_be_honoured_are_refused_by_name(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(model="tiny", input="x", tools=[{"type": "web_search"}])
    assert refused.value.body["param"] == "tools[0].type"  # type: ignore[index]


def test_the_documented_example_works_when_pasted(stack: Stack, tmp_path: Path) -> None:
    pasted = paste_design_snippet("responses-snippet", stack, tmp_path, timeout=60)
    assert pasted.returncode == 0, pasted.stderr
    assert "response.completed" in pasted.stdout or "response.incomplete" in pasted.stdout


@pytest.fixture(scope="module")
def two_replicas(
    infra: Endpoints, template_database: str, tiny_model_dir: Path
) -> Iterator[tuple[Stack, Services]]:
    replicas = {"admission": 2}
    with running_stack(infra, template_database, tiny_model_dir, replicas=replicas) as started:
        yield started


@pytest.mark.timeout(300)
def test_background_responses_outlive_their_admission_and_every_restart(
    two_replicas: tuple[Stack, Services],
) -> None:
    stack, services = two_replicas
    key = stack.tenant_key("responses-replicas")

    def clients() -> list[openai.OpenAI]:
        return [
            openai.OpenAI(base_url=f"{p.endpoints['http']}/v1", api_key=key, max_retries=0)
            for p in services.of("admission")
        ]

    first, second = clients()
    with engine_suspended(stack):
        running = first.responses.create(
            model="tiny",
            input="A long story",
            background=True,
            max_output_tokens=400,
            extra_headers={"x-tollgate-disconnect-grace": "0.2"},
            **LONG,
        )
        # The replica that admitted it dies: past a lease and the grace, the replica
        # started again would cancel a run its client left; this one goes on.
        kill(services, "admission").restart()
        time.sleep(LEASE_SECONDS + 1.0)
    assert wait_ended(second, running.id).status == "incomplete"
    ended = wait_ended(first, running.id)

    for process in reversed(list(services.processes.values())):
        process.stop()
    for process in services.processes.values():
        process.restart()

    for client in clients():
        assert client.responses.retrieve(running.id).output_text == ended.output_text
        whole = checked(client.responses.retrieve(running.id, stream=True))
        n = next(i for i, e in enumerate(whole) if e.type == "response.content_part.added")
        after = whole[n].sequence_number
        tail = checked(client.responses.retrieve(running.id, stream=True, starting_after=after))
        assert [e.to_dict() for e in tail] == [e.to_dict() for e in whole[n + 1 :]]
        assert client.responses.cancel(running.id).status == "incomplete"
    after = second.responses.create(
        model="tiny", input="And then?", max_output_tokens=4, previous_response_id=running.id
    )
    assert after.usage is not None and ended.usage is not None
    assert after.usage.input_tokens > ended.usage.input_tokens


def delta_text(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def others(events: list[Any]) -> list[dict[str, Any]]:
    return [e.to_dict() for e in events if e.type != "response.output_text.delta"]
