"""What the code itself says, read from its syntax trees without importing it.

`variables_read(service)`: every `TOLLGATE_*` name that the modules `python -m
services.<service>` imports (transitively, within this repository) spell out. The settings
are read in many places (`CommonSettings`, each app's `from_env`, telemetry, the event loop,
the engine), so no single list exists; the import closure is that list, and it follows the
code as variables are added.

`metrics_defined()`: the series names the prometheus_client metrics in the code expose.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "services", "tollgate")
VARIABLE = re.compile(r"TOLLGATE_[A-Z0-9_]+")


def module_path(name: str) -> Path | None:
    if name.split(".")[0] not in PACKAGES:
        return None
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def imported_names(tree: ast.Module, package: str) -> set[str]:
    """Modules `tree` imports anywhere (functions included), with their parent packages."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, (base, node.module)))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 2)}


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def import_closure(entry: str) -> set[Path]:
    seen: set[Path] = set()
    pending = [entry]
    while pending:
        path = module_path(pending.pop())
        if path is None or path in seen:
            continue
        seen.add(path)
        relative = path.relative_to(ROOT).with_suffix("")
        package = ".".join(relative.parts if path.name == "__init__.py" else relative.parts[:-1])
        package = package.removesuffix(".__init__")
        pending.extend(imported_names(parsed(path), package))
    return seen


def string_constants(tree: ast.Module) -> set[str]:
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


@cache
def variables_read(service: str) -> frozenset[str]:
    """`TOLLGATE_*` variables that `python -m services.<service>` can read."""
    return frozenset(
        value
        for path in import_closure(f"services.{service}.__main__")
        for value in string_constants(parsed(path))
        if VARIABLE.fullmatch(value)
    )


def variables_named(source: str) -> set[str]:
    """`TOLLGATE_*` names in a one-line program (a Job's `python -c`)."""
    return set(VARIABLE.findall(source))


METRIC_TYPES = {
    "Counter": "counter",
    "Gauge": "gauge",
    "Histogram": "histogram",
    # Families that custom collectors yield at scrape time.
    "CounterMetricFamily": "counter",
    "GaugeMetricFamily": "gauge",
}


def metric_constructors(tree: ast.Module) -> dict[str, str]:
    """Local name -> metric type, for prometheus_client's classes however imported."""
    local: dict[str, str] = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and (node.module or "").partition(".")[0] == "prometheus_client"
        ):
            for alias in node.names:
                if alias.name in METRIC_TYPES:
                    local[alias.asname or alias.name] = METRIC_TYPES[alias.name]
    return local


def exposed(name: str, kind: str) -> set[str]:
    if kind == "counter":
        return {f"{name.removesuffix('_total')}_total"}
    if kind == "histogram":
        return {f"{name}_{suffix}" for suffix in ("bucket", "sum", "count")} | {name}
    return {name}


@cache
def metrics_defined() -> frozenset[str]:
    """Series names (`_total`, `_bucket`… included) of every prometheus_client metric."""
    names: set[str] = set()
    for package in ("services", "engine"):
        for path in (ROOT / package).rglob("*.py"):
            tree = parsed(path)
            constructors = metric_constructors(tree)
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id in constructors
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                ):
                    names |= exposed(node.args[0].value, constructors[node.func.id])
    return frozenset(names)
