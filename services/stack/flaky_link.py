"""A TCP relay whose open connections can be cut on demand.

The demo and the end-to-end tests put it between a client and the gateway to
break a stream mid-flight and watch the client resume it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType


class FlakyLink:
    """Listens on a free loopback port and relays every connection to `target`."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.num_cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        """Drops every open connection; new ones are accepted as before."""
        self.num_cuts += 1
        self._drop_all()

    def _drop_all(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._listener.close()
        self._drop_all()

    def __enter__(self) -> FlakyLink:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
