"""Serves an ASGI application with uvicorn on the running event loop, beside gRPC.

The socket is bound before the server starts, so the port is known (and announced)
even when it was 0; signals stay with the process's own handler (`services.core.server`).
Each connection meets `HttpLimits` (`connections.py`); `X-Forwarded-For` names the client
only on a connection from one of `trusted_proxies`, else the client is the transport peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator

import uvicorn
from starlette.types import ASGIApp

from services.admission.http.connections import limited_protocol
from services.admission.http.limits import DEFAULT_LIMITS, HttpLimits
from services.core.loop import wait_set
from services.core.tls import ServerTls


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the service's own SIGTERM handling stops this server


class HttpServer:
    def __init__(
        self,
        app: ASGIApp,
        listen: str,
        *,
        grace: int = 5,
        tls: ServerTls | None = None,
        limits: HttpLimits = DEFAULT_LIMITS,
    ) -> None:
        host, _, port = listen.rpartition(":")
        self.host = host.strip("[]") or "127.0.0.1"
        self.socket = socket.create_server((self.host, int(port)), reuse_port=False)
        self.address = f"{listen.rpartition(':')[0] or self.host}:{self.socket.getsockname()[1]}"
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=grace,
            http=limited_protocol(limits),
            ws="none",
            proxy_headers=bool(limits.trusted_proxies),
            forwarded_allow_ips=[str(network) for network in limits.proxy_networks()],
            ssl_certfile=str(tls.cert_path) if tls is not None else None,
            ssl_keyfile=str(tls.key_path) if tls is not None else None,
        )
        self.server = _Server(config)
        self.scheme = "https" if tls is not None else "http"
        self.grace = grace
        self._stopped = asyncio.Event()

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}"

    async def run(self) -> None:
        """Serves until `stop`."""
        try:
            await self.server.serve(sockets=[self.socket])
        finally:
            self.socket.close()
            self._stopped.set()

    async def stop(self) -> None:
        """Stops taking connections and lets answers in flight finish within the grace;
        streams still open then are cut."""
        self.server.should_exit = True
        await wait_set(self._stopped, self.grace + 1.0)
