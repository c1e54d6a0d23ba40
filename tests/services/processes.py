"""A service started as the launcher starts it: `python -m services.<name>`."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


@asynccontextmanager
async def service_process(
    name: str, env: dict[str, str], ready_timeout: float = 60.0
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """Starts the service, waits for its READY line and yields it with its address;
    kills it on the way out if it is still running."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        f"services.{name}",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert process.stdout is not None
        line = (await asyncio.wait_for(process.stdout.readline(), ready_timeout)).decode()
        assert line.startswith("READY 127.0.0.1:"), line
        yield process, line.split()[1]
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
