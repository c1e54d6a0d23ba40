"""What every HTTP request meets between uvicorn and the routes, before FastAPI reads its
body: the OpenAI API's routes (`/v1/...`) check the key first, so a caller without one is
answered (401, or 429 past the failed-authentication limit) with no byte of its body
read; then the body is read, at most `max_body_bytes` of it (413 past that, by its
`content-length` or as it streams), and their JSON nested deeper than `max_json_depth`
is refused (400 naming `body`) before a recursive parser sees it. Other routes (the
console checks its own secrets, and parses no body) are refused a body declared over the
bound, and never have theirs buffered here."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Annotated

from fastapi import Depends
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.admission.gateway import Gateway
from services.admission.http.anthropic_answers import shaped_for
from services.admission.http.limits import MAX_JSON_DEPTH, HttpLimits
from services.admission.http.responses import HttpError, error_body, http_error
from services.core.auth import Principal
from services.core.errors import (
    FieldViolation,
    InvalidArgument,
    as_api_error,
    count_rejection,
)

API_PREFIX = "/v1/"
# The route whose body (a file, multipart) streams to it unbuffered, bounded apart.
UPLOAD_PATH = "/v1/files"
# A route's key, declared for the OpenAPI document; `RequestGuard` checks it as gRPC's is.
bearer = HTTPBearer(auto_error=False, description="a Tollgate API key")
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
TO_BRACKETS = bytes.maketrans(b"{}", b"[]")
NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')


class BodyTooLarge(HTTPException):
    """An HTTP exception, so that one raised while FastAPI parses a form reaches the
    app's handler as it is."""

    def __init__(self, limit: int, what: str = "the request body", param: str = "body") -> None:
        super().__init__(413, f"{what} is over {limit} bytes")
        self.param = param


def too_large(error: BodyTooLarge) -> HttpError:
    body = error_body(error.detail, "invalid_request_error", error.param, "request_too_large")
    return HttpError(413, body, {"connection": "close"})


class RequestGuard:
    """ASGI middleware: authenticates `/v1/` requests (the principal goes to
    `scope["state"]["principal"]` for the handlers), then reads and bounds the body and
    hands it on whole."""

    def __init__(
        self, app: ASGIApp, gateway: Gateway, limits: HttpLimits, routes: Sequence[BaseRoute]
    ) -> None:
        self.app = app
        self.gateway = gateway
        self.limits = limits
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        body: bytes | None = None
        streamed = False
        is_api = scope["path"].startswith(API_PREFIX)
        if not is_api and _declared_length(headers) <= self.limits.max_body_bytes:
            # Not buffered here: no route outside the API reads a body, and what nobody
            # reads stays in the socket (uvicorn stops reading past its high-water mark).
            await self.app(scope, receive, send)
            return
        try:
            if is_api:
                principal = await scope_principal(self.gateway, scope)
                scope.setdefault("state", {})["principal"] = principal
            if is_api and _is_upload(scope):
                # A file: not buffered here, bounded as it streams to its route's parser.
                limit = self.limits.max_upload_bytes
                if _declared_length(headers) > limit:
                    raise BodyTooLarge(limit)
                streamed = True
            else:
                body = await self._body(headers, receive)
                if body is None:
                    return  # the client left before its body came: nobody to answer
            if (
                body is not None
                and is_api
                and not is_nested_within(body, self.limits.max_json_depth)
            ):
                depth = self.limits.max_json_depth
                raise InvalidArgument(
                    [FieldViolation("body", f"send JSON nested at most {depth} levels deep")]
                )
        except Exception as error:
            # Answered before the body was read, the connection closes: uvicorn would
            # otherwise read the rest of the body to reach the next request.
            close = body is None and _has_body(headers)
            await self._refuse(
                error, {"connection": "close"} if close else {}, scope, receive, send
            )
            return
        if streamed:
            await self.app(scope, _bounded(receive, self.limits.max_upload_bytes), send)
            return
        assert body is not None
        await self.app(scope, _replaying(body, receive), send)

    async def _refuse(
        self,
        error: Exception,
        headers: dict[str, str],
        scope: Scope,
        receive: Receive,
        send: Send,
    ) -> None:
        if isinstance(error, BodyTooLarge):
            answer = too_large(error)
        else:
            route = self._route(scope)
            api_error = as_api_error(route, error)
            count_rejection(route, api_error)
            answer = http_error(api_error)
        # The API the path belongs to says how its errors read.
        answer = shaped_for(scope["path"], answer)
        response = JSONResponse(answer.body, answer.status, {**answer.headers, **headers})
        await response(scope, receive, send)

    async def _body(self, headers: Headers, receive: Receive) -> bytes | None:
        """The whole body, read as it streams, never more than the limit of it; None when
        the client disconnects first."""
        limit = self.limits.max_body_bytes
        if _declared_length(headers) > limit:
            raise BodyTooLarge(limit)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _route(self, scope: Scope) -> str:
        """The route's path template, for the rejections metric."""
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return str(getattr(route, "path", "unknown"))
        return "unknown"


