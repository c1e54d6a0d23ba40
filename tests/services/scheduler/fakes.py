"""A fake engine worker: an WorkerService that records what the scheduler sends it."""

from __future__ import annotations

import grpc

from tollgate.v1 import worker_pb2, worker_pb2_grpc

BLOCK_SIZE = 16


class FakeWorker(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, worker_id: str, *, free_blocks: int = 64, model: str = "tiny") -> None:
        self.worker_id = worker_id
        self.model = model
        self.free_blocks = free_blocks
        self.total_blocks = max(64, free_blocks)
        self.reject = False  # answer AssignRun with RESOURCE_EXHAUSTED
        self.refuse_with: grpc.StatusCode | None = None  # or with this code
        self.assigned: list[worker_pb2.AssignRunRequest] = []
        self.rejected: list[str] = []
        self.cancelled: list[str] = []
        # Runs it accepts, then leaves out of its status at once (its process dies early).
        self.drops_runs = False
        self.dropped: list[str] = []
        self.boot_id = "boot-1"
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self) -> str:
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None

    def running(self) -> list[str]:
        gone = {*self.cancelled, *self.dropped}
        return [r.run_id for r in self.assigned if r.run_id not in gone]

    def restart(self) -> None:
        """What a worker process started again at the same address holds: nothing."""
        self.dropped.extend(self.running())
        self.boot_id = f"boot-{len(self.dropped)}-{self.boot_id}"

    def assignment(self, run_id: str) -> worker_pb2.AssignRunRequest | None:
        return next((r for r in reversed(self.assigned) if r.run_id == run_id), None)

    async def AssignRun(  # noqa: N802
        self, request: worker_pb2.AssignRunRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AssignRunResponse:
        if self.refuse_with is not None:
            self.rejected.append(request.run_id)
            await context.abort(self.refuse_with, "cannot run this")
        blocks = -(-(len(request.prompt_token_ids) + request.sampling.max_tokens) // BLOCK_SIZE)
        if self.reject or blocks > self.free_blocks:
            self.rejected.append(request.run_id)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no room")
        self.free_blocks -= blocks
        self.assigned.append(request)
        if self.drops_runs:
            self.dropped.append(request.run_id)
        return worker_pb2.AssignRunResponse(worker_id=self.worker_id)

    async def CancelAssignedRun(  # noqa: N802
        self, request: worker_pb2.CancelAssignedRunRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.CancelAssignedRunResponse:
        found = request.run_id in self.running()
        self.cancelled.append(request.run_id)
        return worker_pb2.CancelAssignedRunResponse(found=found)

    async def GetWorkerStatus(  # noqa: N802
        self, request: worker_pb2.GetWorkerStatusRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStatus:
        return worker_pb2.WorkerStatus(
            worker_id=self.worker_id,
            model=self.model,
            num_free_blocks=self.free_blocks,
            num_total_blocks=self.total_blocks,
            block_size=BLOCK_SIZE,
            running_run_ids=self.running(),
            boot_id=self.boot_id,
        )
