"""`tollgate admin tenants | keys | quota`: tenant administration with the admin token
(keys: admin_keys.py)."""

from __future__ import annotations

import argparse
from typing import Any

from tollgate.client import AdminClient
from tollgate.commands import admin_keys
from tollgate.commands.connection import admin_client, connection_flags, reports_errors
from tollgate.commands.output import json_line, key_values, plain, tenants_table
from tollgate.types import Quota, Tenant


def register(subparsers: Any) -> None:
    """Adds `admin ...` to the `tollgate` command line."""
    flags = connection_flags()
    admin = subparsers.add_parser("admin", help="tenants, API keys and quotas (admin token)")
    areas = admin.add_subparsers(dest="admin_area", metavar="AREA", required=True)
    _register_tenants(areas, flags)
    admin_keys.register(areas, flags)
    _register_quota(areas, flags)


def _register_tenants(areas: Any, flags: argparse.ArgumentParser) -> None:
    tenants = areas.add_parser("tenants", help="create, get, list tenants")
    commands = tenants.add_subparsers(dest="tenants_command", metavar="COMMAND", required=True)
    create = commands.add_parser("create", parents=[flags], help="create a tenant")
    create.add_argument("name")
    create.add_argument("--weight", type=int, default=1, help="fair-share weight (default: 1)")
    create.add_argument("--json", action="store_true")
    create.set_defaults(func=create_tenant_command)
    get = commands.add_parser("get", parents=[flags], help="a tenant and its quota")
    get.add_argument("tenant_id")
    get.add_argument("--json", action="store_true")
    get.set_defaults(func=get_tenant_command)
    listing = commands.add_parser("list", parents=[flags], help="every tenant")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=list_tenants_command)


# The limits `quota set` takes, each as --name-with-dashes.
QUOTA_FLAGS = (
    "max_kv_blocks",
    "max_concurrent_runs",
    "requests_per_minute",
    "input_tokens_per_minute",
    "output_tokens_per_minute",
    "budget_micros",
)


def _register_quota(areas: Any, flags: argparse.ArgumentParser) -> None:
    quota = areas.add_parser("quota", aliases=["quotas"], help="tenant and key limits")
    commands = quota.add_subparsers(dest="quota_command", metavar="COMMAND", required=True)
    set_ = commands.add_parser(
        "set", parents=[flags], help="set limits (0 = unlimited; an omitted one is kept)"
    )
    set_.add_argument("tenant_id")
    set_.add_argument("--key-id", default="", help="set this API key's own limits")
    for name in QUOTA_FLAGS:
        set_.add_argument(f"--{name.replace('_', '-')}", type=int, dest=name)
    set_.add_argument("--budget-period", choices=("day", "month"), help="UTC calendar")
    set_.add_argument("--json", action="store_true")
    set_.set_defaults(func=set_quota_command)


_admin = admin_client


def _tenant_text(tenant: Tenant) -> str:
    quota = tenant.quota or Quota(tenant.tenant_id)
    return key_values(
        [
            ("tenant_id", tenant.tenant_id),
            ("name", tenant.name),
            ("weight", str(tenant.weight)),
            ("max_kv_blocks", str(quota.max_kv_blocks or "unlimited")),
            ("max_concurrent_runs", str(quota.max_concurrent_runs or "unlimited")),
        ]
    )


@reports_errors
def create_tenant_command(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        tenant = admin.create_tenant(args.name, args.weight)
    print(json_line(plain(tenant)) if args.json else _tenant_text(tenant))
    return 0


@reports_errors
def get_tenant_command(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        tenant = admin.get_tenant(args.tenant_id)
    print(json_line(plain(tenant)) if args.json else _tenant_text(tenant))
    return 0


@reports_errors
def list_tenants_command(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        tenants = admin.list_tenants()
    if args.json:
        for tenant in tenants:
            print(json_line(plain(tenant)))
    else:
        print(tenants_table(tenants))
    return 0


@reports_errors
def set_quota_command(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        # SetQuota replaces every limit: keep the ones not given.
        current = _current_quota(admin, args.tenant_id, args.key_id)
        given = {name: getattr(args, name) for name in (*QUOTA_FLAGS, "budget_period")}
        limits = {
            name: getattr(current, name) if value is None else value
            for name, value in given.items()
        }
        quota = admin.set_quota(
            args.tenant_id,
            max_concurrent_streams=None if args.key_id else current.max_concurrent_streams,
            key_id=args.key_id,
            **limits,
        )
    if args.json:
        print(json_line(plain(quota)))
    else:
        print(_quota_text(quota))
    return 0


def _quota_text(quota: Quota) -> str:
    """The two in-flight limits always (as before there were more), the others when set."""
    owner = f"key {quota.key_id}" if quota.key_id else f"tenant {quota.tenant_id}"
    shown = [
        f"{name}={getattr(quota, name) or 'unlimited'}"
        for name in QUOTA_FLAGS
        if name in ("max_kv_blocks", "max_concurrent_runs") or getattr(quota, name)
    ]
    if quota.budget_micros:
        shown.append(f"budget_period={quota.budget_period}")
    return f"{owner}: {' '.join(shown)}"


def _current_quota(admin: AdminClient, tenant_id: str, key_id: str) -> Quota:
    tenant = admin.get_tenant(tenant_id)
    if not key_id:
        return tenant.quota or Quota(tenant_id)
    own = [q for q in tenant.key_quotas if q.key_id == key_id]
    return own[0] if own else Quota(tenant_id, key_id=key_id)
