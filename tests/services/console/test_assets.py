"""The console's files are package data, found through importlib.resources."""

from __future__ import annotations

import re

from services.console import assets


def test_the_page_its_scripts_and_styles_are_package_data() -> None:
    names = assets.names()
    assert {"index.html", "app.js", "api.js", "playground.js", "style.css"} <= set(names)
    page = assets.asset("index.html")
    assert page is not None and page.content_type.startswith("text/html")
    assert b'type="module"' in page.body
    assert assets.static_dir().joinpath("app.js").is_file()


def test_every_file_the_page_and_its_modules_load_is_served() -> None:
    page = assets.asset("index.html")
    assert page is not None
    wanted = set(re.findall(r'(?:src|href)="/console/static/([^"]+)"', page.body.decode()))
    for name in assets.names():
        if name.endswith(".js"):
            source = assets.asset(name)
            assert source is not None
            wanted |= set(re.findall(r'from "\./([^"]+)"', source.body.decode()))
    assert wanted and all(assets.asset(name) is not None for name in wanted), wanted


def test_only_the_listed_files_are_served() -> None:
    for name in ("../routes.py", "routes.py", "__init__.py", "", ".", "static/app.js"):
        assert assets.asset(name) is None
