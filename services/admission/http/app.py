"""The OpenAI-compatible HTTP front door: routes that translate between HTTP and admission's
`Gateway`, as the gRPC servicer does for protobuf. Same keys, same runs, same rules."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Annotated, Any

from fastapi import FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.admission.catalog import ModelEntry
from services.admission.gateway import Gateway
from services.admission.http.answers import completion_for
from services.admission.http.anthropic_answers import shaped_for
from services.admission.http.batches_routes import BatchesApi
from services.admission.http.guard import (
    BodyTooLarge,
    Credentials,
    RequestGuard,
    scope_principal,
    too_large,
)
from services.admission.http.limits import DEFAULT_LIMITS, HttpLimits
from services.admission.http.messages_routes import MessagesApi
from services.admission.http.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_params,
    completion_params,
    param_names,
    param_path,
)
from services.admission.http.responses import (
    Completion,
    HttpError,
    error_body,
    event_json,
    http_error,
    run_json,
    sse_frame,
)
from services.admission.http.responses_routes import ResponsesApi
from services.admission.http.sse import (
    resume_point,
    sse_response,
    until_disconnect,
    until_terminal,
    whole_answer,
)
from services.admission.requests import GenerateParams, Limits
from services.admission.run_store import get_visible_run
from services.core.auth import Principal, require_model
from services.core.errors import (
    ApiError,
    FieldViolation,
    InvalidArgument,
    NotFound,
    as_api_error,
    count_rejection,
)
from services.core.live import MAX_SEQ, Position, event_id
from services.core.runs import StoredEvent
from services.core.telemetry import bound_log_context

NOT_JSON = "send a JSON object, with content-type: application/json"


def create_app(gateway: Gateway, limits: HttpLimits = DEFAULT_LIMITS) -> FastAPI:
    app = FastAPI(
        title="Tollgate",
        summary="OpenAI-compatible completions with resumable streams",
        docs_url=None,
        redoc_url=None,
    )
    api = HttpApi(gateway)
    app.post("/v1/chat/completions", response_model=None)(api.chat_completions)
    app.post("/v1/completions", response_model=None)(api.completions)
    app.get("/v1/models")(api.list_models)
    app.get("/v1/models/{model}")(api.get_model)
    app.get("/v1/runs/{run_id}")(api.get_run)
    app.post("/v1/runs/{run_id}/cancel")(api.cancel_run)
    app.get("/v1/runs/{run_id}/events", response_model=None)(api.run_events)
    MessagesApi(gateway, api._principal).route(app)
    ResponsesApi(gateway, api._principal, limits.responses_retention).route(app)
    BatchesApi(gateway, api._principal).route(app)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_exception)
    app.add_exception_handler(Exception, _unexpected_error)
    # Added last, RequestId is outermost: the guard's refusals get an x-request-id too.
    app.add_middleware(RequestGuard, gateway=gateway, limits=limits, routes=app.router.routes)
    app.add_middleware(RequestId)
    return app


class HttpApi:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def chat_completions(
        self,
        body: ChatCompletionRequest,
        request: Request,
        credentials: Credentials,
    ) -> Response:
        return await self._complete(
            request, body, lambda: chat_params(body, request.headers, self._limits)
        )

    async def completions(
        self,
        body: CompletionRequest,
        request: Request,
        credentials: Credentials,
    ) -> Response:
        return await self._complete(
            request, body, lambda: completion_params(body, request.headers, self._limits)
        )

    async def list_models(
        self,
        request: Request,
        credentials: Credentials,
    ) -> dict[str, Any]:
        """The models the caller's key may use."""
        principal = await self._principal(request)
        models = self.gateway.catalog.usable_by(principal)
        return {"object": "list", "data": [_model(entry) for entry in models]}

    async def get_model(
        self,
        model: str,
        request: Request,
        credentials: Credentials,
    ) -> dict[str, Any]:
        entry = self.gateway.catalog.find(await self._principal(request), model)
        if entry is None:
            raise NotFound(f"model {model[:64]!r} not found")
        return _model(entry)

    async def get_run(
        self,
        run_id: str,
        request: Request,
        credentials: Credentials,
    ) -> JSONResponse:
        principal = await self._principal(request)
        run = await get_visible_run(self.gateway.store, principal, run_id)
        return JSONResponse(run_json(run), headers={"x-request-id": run.run_id})

    async def cancel_run(
        self,
        run_id: str,
        request: Request,
        credentials: Credentials,
    ) -> JSONResponse:
        principal = await self._principal(request)
        run = await get_visible_run(self.gateway.store, principal, run_id)
        cancelled = await self.gateway.canceller.cancel(run, "cancelled by client")
        return JSONResponse(run_json(cancelled), headers={"x-request-id": run.run_id})

    async def run_events(
        self,
        run_id: str,
        request: Request,
        credentials: Credentials,
        starting_after: Annotated[int, Query(ge=0, le=MAX_SEQ)] = 0,
        last_event_id: Annotated[str | None, Header(description="an SSE id seen last")] = None,
    ) -> StreamingResponse:
        """The run's events after `Last-Event-ID` (else `starting_after`), until `billed`."""
        principal = await self._principal(request)
        after = resume_point(last_event_id, starting_after)
        run = await get_visible_run(self.gateway.store, principal, run_id)
        events = await self.gateway.follow(
            principal, run.run_id, after, until_terminal=False, live=True
        )
        frames = (sse_frame(event_json(e), event_id(e)) async for e in events)
        return sse_response(frames, run.run_id)

    async def _principal(self, request: Request) -> Principal:
        """The caller's key, as `RequestGuard` found it before the body was read."""
        principal = request.scope.get("state", {}).get("principal")
        if isinstance(principal, Principal):
            return principal
        return await scope_principal(self.gateway, request.scope)

    @property
    def _limits(self) -> Limits:
        return self.gateway.config.limits

    async def _complete(
        self,
        request: Request,
        body: ChatCompletionRequest | CompletionRequest,
        params_of: Callable[[], GenerateParams],
    ) -> Response:
        """Authenticates, then reads the body's parameters (a 401 comes before a 400)."""
        request.state.param_names = param_names(body)
        principal = await self._principal(request)
        tenant_id = principal.tenant_id
        assert tenant_id is not None
        key_id = principal.key_id or ""
        params = params_of()
        require_model(principal, params.model)
        started = await self.gateway.start(tenant_id, params, key_id)
        tokenizer = self.gateway.catalog.get(params.model).tokenizer
        completion = completion_for(params, started.run_id, body, tokenizer.token_bytes)
        events = await self.gateway.follow(
            principal, started.run_id, Position(0), True, known=started.stored, live=body.stream
        )
        if body.stream:
            return sse_response(
                _completion_frames(events, completion), started.run_id, started.rate_limits
            )
        with bound_log_context(run_id=started.run_id, tenant_id=tenant_id):
            ended = await until_disconnect(request, until_terminal(events, completion))
        headers = {"x-request-id": started.run_id, **started.rate_limits}
        return whole_answer(request.url.path, ended, completion.body, headers)


