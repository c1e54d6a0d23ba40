"""OpenAI's Files and Batch API routes: `/v1/files` (upload, list, retrieve, content,
delete) and `/v1/batches` (create, retrieve, cancel, list), in front of the same keys and
runs as the completion routes. `services.admission.batches` drives the batches.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict

from services.admission.batch_store import (
    NewBatch,
    create_batch,
    find_batch,
    line_counts,
    list_batches,
    move,
)
from services.admission.batches import notify_driver
from services.admission.file_store import (
    NewFile,
    delete_file,
    find_file,
    list_files,
    read_chunks,
    write_chunk,
    write_file,
)
from services.admission.gateway import Gateway
from services.admission.http.batches_api import (
    CHUNK_BYTES,
    COMPLETION_WINDOW,
    ENDPOINTS,
    WINDOW_SECONDS,
    InputCheck,
    batch_object,
    file_object,
    list_object,
    metadata_violations,
)
from services.admission.http.guard import BodyTooLarge, Credentials
from services.admission.http.limits import MAX_FILE_BYTES
from services.core.auth import Principal
from services.core.errors import FieldViolation, InvalidArgument, NotFound
from services.core.validation import shown, text_violation

MAX_FILENAME = 255


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, Any] | None = None


class BatchesApi:
    def __init__(
        self, gateway: Gateway, principal_of: Callable[[Request], Awaitable[Principal]]
    ) -> None:
        self.gateway = gateway
        self.db = gateway.db
        self.principal_of = principal_of

    def route(self, app: FastAPI) -> None:
        app.post("/v1/files")(self.upload)
        app.get("/v1/files")(self.files)
        app.get("/v1/files/{file_id}")(self.file)
        app.get("/v1/files/{file_id}/content", response_model=None)(self.content)
        app.delete("/v1/files/{file_id}")(self.delete_file)
        app.post("/v1/batches")(self.create)
        app.get("/v1/batches")(self.batches)
        app.get("/v1/batches/{batch_id}")(self.batch)
        app.post("/v1/batches/{batch_id}/cancel")(self.cancel)

    async def upload(
        self,
        request: Request,
        credentials: Credentials,
        file: UploadFile,
        purpose: Annotated[str, Form()],
    ) -> JSONResponse:
        """Keeps a batch input file, every line checked first; a file with a bad line is
        refused whole (400, naming the lines)."""
        tenant_id = await self._tenant(request)
        if purpose != "batch":
            why = "must be batch (the only purpose a file may be uploaded for here)"
            raise InvalidArgument([FieldViolation("purpose", why)])
        filename = file.filename or "upload.jsonl"
        bad_name = text_violation("file.filename", filename, MAX_FILENAME)
        if bad_name is not None:
            raise InvalidArgument([bad_name])
        models = self.gateway.catalog.usable_by(await self.principal_of(request))
        check = InputCheck(self.gateway.config.limits, [m.name for m in models])
        new = NewFile(tenant_id, purpose, filename).with_id()
        async with self.db.begin() as conn:
            size, number = 0, 0
            while chunk := await file.read(CHUNK_BYTES):
                if size + len(chunk) > MAX_FILE_BYTES:
                    raise BodyTooLarge(MAX_FILE_BYTES, "the file", "file")
                check.feed(chunk)
                if not check.violations:
                    await write_chunk(conn, new.file_id, number, chunk)
                size, number = size + len(chunk), number + 1
            check.finish()
            if check.violations:
                raise InvalidArgument(check.violations)
            kept = replace(new, lines=check.lines, endpoints=sorted(check.endpoints))
            row = await write_file(conn, kept, size)
        return JSONResponse(file_object(row))

    async def files(
        self,
        request: Request,
        credentials: Credentials,
        purpose: str | None = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any]:
        tenant_id = await self._tenant(request)
        rows, more = await list_files(self.db, tenant_id, purpose, after, limit, order)
        return list_object([file_object(row) for row in rows], more)

    async def file(self, file_id: str, request: Request, credentials: Credentials) -> Any:
        return file_object(await self._file(request, file_id))

    async def content(
        self, file_id: str, request: Request, credentials: Credentials
    ) -> StreamingResponse:
        row = await self._file(request, file_id)
        return StreamingResponse(
            read_chunks(self.db, row["file_id"]),
            media_type="application/octet-stream",
            headers={"content-length": str(row["bytes"])},
        )

    async def delete_file(
        self, file_id: str, request: Request, credentials: Credentials
    ) -> dict[str, Any]:
        row = await self._file(request, file_id)
        await delete_file(self.db, row["tenant_id"], row["file_id"])
        return {"id": row["file_id"], "object": "file", "deleted": True}

    async def create(
        self, body: BatchRequest, request: Request, credentials: Credentials
    ) -> dict[str, Any]:
        tenant_id = await self._tenant(request)
        principal = await self.principal_of(request)
        found = metadata_violations(body.metadata)
        if body.endpoint not in ENDPOINTS:
            found.append(FieldViolation("endpoint", f"must be one of {', '.join(ENDPOINTS)}"))
        if body.completion_window != COMPLETION_WINDOW:
            found.append(FieldViolation("completion_window", f"must be {COMPLETION_WINDOW}"))
        if found:
            raise InvalidArgument(found)
        source = await find_file(self.db, tenant_id, body.input_file_id)
        if source is None or source["purpose"] != "batch":
            why = f"no file {shown(body.input_file_id)} uploaded with purpose batch"
            raise InvalidArgument([FieldViolation("input_file_id", why)])
        others = [url for url in source["endpoints"] if url != body.endpoint]
        if others:
            why = f"the file's lines ask {', '.join(others)}, not the batch's endpoint"
            raise InvalidArgument([FieldViolation("endpoint", why)])
        new = NewBatch(
            tenant_id,
            principal.key_id or "",
            body.endpoint,
            body.input_file_id,
            body.completion_window,
            WINDOW_SECONDS,
            source["lines"],
            body.metadata,
        )
        row = await create_batch(self.db, new)
        await self._wake()
        return batch_object(row, None)

    async def batches(
        self,
        request: Request,
        credentials: Credentials,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        after: str | None = None,
    ) -> dict[str, Any]:
        tenant_id = await self._tenant(request)
        rows, more = await list_batches(self.db, tenant_id, after, limit)
        counts = await line_counts(self.db, [row["batch_id"] for row in rows])
        data = [batch_object(row, counts.get(row["batch_id"])) for row in rows]
        return list_object(data, more)

    async def batch(self, batch_id: str, request: Request, credentials: Credentials) -> Any:
        row = await self._batch(request, batch_id)
        counts = await line_counts(self.db, [batch_id])
        return batch_object(row, counts.get(batch_id))

    async def cancel(self, batch_id: str, request: Request, credentials: Credentials) -> Any:
        """Cancels the batch unless it ended; its runs are cancelled, and what they
        finished is in its output file once it is `cancelled`."""
        row = await self._batch(request, batch_id)
        moved = await move(self.db, batch_id, ["validating", "in_progress"], "cancelling")
        if moved is not None:
            await self._wake()
        counts = await line_counts(self.db, [batch_id])
        current = moved or await self._batch(request, row["batch_id"])
        return batch_object(current, counts.get(batch_id))

    async def _tenant(self, request: Request) -> str:
        principal: Principal = await self.principal_of(request)
        assert principal.tenant_id is not None
        return principal.tenant_id

    async def _file(self, request: Request, file_id: str) -> Any:
        row = await find_file(self.db, await self._tenant(request), file_id)
        if row is None:
            raise NotFound(f"file {shown(file_id)} not found")
        return row

    async def _batch(self, request: Request, batch_id: str) -> Any:
        row = await find_batch(self.db, await self._tenant(request), batch_id)
        if row is None:
            raise NotFound(f"batch {shown(batch_id)} not found")
        return row

    async def _wake(self) -> None:
        async with self.db.begin() as conn:
            await notify_driver(conn)
