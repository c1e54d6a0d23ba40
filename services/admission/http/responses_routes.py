"""OpenAI's Responses API routes: `/v1/responses` and a response by its id (retrieve,
stream and resume, cancel, delete, input items), in front of the same `Gateway` as the
completion routes.

A background response's run is detached: no client's disconnect cancels it, and any
admission replica serves it from the database, during its run and after, until the
retention (`TOLLGATE_RESPONSES_RETENTION`) is over. A `store: false` response is not
retrievable once it ended.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from services.admission.gateway import Gateway
from services.admission.http.guard import Credentials
from services.admission.http.response_view import ResponseView, output_turns, past, replay
from services.admission.http.responses import error_body
from services.admission.http.responses_api import (
    ResponseRequest,
    response_param_names,
    response_params,
    run_id_of,
    turn_json,
    turn_of,
    with_ids,
)
from services.admission.http.sse import sse_response, until_disconnect
from services.admission.requests import ChatTurn
from services.admission.response_store import (
    ResponseRecord,
    delete_response,
    find_response,
    save_response,
)
from services.admission.run_store import get_visible_run
from services.core.auth import Principal, require_model
from services.core.errors import FieldViolation, InvalidArgument, NotFound
from services.core.live import MAX_SEQ, Position
from services.core.runs import StoredEvent, is_terminal
from services.core.validation import shown


class ResponsesApi:
    def __init__(
        self,
        gateway: Gateway,
        principal_of: Callable[[Request], Awaitable[Principal]],
        retention_seconds: float,
    ) -> None:
        self.gateway = gateway
        self.principal_of = principal_of
        self.retention_seconds = retention_seconds

    def route(self, app: FastAPI) -> None:
        app.post("/v1/responses", response_model=None)(self.create)
        app.get("/v1/responses/{response_id}", response_model=None)(self.retrieve)
        app.post("/v1/responses/{response_id}/cancel")(self.cancel)
        app.delete("/v1/responses/{response_id}")(self.delete)
        app.get("/v1/responses/{response_id}/input_items")(self.input_items)

    async def create(
        self, body: ResponseRequest, request: Request, credentials: Credentials
    ) -> Response:
        """Starts a response; streamed, answered whole, or (background) answered queued."""
        request.state.param_names = response_param_names(body)
        principal = await self.principal_of(request)
        tenant_id = principal.tenant_id
        assert tenant_id is not None
        previous: tuple[ChatTurn, ...] = ()
        if body.previous_response_id is not None:
            try:
                previous = await self._conversation(principal, body.previous_response_id)
            except NotFound as missing:
                body_json = error_body(
                    missing.message, "invalid_request_error", "previous_response_id", "not_found"
                )
                return JSONResponse(body_json, 404)
        translated = response_params(body, request.headers, self.gateway.config.limits, previous)
        params = translated.params
        require_model(principal, params.model)
        started = await self.gateway.start(tenant_id, params, principal.key_id or "")
        run_id = started.run_id
        record = ResponseRecord(
            run_id,
            tenant_id,
            translated.request,
            with_ids(translated.input_items, run_id),
            [turn_json(turn) for turn in translated.conversation],
        )
        await save_response(self.gateway.db, record)
        view = ResponseView(record, params.model)
        headers = {"x-request-id": run_id, **started.rate_limits}
        if body.background and not body.stream:
            known = started.stored or tuple(await self.gateway.store.read(run_id))
            for event in known:
                view.events(event)
            return JSONResponse(view.body(), headers=headers)
        events = await self.gateway.follow(
            principal, run_id, Position(0), True, known=started.stored, live=body.stream
        )
        if body.stream:
            return sse_response(_frames(events, view, -1), run_id, started.rate_limits)
        await until_disconnect(request, _fold(events, view))
        return JSONResponse(view.body(), headers=headers)

    async def retrieve(
        self,
        response_id: str,
        request: Request,
        credentials: Credentials,
        stream: bool = False,
        starting_after: Annotated[int | None, Query(ge=0, le=MAX_SEQ)] = None,
    ) -> Response:
        """The response as it stands; with `stream`, its events after `starting_after`
        (exclusive; none: from the start), then live until it ends."""
        principal = await self.principal_of(request)
        record, view, model = await self._load(principal, response_id)
        if not stream:
            return JSONResponse(view.body(), headers={"x-request-id": record.run_id})
        events = await self.gateway.follow(principal, record.run_id, Position(0), True, live=True)
        after = -1 if starting_after is None else starting_after
        return sse_response(_frames(events, ResponseView(record, model), after), record.run_id)

    async def cancel(
        self, response_id: str, request: Request, credentials: Credentials
    ) -> JSONResponse:
        """Cancels the response unless it ended; cancelling twice is harmless."""
        principal = await self.principal_of(request)
        record, _, _ = await self._load(principal, response_id)
        run = await get_visible_run(self.gateway.store, principal, record.run_id)
        await self.gateway.canceller.cancel(run, "cancelled by client")
        _, view, _ = await self._load(principal, response_id, ended_too=True)
        return JSONResponse(view.body(), headers={"x-request-id": record.run_id})

    async def delete(
        self, response_id: str, request: Request, credentials: Credentials
    ) -> JSONResponse:
        principal = await self.principal_of(request)
        record, _, _ = await self._load(principal, response_id, ended_too=True)
        await delete_response(self.gateway.db, record.tenant_id, record.run_id)
        answer = {"id": response_id, "object": "response", "deleted": True}
        return JSONResponse(answer, headers={"x-request-id": record.run_id})

    async def input_items(
        self,
        response_id: str,
        request: Request,
        credentials: Credentials,
        order: Literal["asc", "desc"] = "desc",
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        after: str | None = None,
    ) -> JSONResponse:
        """The response's input items, newest first unless `order` is `asc`."""
        principal = await self.principal_of(request)
        record, _, _ = await self._load(principal, response_id)
        items = list(record.input_items)
        if order == "desc":
            items.reverse()
        ids = [item["id"] for item in items]
        if after is not None:
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[:limit]
        answer = {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else "",
            "last_id": page[-1]["id"] if page else "",
            "has_more": len(items) > limit,
        }
        return JSONResponse(answer, headers={"x-request-id": record.run_id})

    async def _load(
        self, principal: Principal, response_id: str, *, ended_too: bool = False
    ) -> tuple[ResponseRecord, ResponseView, str]:
        """The tenant's response and its view from the run's stored events; NotFound for
        another tenant's, a deleted one, one past the retention, and (unless `ended_too`)
        one not stored that ended."""
        missing = NotFound(f"response {shown(response_id)} not found")
        run_id = run_id_of(response_id)
        try:
            run = await get_visible_run(self.gateway.store, principal, run_id)
        except NotFound:
            raise missing from None
        assert principal.tenant_id is not None
        record = await find_response(
            self.gateway.db, principal.tenant_id, run_id, self.retention_seconds
        )
        if record is None:
            raise missing
        view, _ = replay(record, run.model, await self.gateway.store.read(run_id))
        if view.ended and not record.stored and not ended_too:
            raise missing
        return record, view, run.model

    async def _conversation(self, principal: Principal, response_id: str) -> tuple[ChatTurn, ...]:
        """A previous response's conversation and its answer, for the next turn; one still
        going is refused, its answer unknown."""
        record, view, _ = await self._load(principal, response_id)
        if not view.ended:
            why = f"response {shown(response_id)} is still {view.status}"
            raise InvalidArgument([FieldViolation("previous_response_id", why)])
        return (*(turn_of(turn) for turn in record.conversation), *output_turns(view))


async def _frames(
    events: AsyncIterator[StoredEvent], view: ResponseView, after: int
) -> AsyncIterator[bytes]:
    """The response's SSE frames past `after`, each its event's type and JSON."""
    async for event in events:
        for translated in past(view.events(event), after):
            yield _frame(translated)


async def _fold(events: AsyncIterator[StoredEvent], view: ResponseView) -> None:
    async for event in events:
        view.events(event)
        if is_terminal(event.kind):
            return


def _frame(event: dict[str, Any]) -> bytes:
    data = json.dumps(event, separators=(",", ":"))
    return f"id: {event['sequence_number']}\nevent: {event['type']}\ndata: {data}\n\n".encode()