def _model(entry: ModelEntry) -> dict[str, Any]:
    """An OpenAI model object; `root` and `parent` as vLLM gives them (an adapter's base)."""
    return {
        "id": entry.name,
        "object": "model",
        "created": 0,
        "owned_by": "tollgate",
        "root": entry.parent or entry.name,
        "parent": entry.parent or None,
    }


async def _completion_frames(
    events: AsyncIterator[StoredEvent], completion: Completion
) -> AsyncIterator[bytes]:
    async for event in events:
        for frame in completion.frames(event):
            yield frame


def _json_error(
    request: Request, error: ApiError, param_names: Mapping[str, str] | None = None
) -> JSONResponse:
    answer = shaped_for(request.url.path, http_error(error, param_names))
    return JSONResponse(answer.body, answer.status, headers=answer.headers)


async def _api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, ApiError)
    route = request.scope.get("route")
    count_rejection(getattr(route, "path", "unknown"), error)
    return _json_error(request, error, getattr(request.state, "param_names", None))


async def _validation_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, RequestValidationError)
    violations = []
    for issue in error.errors():
        loc = issue.get("loc", ())
        if issue.get("type") == "json_invalid" or tuple(loc) == ("body",):
            violations.append(FieldViolation("body", NOT_JSON))
        else:
            violations.append(FieldViolation(_param(loc), str(issue.get("msg", "invalid"))))
    violations = violations or [FieldViolation("body", NOT_JSON)]
    return _json_error(request, InvalidArgument(violations))


def _param(loc: tuple[Any, ...] | list[Any]) -> str:
    """`messages[0].content` for pydantic's ("body", "messages", 0, "content")."""
    where = loc and loc[0] in ("body", "query", "header", "path")
    path = param_path(list(loc)[1:] if where else loc)
    if loc and loc[0] == "header":
        return path.replace("_", "-")
    return path or "body"


async def _http_exception(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    body = error_body(str(error.detail), kind, None, None)
    answer = HttpError(error.status_code, body, dict(error.headers or {}))
    if isinstance(error, BodyTooLarge):
        answer = too_large(error)
    answer = shaped_for(request.url.path, answer)
    return JSONResponse(answer.body, answer.status, headers=answer.headers)


async def _unexpected_error(request: Request, error: Exception) -> Response:
    return _json_error(request, as_api_error(request.url.path, error))


class RequestId:
    """Gives every answer an `x-request-id`: the run's id where a run is named, else a new
    one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(name == b"x-request-id" for name, _ in headers):
                    headers.append((b"x-request-id", f"req_{uuid.uuid4().hex}".encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
