"""Where the commands connect, and with what: flags, else TOLLGATE_* variables, else the stack file.

The stack file is the one `tollgate up` writes (`.tollgate/stack/stack.json` by default).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tollgate.client import AdminClient, Client
from tollgate.errors import TollgateError

DEFAULT_STACK_FILE = Path(".tollgate/stack/stack.json")
TLS_CA_ENV = "TOLLGATE_TLS_CA"
TLS_CA_HELP = (
    "PEM file of the CA (or the self-signed certificate) the servers' TLS certificates are"
    f" checked against: connect with TLS (env {TLS_CA_ENV}; default: plaintext)"
)
NO_STACK_HINT = "start the stack with `tollgate up`"


class CommandError(Exception):
    """A problem with the command line or its configuration (exit status 2)."""


@dataclass(frozen=True, slots=True)
class Connection:
    gateway: str | None
    ledger: str | None
    api_key: str | None
    admin_token: str | None
    kafka_bootstrap: str | None
    model: str | None
    timeout: float
    # PEM roots the gateway's and ledger's TLS certificates are checked against; None:
    # plaintext.
    tls_ca: str | None = None

    def __repr__(self) -> str:
        # Never the key or token.
        return f"Connection(gateway={self.gateway!r}, ledger={self.ledger!r})"

    def require_gateway(self) -> str:
        if not self.gateway:
            raise CommandError(
                f"no gateway address: pass --gateway, set TOLLGATE_GATEWAY or {NO_STACK_HINT}"
            )
        return self.gateway

    def require_api_key(self) -> str:
        if not self.api_key:
            raise CommandError(
                f"no API key: pass --api-key, set TOLLGATE_API_KEY or {NO_STACK_HINT}"
            )
        return self.api_key

    def require_admin_token(self) -> str:
        if not self.admin_token:
            raise CommandError(
                "no admin token: pass --admin-token, set TOLLGATE_ADMIN_TOKEN or " + NO_STACK_HINT
            )
        return self.admin_token

    def require_kafka(self) -> str:
        if not self.kafka_bootstrap:
            raise CommandError(
                "no Kafka bootstrap: pass --kafka, set TOLLGATE_KAFKA_BOOTSTRAP or " + NO_STACK_HINT
            )
        return self.kafka_bootstrap

    def require_model(self, flag: str | None) -> str:
        """The model the flag names, else the stack's."""
        model = flag or self.model
        if not model:
            raise CommandError(f"no model: pass --model or {NO_STACK_HINT}")
        return model

    def ledger_address(self) -> str:
        return self.ledger or self.require_gateway()


def connection_flags(*, request_timeout: bool = True) -> argparse.ArgumentParser:
    """A parent parser with the connection flags every client command accepts."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("connection")
    group.add_argument(
        "--gateway",
        help="gateway address host:port, or several comma-separated (env TOLLGATE_GATEWAY)",
    )
    group.add_argument("--ledger", help="ledger address host:port (env TOLLGATE_LEDGER)")
    group.add_argument("--api-key", help="tenant API key (env TOLLGATE_API_KEY)")
    group.add_argument("--admin-token", help="admin token (env TOLLGATE_ADMIN_TOKEN)")
    group.add_argument("--kafka", help="Kafka bootstrap host:port (env TOLLGATE_KAFKA_BOOTSTRAP)")
    group.add_argument("--tls-ca", help=TLS_CA_HELP)
    group.add_argument(
        "--stack",
        type=Path,
        default=DEFAULT_STACK_FILE,
        help=f"stack file written by `tollgate up` (default: {DEFAULT_STACK_FILE})",
    )
    if request_timeout:
        group.add_argument(
            "--timeout", type=float, default=30.0, help="seconds per request (default: 30)"
        )
    return parent


def tenant_client(connection: Connection) -> Client:
    """A gateway client with the tenant's API key."""
    return Client(
        connection.require_gateway(),
        connection.require_api_key(),
        timeout=connection.timeout,
        root_certificates=connection.tls_ca,
    )


def admin_client(args: argparse.Namespace) -> AdminClient:
    """An admin client with the admin token, as the command line names them."""
    connection = resolve(args)
    return AdminClient(
        connection.require_gateway(),
        connection.require_admin_token(),
        ledger_address=connection.ledger,
        timeout=connection.timeout,
        root_certificates=connection.tls_ca,
    )


def model_flags() -> argparse.ArgumentParser:
    """A parent parser with the flags that pick the model and bound a reply."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--model", help="model name (default: the stack's model)")
    parent.add_argument(
        "--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)"
    )
    parent.add_argument("--temperature", type=float)
    return parent


def load_stack(path: Path) -> dict[str, Any]:
    """The stack file's contents; empty when there is none."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CommandError(f"cannot read stack file {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CommandError(f"stack file {path} is not JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise CommandError(f"stack file {path} is not a JSON object")
    return data


def resolve(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Connection:
    """Each setting from its flag, else its TOLLGATE_* variable, else the stack file."""
    env = os.environ if environ is None else environ
    stack = load_stack(args.stack)
    ledgers = _replicas(_mapping(stack.get("services")).get("ledger"))
    # Every admission replica's address: the client spreads its calls over them.
    gateways = ",".join(str(g) for g in stack.get("gateways") or []) or stack.get("gateway")

    def pick(flag: str, variable: str, stacked: Any) -> str | None:
        value = getattr(args, flag, None) or env.get(variable) or stacked
        return str(value) if value else None

    return Connection(
        gateway=pick("gateway", "TOLLGATE_GATEWAY", gateways),
        ledger=pick("ledger", "TOLLGATE_LEDGER", ",".join(ledgers)),
        api_key=pick("api_key", "TOLLGATE_API_KEY", stack.get("api_key")),
        admin_token=pick("admin_token", "TOLLGATE_ADMIN_TOKEN", stack.get("admin_token")),
        kafka_bootstrap=pick("kafka", "TOLLGATE_KAFKA_BOOTSTRAP", stack.get("kafka_bootstrap")),
        model=stack.get("model") or None,
        timeout=getattr(args, "timeout", None) or 30.0,
        tls_ca=pick("tls_ca", TLS_CA_ENV, None),
    )


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _replicas(value: Any) -> list[str]:
    """The addresses of a service's processes in the stack file (one, or a list)."""
    processes = value if isinstance(value, list) else [value]
    return [str(p["address"]) for p in map(_mapping, processes) if p.get("address")]


def reports_errors(
    func: Callable[[argparse.Namespace], int],
) -> Callable[[argparse.Namespace], int]:
    """Turns failures into one `error: ...` line on stderr and a non-zero exit status."""

    @functools.wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except CommandError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except TollgateError as exc:
            print(f"error: {exc.summary()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
        except BrokenPipeError:
            # The reader went away (e.g. `| head`): not an error of ours.
            sys.stderr.close()
            return 0

    return run
