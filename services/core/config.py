"""Process configuration from TOLLGATE_* environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass

RUN_EVENTS_TOPIC = "tollgate.run-events.v1"
ADMIN_EVENTS_TOPIC = "tollgate.admin-events.v1"
TOPIC_PARTITIONS = 8
# Seconds the outbox keeps published rows, to publish again what a broker lost.
REPUBLISH_WINDOW_SECONDS = 600.0
ADMIN_TOKEN_ENV = "TOLLGATE_ADMIN_TOKEN"
# Shorter admin tokens are refused at startup: they can be guessed.
MIN_ADMIN_TOKEN_LENGTH = 16
# Tenants that get a `tenant` label of their own by default (the rest are `other`).
DEFAULT_TOP_TENANTS = 20


def consumer_group(name: str, topic: str) -> str:
    """The Kafka consumer group of the consumer `name` on `topic`.

    One group per topic: stacks that share a cluster under different topics never
    wait on one another's rebalances. The default topic keeps the bare name.
    """
    return name if topic == RUN_EVENTS_TOPIC else f"{name}.{topic}"


class ConfigError(Exception):
    """A TOLLGATE_* variable is missing or malformed; the message names it."""


def env_str(name: str, default: str | None = None) -> str:
    value = os.environ.get(name, default)
    if value is None or value == "":
        if default is not None:
            return default
        raise ConfigError(f"{name} is required")
    return value


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None


def env_secret(name: str, min_length: int) -> str:
    """A secret of at least `min_length` characters; empty (unset) when not given."""
    value = os.environ.get(name, "")
    if value and len(value) < min_length:
        raise ConfigError(f"{name} must be at least {min_length} characters long")
    return value


def admin_token_from_env() -> str:
    """The admin token; empty disables the admin calls."""
    return env_secret(ADMIN_TOKEN_ENV, MIN_ADMIN_TOKEN_LENGTH)


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = env_str(name, default)
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def env_map(name: str, default: str = "") -> dict[str, str]:
    """Parses `key=value,key2=value2`."""
    raw = os.environ.get(name, default)
    result: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in raw.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ConfigError(f"{name}: expected key=value pairs, got {item!r}")
        result[key.strip()] = value.strip()
    return result


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    """`listen` is host:port, port 0 for any free one; empty: no /metrics at all."""

    listen: str = ""
    tenants: frozenset[str] = frozenset()
    top_tenants: int = DEFAULT_TOP_TENANTS

    @classmethod
    def from_env(cls) -> MetricsSettings:
        if os.environ.get("TOLLGATE_METRICS_PORT"):
            raise ConfigError(
                "TOLLGATE_METRICS_PORT is replaced by TOLLGATE_METRICS_LISTEN=host:port"
            )
        listen = os.environ.get("TOLLGATE_METRICS_LISTEN", "").strip()
        if listen:
            parse_listen(listen)
        top = env_int("TOLLGATE_METRICS_TOP_TENANTS", DEFAULT_TOP_TENANTS)
        if top < 0:
            raise ConfigError(f"TOLLGATE_METRICS_TOP_TENANTS must be 0 or more, got {top}")
        raw = os.environ.get("TOLLGATE_METRICS_TENANTS", "")
        tenants = frozenset(filter(None, (part.strip() for part in raw.split(","))))
        return cls(listen=listen, tenants=tenants, top_tenants=top)


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"TOLLGATE_METRICS_LISTEN must be host:port, got {listen!r}")
    return host.strip("[]"), int(port)


# PostgreSQL connections a service process keeps open at most.
DB_POOL_SIZE = 20


@dataclass(frozen=True, slots=True)
class CommonSettings:
    """What every service process needs."""

    database_url: str
    kafka_bootstrap: str
    topic: str
    listen: str
    db_pool_size: int = DB_POOL_SIZE
    metrics: MetricsSettings = MetricsSettings()
    internal_token: str = ""
    topic_partitions: int = TOPIC_PARTITIONS
    republish_window: float = REPUBLISH_WINDOW_SECONDS
    admin_topic: str = ADMIN_EVENTS_TOPIC

    @classmethod
    def from_env(cls, default_listen: str = "127.0.0.1:0") -> CommonSettings:
        return cls(
            database_url=env_str("TOLLGATE_DATABASE_URL"),
            kafka_bootstrap=env_str("TOLLGATE_KAFKA_BOOTSTRAP"),
            topic=env_str("TOLLGATE_TOPIC", RUN_EVENTS_TOPIC),
            listen=env_str("TOLLGATE_LISTEN", default_listen),
            db_pool_size=env_int("TOLLGATE_DB_POOL_SIZE", DB_POOL_SIZE),
            metrics=MetricsSettings.from_env(),
            internal_token=env_str("TOLLGATE_INTERNAL_TOKEN", ""),
            topic_partitions=env_int("TOLLGATE_TOPIC_PARTITIONS", TOPIC_PARTITIONS),
            republish_window=env_float("TOLLGATE_REPUBLISH_WINDOW", REPUBLISH_WINDOW_SECONDS),
            admin_topic=env_str("TOLLGATE_ADMIN_TOPIC", ADMIN_EVENTS_TOPIC),
        )
