"""docs/CONFIGURATION.md's tables name every TOLLGATE_* variable the code reads, and
only those; the paths the README names exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "CONFIGURATION.md"
SCANNED = ("engine", "services", "tollgate", "tools", "bench")
NAME = re.compile(r"TOLLGATE_[A-Z0-9_]*")

# Names the code assembles at run time from a prefix (f"TOLLGATE_{x}", "TOLLGATE_" + x):
# prefix -> every full name it builds. The scan cannot see those names, so they are
# listed here; a prefix missing from this table fails the scan.
BUILT_NAMES: dict[str, frozenset[str]] = {}


def names_in_source(source: str, origin: str = "<source>") -> set[str]:
    """TOLLGATE_* names in the string literals of `source` (docstrings left out)."""
    tree = ast.parse(source)
    docstrings = {id(doc) for node in ast.walk(tree) if (doc := _docstring(node)) is not None}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = node.values
            for i, part in enumerate(parts):
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    built = i + 1 < len(parts)  # a formatted value follows this text
                    found |= _names(part.value, built, origin)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            if isinstance(node.left, ast.Constant) and isinstance(node.left.value, str):
                found |= _names(node.left.value, True, origin)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                found |= _names(node.value, False, origin)
    return found


def _docstring(node: ast.AST) -> ast.Constant | None:
    """The docstring's node of a module, class or function; None when it has none."""
    if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        return first.value if isinstance(first.value.value, str) else None
    return None


def _names(text: str, continued: bool, origin: str) -> set[str]:
    """The names in `text`; one that ends `text` is only a prefix when more is appended."""
    names: set[str] = set()
    for match in NAME.finditer(text):
        name = match.group()
        if name.endswith("_") or (continued and match.end() == len(text)):
            assert name in BUILT_NAMES, (
                f"{origin}: {name!r} starts a variable name built at run time; "
                "list the names it builds in BUILT_NAMES"
            )
            names |= BUILT_NAMES[name]
        else:
            names.add(name)
    return names


def names_in_code() -> set[str]:
    found: set[str] = set()
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue  # generated from protos/, which names no variable
            found |= names_in_source(path.read_text(), str(path.relative_to(ROOT)))
    return found


def configuration_section() -> str:
    return CONFIGURATION.read_text()


def table_rows(section: str) -> list[list[str]]:
    rows = []
    for line in section.splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def names_in_tables() -> set[str]:
    names = set()
    for row in table_rows(configuration_section()):
        names |= set(re.findall(r"`(TOLLGATE_[A-Z0-9_]+)`", row[0]))
    return names


def test_the_scan_sees_names_and_prefixes() -> None:
    assert names_in_source('os.environ.get("TOLLGATE_X", "1")') == {"TOLLGATE_X"}
    assert names_in_source('"""Docstring naming TOLLGATE_GONE."""') == set()
    assert names_in_source('f"TOLLGATE_X must be set, got {value}"') == {"TOLLGATE_X"}
    for built in ('f"TOLLGATE_{suffix}"', 'f"TOLLGATE_KV{suffix}"', '"TOLLGATE_" + suffix'):
        try:
            names_in_source(built)
        except AssertionError as error:
            assert "BUILT_NAMES" in str(error)
        else:
            raise AssertionError(f"{built} was not recognised as a built name")
    assert {"TOLLGATE_DATABASE_URL", "TOLLGATE_WORKERS", "TOLLGATE_PRICES"} <= names_in_code()


def test_every_variable_the_code_reads_is_in_a_configuration_table() -> None:
    missing = names_in_code() - names_in_tables()
    assert not missing, f"docs/CONFIGURATION.md's tables lack {sorted(missing)}"


def test_every_variable_in_the_tables_is_read_by_the_code() -> None:
    unread = names_in_tables() - names_in_code()
    assert not unread, f"docs/CONFIGURATION.md's tables name unread {sorted(unread)}"


def test_each_table_row_has_a_default_and_a_meaning() -> None:
    rows = [row for row in table_rows(configuration_section()) if row[0] != "variable"]
    assert rows
    for row in rows:
        assert len(row) == 3 and all(row), f"row {row}: expected variable | default | meaning"


def test_the_paths_the_readme_names_exist() -> None:
    text = README.read_text()
    linked = re.findall(r"\]\(([^)#:]+)\)", text)
    tops = "|".join((*SCANNED, "tests", "protos", "migrations", "docs"))
    quoted = re.findall(rf"`((?:{tops})/[^`\s]*)`", text)
    for reference in (*linked, *quoted):
        for path in _expand_braces(reference.rstrip("/")):
            assert (ROOT / path).exists(), f"README.md names {path}, which does not exist"


def _expand_braces(path: str) -> list[str]:
    match = re.search(r"\{([^}]*)\}", path)
    if match is None:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [p for choice in match.group(1).split(",") for p in _expand_braces(head + choice + tail)]
