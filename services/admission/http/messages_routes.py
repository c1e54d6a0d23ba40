"""Anthropic's Messages API routes: `POST /v1/messages` and `POST /v1/messages/count_tokens`,
in front of the same `Gateway` as the completion routes. A stream asked again with the same
`Idempotency-Key` and a `Last-Event-ID` goes on after that seq."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import FastAPI, Header, Request
from fastapi.responses import Response

from services.admission.catalog import ModelEntry
from services.admission.gateway import Gateway
from services.admission.http import anthropic, anthropic_answers
from services.admission.http.anthropic import (
    CountTokensRequest,
    MessagesRequest,
    count_params,
    message_params,
)
from services.admission.http.guard import Credentials
from services.admission.http.sse import (
    resume_point,
    resumed_frames,
    sse_response,
    until_disconnect,
    until_terminal,
    whole_answer,
)
from services.admission.requests import field_violations
from services.core.auth import Principal, require_model
from services.core.errors import InvalidArgument, NotFound
from services.core.live import Position
from services.core.telemetry import bound_log_context


class MessagesApi:
    def __init__(
        self, gateway: Gateway, principal_of: Callable[[Request], Awaitable[Principal]]
    ) -> None:
        self.gateway = gateway
        self.principal_of = principal_of

    def route(self, app: FastAPI) -> None:
        app.post("/v1/messages", response_model=None)(self.messages)
        app.post("/v1/messages/count_tokens")(self.count_tokens)

    async def messages(
        self,
        body: MessagesRequest,
        request: Request,
        credentials: Credentials,
        last_event_id: Annotated[str | None, Header(description="resume after this seq")] = None,
    ) -> Response:
        """Anthropic's message, answered whole or streamed as its events."""
        request.state.param_names = anthropic.param_names(body)
        principal = await self.principal_of(request)
        after = resume_point(last_event_id, 0)
        params = message_params(body, request.headers, self.gateway.config.limits)
        self._model(principal, params.model)
        assert principal.tenant_id is not None
        started = await self.gateway.start(principal.tenant_id, params, principal.key_id or "")
        sampling = params.sampling
        message = anthropic_answers.Message(
            started.run_id, params.model, sampling.structure.calls_tools, sampling.stop
        )
        events = await self.gateway.follow(
            principal, started.run_id, Position(0), True, known=started.stored, live=body.stream
        )
        if body.stream:
            frames = resumed_frames(events, after, message.frames)
            return sse_response(
                frames, started.run_id, started.rate_limits, anthropic_answers.error_frame
            )
        with bound_log_context(run_id=started.run_id, tenant_id=principal.tenant_id):
            ended = await until_disconnect(request, until_terminal(events, message))
        headers = {"x-request-id": started.run_id, **started.rate_limits}
        return whole_answer(request.url.path, ended, message.body, headers)

    async def count_tokens(
        self, body: CountTokensRequest, request: Request, credentials: Credentials
    ) -> dict[str, int]:
        """The input tokens a message request would take, its tools as the model's chat
        template shows them."""
        request.state.param_names = anthropic.param_names(body)
        principal = await self.principal_of(request)
        limits = self.gateway.config.limits
        params = self.gateway.catalog.with_tool_format(count_params(body, limits))
        entry = self._model(principal, params.model)
        violations = field_violations(params, [entry.name], limits)
        if violations:
            raise InvalidArgument(violations)
        return {"input_tokens": len(await asyncio.to_thread(entry.prompt_token_ids, params))}

    def _model(self, principal: Principal, name: str) -> ModelEntry:
        """The model the request names; PermissionDenied when the key may not use it,
        NotFound when there is none of that name."""
        require_model(principal, name)
        entry = self.gateway.catalog.find(principal, name)
        if entry is None:
            raise NotFound(f"model: {name[:64]!r} not found")
        return entry
