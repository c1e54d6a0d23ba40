"""`tollgate admin keys list | create | rotate | revoke`: a tenant's API keys."""

from __future__ import annotations

import argparse
import re
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

from tollgate.commands.connection import admin_client, reports_errors
from tollgate.commands.output import json_line, key_values, plain, table, when
from tollgate.types import ApiKey

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def register(areas: Any, flags: argparse.ArgumentParser) -> None:
    """Adds `admin keys ...` to the `tollgate` command line."""
    keys = areas.add_parser("keys", help="list, create, rotate and revoke API keys")
    commands = keys.add_subparsers(dest="keys_command", metavar="COMMAND", required=True)
    listing = commands.add_parser("list", parents=[flags], help="a tenant's keys (no secrets)")
    listing.add_argument("tenant_id")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=list_keys_command)
    create = commands.add_parser("create", parents=[flags], help="a new key (shown once)")
    create.add_argument("tenant_id")
    create.add_argument(
        "--model",
        action="append",
        default=[],
        dest="models",
        help="a model the key may use (repeatable; default: every model)",
    )
    create.add_argument(
        "--expires", type=moment, help="when it stops working: RFC 3339, or from now (30d, 12h)"
    )
    create.add_argument("--alias", default="", help="a name for people")
    create.add_argument("--json", action="store_true")
    create.set_defaults(func=create_key_command)
    rotate = commands.add_parser("rotate", parents=[flags], help="a new secret (shown once)")
    rotate.add_argument("key_id")
    rotate.add_argument(
        "--overlap",
        type=seconds,
        help="how long the old secret keeps working (90m, 24h; default 24h, at most 7d)",
    )
    rotate.add_argument("--json", action="store_true")
    rotate.set_defaults(func=rotate_key_command)
    revoke = commands.add_parser("revoke", parents=[flags], help="revoke a key")
    revoke.add_argument("key_id")
    revoke.add_argument("--json", action="store_true")
    revoke.set_defaults(func=revoke_key_command)


def seconds(text: str) -> float:
    """`90`, `90s`, `15m`, `24h`, `7d` in seconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration (like 90s, 15m, 24h, 7d): {text!r}")
    return float(match[1]) * _UNIT_SECONDS[match[2]]


def moment(text: str, now: datetime | None = None) -> datetime:
    """An RFC 3339 time (UTC unless it says otherwise), or a duration from `now`."""
    if _DURATION.fullmatch(text.strip()):
        return (now or datetime.now(UTC)) + timedelta(seconds=seconds(text))
    try:
        parsed = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a time (2030-01-31T12:00:00Z) nor a duration (30d): {text!r}"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _time(value: datetime | None) -> str:
    return when(value) if value is not None else "never"


def _key_text(key: ApiKey) -> str:
    return key_values(
        [
            ("key_id", key.key_id),
            ("tenant_id", key.tenant_id),
            ("alias", key.alias),
            ("allowed_models", ", ".join(key.allowed_models) or "every model"),
            ("expire_time", _time(key.expire_time)),
            ("revoked", str(key.revoked)),
        ]
    )


def _public(key: ApiKey) -> dict[str, Any]:
    return {name: value for name, value in plain(key).items() if name != "secret"}


def _print_secret(key: ApiKey, as_json: bool) -> None:
    # The one place a secret is printed: it cannot be read back later.
    if as_json:
        print(json_line({**_public(key), "secret": key.secret}))
    else:
        print(_key_text(key))
        print(f"secret:    {key.secret}")
    print("note: the secret is shown only once; store it now.", file=sys.stderr)


@reports_errors
def list_keys_command(args: argparse.Namespace) -> int:
    keys: list[ApiKey] = []
    with admin_client(args) as admin:
        token = ""
        while True:
            page = admin.list_api_keys(args.tenant_id, page_size=500, page_token=token)
            keys.extend(page.api_keys)
            token = page.next_page_token
            if not token:
                break
    if args.json:
        for key in keys:
            print(json_line(_public(key)))
        return 0
    headers = ("KEY_ID", "ALIAS", "MODELS", "EXPIRES", "LAST_USED", "REVOKED")
    rows = [
        (
            k.key_id,
            k.alias,
            ",".join(k.allowed_models) or "*",
            _time(k.expire_time),
            _time(k.last_used_time),
            "yes" if k.revoked else "",
        )
        for k in keys
    ]
    print(table(headers, rows))
    return 0


@reports_errors
def create_key_command(args: argparse.Namespace) -> int:
    with admin_client(args) as admin:
        key = admin.create_api_key(
            args.tenant_id, allowed_models=args.models, expire_time=args.expires, alias=args.alias
        )
    _print_secret(key, args.json)
    return 0


@reports_errors
def rotate_key_command(args: argparse.Namespace) -> int:
    with admin_client(args) as admin:
        key = admin.rotate_api_key(args.key_id, overlap=args.overlap)
    _print_secret(key, args.json)
    if key.previous_secret_expire_time is not None:
        print(
            f"the old secret works until {when(key.previous_secret_expire_time)}.", file=sys.stderr
        )
    return 0


@reports_errors
def revoke_key_command(args: argparse.Namespace) -> int:
    with admin_client(args) as admin:
        key = admin.revoke_api_key(args.key_id)
    print(json_line(_public(key)) if args.json else _key_text(key))
    return 0
