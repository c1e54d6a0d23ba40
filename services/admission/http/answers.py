"""A run's whole answer in its endpoint's shape, folded from its stored events: the
completion routes build their `Completion` here, and a batch's lines become lines of its
output or error file here.

A line's run that completed is a line of the output file: `response.status_code` 200 and
the endpoint's body. A run that failed is a line of the error file with the error body it
would have been answered with (`status_code` 500); a request refused when its run was to
start (a prompt over the model's context, say) with the refusal's status and body; one
that never ran, or whose run the batch's cancelling or expiry stopped, with only an
`error` (`batch_cancelled`, `batch_expired`), as OpenAI's error files give them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

from services.admission.http.batches_api import BatchLine, LineRequest
from services.admission.http.requests import ChatCompletionRequest, CompletionRequest
from services.admission.http.response_view import ResponseView
from services.admission.http.responses import Completion, TokenBytes, run_failure
from services.admission.http.responses_api import turn_json, with_ids
from services.admission.requests import GenerateParams
from services.admission.response_store import ResponseRecord
from services.core.runs import RunState, StoredEvent, is_terminal

BATCH_CANCELLED = "batch_cancelled"
BATCH_EXPIRED = "batch_expired"
STOPPED = {
    BATCH_CANCELLED: "the batch was cancelled before this request completed",
    BATCH_EXPIRED: "the batch's completion window ended before this request completed",
}


def completion_for(
    params: GenerateParams,
    run_id: str,
    body: ChatCompletionRequest | CompletionRequest,
    token_bytes: TokenBytes,
) -> Completion:
    """The completion a chat or text completion request's run answers with."""
    sampling = params.sampling
    echo = isinstance(body, CompletionRequest) and bool(body.echo)
    return Completion(
        bool(params.messages),
        run_id,
        params.model,
        include_usage=body.stream_options is not None and body.stream_options.include_usage,
        tools=sampling.structure.calls_tools,
        token_bytes=token_bytes if sampling.logprobs else None,
        n=sampling.n,
        echo=params.prompt if echo else None,
    )


def line_id(batch_id: str, custom_id: str) -> str:
    digest = hashlib.sha256(f"{batch_id}\n{custom_id}".encode()).hexdigest()
    return f"batch_req_{digest[:32]}"


def answered_line(
    batch_id: str,
    line: BatchLine,
    request: LineRequest,
    run_id: str,
    tenant_id: str,
    events: Iterable[StoredEvent],
    token_bytes: TokenBytes,
    stopped: str,
) -> tuple[bool, dict[str, Any]]:
    """Whether the line's run completed, and its line of the output file (True) or of the
    error file; `stopped` names why a run that was cancelled stopped (none: it was
    cancelled on its own, answered as its route answers that)."""
    ended: StoredEvent | None = None
    body: dict[str, Any]
    if request.translated is not None:
        view = ResponseView(_response_record(request, run_id, tenant_id), request.params.model)
        for event in events:
            view.events(event)
            ended = event if is_terminal(event.kind) else ended
        body = view.body()
    else:
        assert isinstance(request.body, ChatCompletionRequest | CompletionRequest)
        completion = completion_for(request.params, run_id, request.body, token_bytes)
        for event in events:
            completion.add(event)
            ended = event if is_terminal(event.kind) else ended
        body = completion.body() if ended is not None else {}
    if ended is None or (ended.kind == RunState.CANCELLED and stopped):
        return False, stopped_line(batch_id, line.custom_id, stopped or BATCH_CANCELLED)
    failure = run_failure(ended)
    if failure is not None:
        status = 409 if ended.kind == RunState.CANCELLED else 500
        return False, output_line(batch_id, line.custom_id, run_id, status, failure)
    return True, output_line(batch_id, line.custom_id, run_id, 200, body)


def output_line(
    batch_id: str, custom_id: str, request_id: str, status: int, body: Mapping[str, Any]
) -> dict[str, Any]:
    response = {"status_code": status, "request_id": request_id, "body": dict(body)}
    return {
        "id": line_id(batch_id, custom_id),
        "custom_id": custom_id,
        "response": response,
        "error": None,
    }


def stopped_line(batch_id: str, custom_id: str, code: str) -> dict[str, Any]:
    return {
        "id": line_id(batch_id, custom_id),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": STOPPED[code]},
    }


def _response_record(request: LineRequest, run_id: str, tenant_id: str) -> ResponseRecord:
    translated = request.translated
    assert translated is not None
    return ResponseRecord(
        run_id,
        tenant_id,
        translated.request,
        with_ids(translated.input_items, run_id),
        [turn_json(turn) for turn in translated.conversation],
    )
