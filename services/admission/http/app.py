"""The OpenAI-compatible HTTP front door: routes that translate between HTTP and admission's
`Gateway`, as the gRPC servicer does for protobuf. Same keys, same runs, same rules."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.admission.catalog import ModelEntry
from services.admission.gateway import Gateway
from services.admission.http import anthropic, anthropic_answers
from services.admission.http.anthropic import (
    CountTokensRequest,
    MessagesRequest,
    count_params,
    message_params,
)
from services.admission.http.anthropic_answers import shaped_for
from services.admission.http.guard import RequestGuard, scope_principal
from services.admission.http.limits import DEFAULT_LIMITS, HttpLimits
from services.admission.http.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_params,
    completion_params,
    param_names,
)
from services.admission.http.responses import (
    Completion,
    HttpError,
    error_body,
    event_json,
    http_error,
    run_failure,
    run_json,
    sse_frame,
)
from services.admission.http.responses_routes import ResponsesApi
from services.admission.http.sse import sse_response as _sse
from services.admission.http.sse import until_disconnect as _until_disconnect
from services.admission.requests import GenerateParams, Limits, field_violations
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
from services.core.runs import RunState, StoredEvent, is_terminal
from services.core.telemetry import bound_log_context

NOT_JSON = "send a JSON object, with content-type: application/json"
MAX_SEQ = 2**63 - 1
SEQ = re.compile(r"[0-9]{1,19}")
# Declared for the OpenAPI document; the key itself is checked as gRPC's is.
bearer = HTTPBearer(auto_error=False, description="a Tollgate API key")


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
    app.post("/v1/messages", response_model=None)(api.messages)
    app.post("/v1/messages/count_tokens")(api.count_tokens)
    ResponsesApi(gateway, api._principal, limits.responses_retention).route(app)
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
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> Response:
        return await self._complete(
            request, body, lambda: chat_params(body, request.headers, self._limits)
        )

    async def completions(
        self,
        body: CompletionRequest,
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> Response:
        return await self._complete(
            request, body, lambda: completion_params(body, request.headers, self._limits)
        )

    async def list_models(
        self,
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> dict[str, Any]:
        """The models the caller's key may use."""
        principal = await self._principal(request)
        models = self.gateway.catalog.usable_by(principal)
        return {"object": "list", "data": [_model(entry) for entry in models]}

    async def get_model(
        self,
        model: str,
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> dict[str, Any]:
        entry = self.gateway.catalog.find(await self._principal(request), model)
        if entry is None:
            raise NotFound(f"model {model[:64]!r} not found")
        return _model(entry)

    async def get_run(
        self,
        run_id: str,
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> JSONResponse:
        principal = await self._principal(request)
        run = await get_visible_run(self.gateway.store, principal, run_id)
        return JSONResponse(run_json(run), headers={"x-request-id": run.run_id})

    async def cancel_run(
        self,
        run_id: str,
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> JSONResponse:
        principal = await self._principal(request)
        run = await get_visible_run(self.gateway.store, principal, run_id)
        cancelled = await self.gateway.canceller.cancel(run, "cancelled by client")
        return JSONResponse(run_json(cancelled), headers={"x-request-id": run.run_id})

    async def run_events(
        self,
        run_id: str,
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
        starting_after: Annotated[int, Query(ge=0, le=MAX_SEQ)] = 0,
        last_event_id: Annotated[str | None, Header(description="an SSE id seen last")] = None,
    ) -> StreamingResponse:
        """The run's events after `Last-Event-ID` (else `starting_after`), until `billed`."""
        principal = await self._principal(request)
        after = _resume_point(last_event_id, starting_after)
        run = await get_visible_run(self.gateway.store, principal, run_id)
        events = await self.gateway.follow(principal, run.run_id, after, until_terminal=False)
        frames = (sse_frame(event_json(e), e.seq) async for e in events)
        return _sse(frames, run.run_id)

    async def messages(
        self,
        body: MessagesRequest,
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
        last_event_id: Annotated[str | None, Header(description="resume after this seq")] = None,
    ) -> Response:
        """Anthropic's Messages API. A stream asked again with the same `Idempotency-Key`
        and a `Last-Event-ID` goes on after that seq."""
        request.state.param_names = anthropic.param_names(body)
        principal = await self._principal(request)
        after = _resume_point(last_event_id, 0)
        params = message_params(body, request.headers, self._limits)
        self._model(principal, params.model)
        assert principal.tenant_id is not None
        started = await self.gateway.start(principal.tenant_id, params, principal.key_id or "")
        sampling = params.sampling
        message = anthropic_answers.Message(
            started.run_id, params.model, sampling.structure.calls_tools, sampling.stop
        )
        events = await self.gateway.follow(principal, started.run_id, 0, True, known=started.stored)
        if body.stream:
            frames = (f async for e in events for f in message.frames(e) if e.seq > after)
            return _sse(frames, started.run_id, started.rate_limits, anthropic_answers.error_frame)
        with bound_log_context(run_id=started.run_id, tenant_id=principal.tenant_id):
            ended = await _until_disconnect(request, _last(events, message))
        headers = {"x-request-id": started.run_id, **started.rate_limits}
        return _whole(request.url.path, ended, message.body, headers)

    async def count_tokens(
        self,
        body: CountTokensRequest,
        request: Request,
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> dict[str, int]:
        """The input tokens a message request would take, its tools as the model's chat
        template shows them."""
        request.state.param_names = anthropic.param_names(body)
        principal = await self._principal(request)
        params = self.gateway.catalog.with_tool_format(count_params(body, self._limits))
        entry = self._model(principal, params.model)
        violations = field_violations(params, [entry.name], self._limits)
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
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        started = await self.gateway.start(tenant_id, params, key_id)
        sampling = params.sampling
        tokenizer = self.gateway.catalog.get(params.model).tokenizer
        completion = Completion(
            bool(params.messages),
            started.run_id,
            params.model,
            include_usage=include_usage,
            tools=sampling.structure.calls_tools,
            token_bytes=tokenizer.token_bytes if sampling.logprobs else None,
            n=sampling.n,
            echo=params.prompt if isinstance(body, CompletionRequest) and body.echo else None,
        )
        events = await self.gateway.follow(principal, started.run_id, 0, True, known=started.stored)
        if body.stream:
            return _sse(_completion_frames(events, completion), started.run_id, started.rate_limits)
        with bound_log_context(run_id=started.run_id, tenant_id=tenant_id):
            ended = await _until_disconnect(request, _last(events, completion))
        headers = {"x-request-id": started.run_id, **started.rate_limits}
        return _whole(request.url.path, ended, completion.body, headers)


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


def _resume_point(last_event_id: str | None, starting_after: int) -> int:
    if last_event_id is None:
        return starting_after
    # ASCII digits only: `isdigit()` passes superscripts, which int() refuses.
    if SEQ.fullmatch(last_event_id.strip()) and int(last_event_id) <= MAX_SEQ:
        return int(last_event_id)
    raise InvalidArgument([FieldViolation("Last-Event-ID", "must be a seq (a whole number)")])


def _whole(
    path: str,
    ended: StoredEvent | None,
    body: Callable[[], dict[str, Any]],
    headers: dict[str, str],
) -> JSONResponse:
    """The whole answer of a run that ended with `ended` (None: its client left), or the
    error it failed or was cancelled with."""
    failure = run_failure(ended) if ended is not None else None
    if failure is None:
        return JSONResponse(body(), headers=headers)
    status = 409 if ended is not None and ended.kind == RunState.CANCELLED else 500
    answer = shaped_for(path, HttpError(status, failure, headers))
    return JSONResponse(answer.body, answer.status, headers=answer.headers)


async def _completion_frames(
    events: AsyncIterator[StoredEvent], completion: Completion
) -> AsyncIterator[bytes]:
    async for event in events:
        for frame in completion.frames(event):
            yield frame


async def _last(
    events: AsyncIterator[StoredEvent], completion: Completion | anthropic_answers.Message
) -> StoredEvent:
    """Feeds the run's events into `completion` until the terminal one, which it returns."""
    async for event in events:
        completion.add(event)
        if is_terminal(event.kind):
            return event
    raise AssertionError("a run's events end with a terminal one")


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
    path = ""
    for part in list(loc)[1:] if loc and loc[0] in ("body", "query", "header", "path") else loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    if loc and loc[0] == "header":
        return path.replace("_", "-")
    return path or "body"


async def _http_exception(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    body = error_body(str(error.detail), kind, None, None)
    answer = HttpError(error.status_code, body, dict(error.headers or {}))
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
