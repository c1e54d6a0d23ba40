import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psutil
import psycopg
import pytest
import sqlalchemy as sa
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from sqlalchemy.engine import make_url

from services.core.db import libpq_url
from services.core.parent import die_with_parent
from services.stack.infra import (
    DATABASE_URL_ENV,
    KAFKA_BOOTSTRAP_ENV,
    PASSWORD_FILE,
    Endpoints,
    LocalInfra,
    without_password,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
# Tansu answers JoinGroup only after half the session timeout (5 s by default).
GROUP_OPTIONS = {"session_timeout_ms": 2000, "heartbeat_interval_ms": 300}


async def consume(bootstrap: str, topic: str, group: str, count: int) -> list[bytes]:
    """At least `count` values from where `group` left off; commits what it read."""
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        **GROUP_OPTIONS,
    )
    await consumer.start()
    try:
        values: list[bytes] = []
        async with asyncio.timeout(20):
            while len(values) < count:
                batch = await consumer.getmany(timeout_ms=200)
                values += [record.value for records in batch.values() for record in records]
        await consumer.commit()
        return values
    finally:
        await consumer.stop()


async def test_broker_round_trip_resumes_group_after_committed_offset(
    kafka_bootstrap: str, kafka_topic: str
) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await producer.start()
    group = f"group-{uuid.uuid4()}"
    try:
        for value in (b"v0", b"v1", b"v2"):
            await producer.send_and_wait(kafka_topic, value, key=b"run-1")
        assert await consume(kafka_bootstrap, kafka_topic, group, 3) == [b"v0", b"v1", b"v2"]
        await producer.send_and_wait(kafka_topic, b"v3", key=b"run-1")
        assert await consume(kafka_bootstrap, kafka_topic, group, 1) == [b"v3"]
    finally:
        await producer.stop()


def test_postgres_answers_through_sqlalchemy_and_psycopg(infra: Endpoints) -> None:
    assert infra.database_url.startswith("postgresql+psycopg://")
    db = sa.create_engine(infra.database_url)
    try:
        with db.connect() as connection:
            assert connection.scalar(sa.text("SELECT 1")) == 1
    finally:
        db.dispose()


@pytest.mark.skipif(
    bool(os.environ.get(DATABASE_URL_ENV)), reason="the suite runs against an outside database"
)
def test_the_embedded_postgres_requires_the_password(infra: Endpoints) -> None:
    url = make_url(infra.database_url)
    assert url.password
    without = sa.engine.URL.create(
        "postgresql", url.username, None, url.host, url.port, url.database
    ).render_as_string(hide_password=False)
    wrong = url.set(password="wrong-" + url.password).render_as_string(hide_password=False)
    for attempt in (without, wrong):
        with pytest.raises(psycopg.OperationalError, match="password"):
            psycopg.connect(libpq_url(attempt), connect_timeout=5).close()


def table_names(url: str) -> set[str]:
    db = sa.create_engine(url)
    try:
        with db.connect() as connection:
            return set(sa.inspect(connection).get_table_names())
    finally:
        db.dispose()


@pytest.mark.parametrize("attempt", [1, 2])
def test_each_test_gets_a_fresh_migrated_database(
    infra: Endpoints, database_url: str, attempt: int
) -> None:
    # Whichever attempt runs second fails if it sees the first one's table.
    assert database_url != infra.database_url
    assert table_names(database_url) == table_names(infra.database_url)
    db = sa.create_engine(database_url)
    try:
        with db.begin() as connection:
            connection.execute(sa.text("CREATE TABLE isolation_probe (attempt int)"))
    finally:
        db.dispose()


def read_line(process: subprocess.Popen[str], timeout: float) -> str:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    return process.stdout.readline() if ready else ""


def assert_endpoints_answer(endpoints: dict[str, str]) -> None:
    db = sa.create_engine(endpoints["database_url"])
    try:
        with db.connect() as connection:
            assert connection.scalar(sa.text("SELECT 1")) == 1
    finally:
        db.dispose()
    host, port = endpoints["kafka_bootstrap"].rsplit(":", 1)
    socket.create_connection((host, int(port)), timeout=5).close()


def command_line(process: psutil.Process) -> str:
    # Short-lived server children (e.g. a PostgreSQL backend) may be gone by now.
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return ""


def test_infra_up_prints_endpoints_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    data_dir = tmp_path / "infra"
    # The command must start its own servers here, whatever the suite runs against.
    env = {k: v for k, v in os.environ.items() if k not in (DATABASE_URL_ENV, KAFKA_BOOTSTRAP_ENV)}
    command = [sys.executable, "-m", "tollgate.cli", "infra", "up", "--data-dir", str(data_dir)]
    with open(tmp_path / "stderr.log", "wb") as stderr:
        process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
    try:
        line = read_line(process, timeout=120)
        assert line, (tmp_path / "stderr.log").read_text()
        endpoints = json.loads((data_dir / "infra.json").read_text())
        # The password is in files only its owner reads, never on the terminal.
        password = (data_dir / PASSWORD_FILE).read_text().strip()
        assert len(password) >= 16 and make_url(endpoints["database_url"]).password == password
        for private in (data_dir / PASSWORD_FILE, data_dir / "infra.json"):
            assert private.stat().st_mode & 0o777 == 0o600, private
        printed = {**endpoints, "database_url": without_password(endpoints["database_url"])}
        assert json.loads(line) == printed and password not in line
        assert_endpoints_answer(endpoints)
        children = psutil.Process(process.pid).children(recursive=True)
        names = " ".join(command_line(child) for child in children)
        assert "postgres" in names and "tansu" in names

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
        assert password not in (tmp_path / "stderr.log").read_text()
    finally:
        if process.poll() is None:
            process.kill()  # its servers die with it
            process.wait()


def test_a_cluster_that_trusted_local_connections_is_moved_to_passwords(
    infra: Endpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data dir left by an older `tollgate up`: its cluster trusted every local
    connection, and there was no password file."""
    monkeypatch.delenv(DATABASE_URL_ENV, raising=False)
    monkeypatch.setenv(KAFKA_BOOTSTRAP_ENV, infra.kafka_bootstrap)
    # Not pytest's tmp_path: other pytest runs on the machine may prune it meanwhile.
    with tempfile.TemporaryDirectory(prefix="tollgate-test-legacy-") as scratch:
        data_dir = Path(scratch)
        with LocalInfra(data_dir):
            pass
        (data_dir / PASSWORD_FILE).unlink()
        hba = data_dir / "postgres" / "pg_hba.conf"
        hba.write_text(hba.read_text().replace("scram-sha-256", "trust"))
        with LocalInfra(data_dir) as endpoints:
            url = make_url(endpoints.database_url)
            assert url.password == (data_dir / PASSWORD_FILE).read_text().strip()
            assert_endpoints_answer(
                {"database_url": endpoints.database_url, "kafka_bootstrap": infra.kafka_bootstrap}
            )
            wrong = url.set(password="wrong").render_as_string(hide_password=False)
            with pytest.raises(psycopg.OperationalError, match="password"):
                psycopg.connect(libpq_url(wrong), connect_timeout=5).close()
