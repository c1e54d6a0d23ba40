"""`tollgate admin tenants | keys | quota`: tenant administration with the admin token
(keys: admin_keys.py)."""

from __future__ import annotations

import argparse
from typing import Any

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


def _register_quota(areas: Any, flags: argparse.ArgumentParser) -> None:
    quota = areas.add_parser("quota", help="tenant limits")
    commands = quota.add_subparsers(dest="quota_command", metavar="COMMAND", required=True)
    set_ = commands.add_parser(
        "set", parents=[flags], help="set limits (0 = unlimited; an omitted one is kept)"
    )
    set_.add_argument("tenant_id")
    set_.add_argument("--max-kv-blocks", type=int)
    set_.add_argument("--max-concurrent-runs", type=int)
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
        max_kv_blocks, max_runs = args.max_kv_blocks, args.max_concurrent_runs
        if max_kv_blocks is None or max_runs is None:
            # SetQuota replaces both limits: keep the one not given.
            current = admin.get_tenant(args.tenant_id).quota or Quota(args.tenant_id)
            max_kv_blocks = current.max_kv_blocks if max_kv_blocks is None else max_kv_blocks
            max_runs = current.max_concurrent_runs if max_runs is None else max_runs
        quota = admin.set_quota(
            args.tenant_id, max_kv_blocks=max_kv_blocks, max_concurrent_runs=max_runs
        )
    if args.json:
        print(json_line(plain(quota)))
    else:
        print(
            f"tenant {quota.tenant_id}: max_kv_blocks={quota.max_kv_blocks or 'unlimited'}"
            f" max_concurrent_runs={quota.max_concurrent_runs or 'unlimited'}"
        )
    return 0