async def scope_principal(gateway: Gateway, scope: Scope) -> Principal:
    """The tenant key the request's `authorization` header names (else its `x-api-key`,
    as Anthropic's clients send it), its failures counted against the transport peer (or
    the client a trusted proxy names)."""
    headers = Headers(scope=scope)
    header = headers.get("authorization", "")
    if not header and "x-api-key" in headers:
        header = f"Bearer {headers['x-api-key']}"
    client = scope.get("client")
    peer = client[0] if client else ""
    return await gateway.principal([("authorization", header)], peer)


def is_nested_within(body: bytes, max_depth: int) -> bool:
    """Whether the JSON in `body` nests arrays and objects at most `max_depth` deep, told
    without a parser (which recurses once per level), in a few passes over the bytes.
    Brackets in strings do not count; brackets that do not pair up, or a string left
    open (never valid JSON), answer False too."""
    # Escaped backslashes, then escaped quotes, go: each quote left opens or closes a string.
    plain = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Only quotes and brackets are left; `""` (an empty string, or two strings meeting)
    # goes too, so only strings holding brackets are left for the pattern to skip.
    shape = plain.translate(TO_BRACKETS, NOT_STRUCTURE).replace(b'""', b"")
    return _nesting(max_depth).fullmatch(shape) is not None


@functools.cache
def _nesting(max_depth: int) -> re.Pattern[bytes]:
    """Strings and paired brackets, at most `max_depth` deep; possessive, so matching
    never backtracks."""
    if not 0 < max_depth <= MAX_JSON_DEPTH:
        raise ValueError(f"a JSON depth is between 1 and {MAX_JSON_DEPTH}, got {max_depth}")
    string = rb'"[^"]*+"'
    pattern = rb"(?:" + string + rb")*+"
    for _ in range(max_depth):
        pattern = rb"(?:" + string + rb"|\[" + pattern + rb"\])*+"
    return re.compile(pattern)


def _has_body(headers: Headers) -> bool:
    return "transfer-encoding" in headers or _declared_length(headers) > 0


def _declared_length(headers: Headers) -> int:
    """The `content-length`; 0 when there is none (uvicorn's parser refused bad ones)."""
    raw = headers.get("content-length", "")
    if not (raw.isascii() and raw.isdigit()):
        return 0
    return int(raw) if len(raw) < 20 else 2**63


def _is_upload(scope: Scope) -> bool:
    return scope["method"] == "POST" and scope["path"] == UPLOAD_PATH


def _bounded(receive: Receive, limit: int) -> Receive:
    """`receive`, raising BodyTooLarge once the body it gave is over `limit` bytes."""
    size = 0

    async def bounded() -> Message:
        nonlocal size
        message = await receive()
        size += len(message.get("body", b""))
        if size > limit:
            raise BodyTooLarge(limit)
        return message

    return bounded


def _replaying(body: bytes, receive: Receive) -> Receive:
    """`receive` with the body, already read, given back first."""
    pending = [body]

    async def replay() -> Message:
        if pending:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}
        return await receive()

    return replay
