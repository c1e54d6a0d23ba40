"""docs/CONFIGURATION.md's tables name every TOLLGATE_* variable the code reads, and
only those; the paths, pages and headings the README and docs/ name exist; the README
stays a short first page that links every page of docs/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIGURATION = DOCS / "CONFIGURATION.md"
SCANNED = ("engine", "services", "tollgate", "tools", "bench")
# Pages of docs/ whose named paths are not checked yet; remove a name to check that page.
UNCHECKED_PAGES: tuple[str, ...] = ()
# `quoted` text starting with one of these folders is a repository path.
QUOTED_TOPS = (*SCANNED, "tests", "protos", "migrations", "docs", "deploy")
LINK = re.compile(r"\]\(([^)\s]+)\)")
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


def checked_pages() -> list[Path]:
    docs = [page for page in sorted(DOCS.glob("*.md")) if page.name not in UNCHECKED_PAGES]
    return [README, *docs]


def missing_references(text: str, page: Path) -> list[str]:
    """What `text`, the text of `page`, names that does not exist: linked files (relative
    to the page), #headings in linked Markdown pages, and `quoted` repository paths."""
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if path and not linked.exists():
            missing.append(target)
        elif anchor and linked.suffix == ".md":
            headings = anchors(linked.read_text() if path else text)
            if anchor not in headings:
                missing.append(target)
    tops = "|".join(QUOTED_TOPS)
    for quoted in re.findall(rf"`((?:{tops})/[^`\s]*)`", text):
        missing += [p for p in _expand_braces(quoted.rstrip("/")) if not _exists(p)]
    return missing


def _exists(path: str) -> bool:
    """Whether the repository has `path`; a glob pattern (`*`) needs one match."""
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


def anchors(markdown: str) -> set[str]:
    """The #anchors of a Markdown page's headings, as GitHub makes them."""
    found: set[str] = set()
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"#{1,6} (.*)", line)):
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            number = 1
            anchor = slug
            while anchor in found:
                anchor, number = f"{slug}-{number}", number + 1
            found.add(anchor)
    return found


def test_the_check_finds_what_is_missing() -> None:
    page = DOCS / "EXAMPLE.md"
    assert missing_references("`services/core/` and [the README](../README.md)", page) == []
    assert missing_references("`services/nowhere/`, `tests/{e2e,nowhere}`", page) == [
        "services/nowhere",
        "tests/nowhere",
    ]
    assert missing_references("`tollgate/v1/*_pb2.py`, `tests/*.nowhere`", page) == [
        "tests/*.nowhere"
    ]
    assert missing_references("[gone](../NOWHERE.md) [gone](README.md)", page) == [
        "../NOWHERE.md",
        "README.md",
    ]
    text = "# A page\n\n## Two words\n\n```sh\n# a comment\n```\n[a](#two-words) [b](#a-comment)"
    assert missing_references(text, page) == ["#a-comment"]
    assert missing_references("[c](CONFIGURATION.md#nowhere) [u](https://x.org/a)", page) == [
        "CONFIGURATION.md#nowhere"
    ]


@pytest.mark.parametrize("page", checked_pages(), ids=lambda page: page.name)
def test_the_paths_each_page_names_exist(page: Path) -> None:
    missing = missing_references(page.read_text(), page)
    assert not missing, f"{page.relative_to(ROOT)} names {missing}, which do not exist"


def test_the_readme_links_every_docs_page() -> None:
    linked = {
        (ROOT / target.partition("#")[0]).resolve() for target in LINK.findall(README.read_text())
    }
    unlinked = [page.name for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]
    assert not unlinked, f"README.md links no {unlinked}"


def test_the_readme_is_a_short_first_page() -> None:
    lines = README.read_text().splitlines()
    opening = [line.split("#")[0].strip() for line in lines[:40]]
    assert "make run" in opening and "make test" in opening, "the first 40 lines lack a command"
    assert len(lines) < 250, f"README.md has {len(lines)} lines; move detail to docs/"
    dated = [line for line in lines if re.search(r"\b\d{4}-\d{2}-\d{2}\b", line)]
    assert len(dated) <= 2, f"dated lines belong in bench/RESULTS.md: {dated}"


def _expand_braces(path: str) -> list[str]:
    match = re.search(r"\{([^}]*)\}", path)
    if match is None:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [p for choice in match.group(1).split(",") for p in _expand_braces(head + choice + tail)]
