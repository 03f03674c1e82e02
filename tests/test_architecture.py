"""The rooms' imports run one way (engine -> config -> store -> worker | web -> cli) and the web process
and the store never import torch: import-linter checks the contracts in pyproject.toml."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_imports_run_one_way_and_keep_torch_out_of_the_web_process():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    run = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 kept, 0 broken" in run.stdout, run.stdout


@pytest.mark.parametrize(
    ("module", "planted", "broken"),
    [
        ("store/runs.py", "from ffmem.web import urls", "ffmem.store.runs -> ffmem.web.urls"),
        (  # a page builder reaching up into the middleware (as the corpora page once did)
            "web/pages/corpora.py",
            "from ffmem.web.security import install",
            "ffmem.web.pages.corpora -> ffmem.web.security",
        ),
        ("web/pages/key.py", "from ffmem.web import rendering", "ffmem.web.pages.key -> ffmem.web.rendering"),
        ("web/views.py", "from ffmem.web.pages import key", "ffmem.web.views -> ffmem.web.pages.key"),
    ],
)
def test_a_reversed_import_is_caught(tmp_path, module, planted, broken):
    """The contracts can fail: an import from the store into the web room, or from a page builder into what
    renders and routes, or from a helper into the pages, breaks one."""
    tree = tmp_path / "tree"
    skip = shutil.ignore_patterns("static", "templates", "__pycache__")
    shutil.copytree(ROOT / "ffmem", tree / "ffmem", ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    path = tree / "ffmem" / module
    path.write_text(path.read_text() + f"\n{planted}  # noqa\n")
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    alone = {"PYTHONPATH": str(tree), "PATH": ""}
    run = subprocess.run([lint], cwd=tree, capture_output=True, text=True, env=alone)
    assert run.returncode != 0, run.stdout
    assert broken in run.stdout, run.stdout


def unnamed_modules(doc: str, package: Path) -> list[str]:
    """The modules of `package` (ffmem/) that docs/architecture.md does not name in their room's section
    (`### \\`ffmem/<room>/\\``): a module `name` right in the room as `name` in backticks; one in a folder
    of the room as `folder/name`, or as a word of the table row that starts with `folder/`."""
    sections = dict(re.findall(r"^### `ffmem/(\w+)(?:/|\.py)`.*?\n(.*?)(?=^### |^## |\Z)", doc, re.M | re.S))
    missing = []
    for module in sorted(package.rglob("*.py")):
        if module.name == "__init__.py" or module.parent == package:
            continue
        room, *folders, name = module.relative_to(package).with_suffix("").parts
        section = sections.get(room, "")
        if not folders:
            named = f"`{name}`" in section
        else:
            folder = "/".join(folders)
            rows = [row for row in section.splitlines() if row.startswith(f"| `{folder}/")]
            named = f"`{folder}/{name}`" in section or any(re.search(rf"\b{name}\b", row) for row in rows)
        if not named:
            missing.append(str(module.relative_to(package.parent)))
    return missing


def test_the_architecture_page_names_every_module():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert unnamed_modules(doc, ROOT / "ffmem") == []


def test_a_module_left_out_of_the_architecture_page_is_caught(tmp_path):
    doc = (ROOT / "docs" / "architecture.md").read_text()
    package = tmp_path / "ffmem"
    skip = shutil.ignore_patterns("static", "templates", "__pycache__")
    shutil.copytree(ROOT / "ffmem", package, ignore=skip)
    (package / "engine" / "mining" / "unheard_of.py").write_text("")
    (package / "store" / "nowhere.py").write_text("")
    found = set(unnamed_modules(doc, package)) - set(unnamed_modules(doc, ROOT / "ffmem"))
    assert found == {"ffmem/engine/mining/unheard_of.py", "ffmem/store/nowhere.py"}


SQL_CALLS = {"execute", "scalar", "scalars", "query", "get"}  # a session's ways to run SQL


def pages_with_sql(pages: Path) -> list[str]:
    """The modules of `pages` (ffmem/web/pages/) that import SQLAlchemy or run SQL on a session
    (`session.execute(…)`, `.scalars`, …): a page asks the store, which owns every query."""
    found = []
    for module in sorted(pages.rglob("*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = node.func.value
                names = []
                if isinstance(target, ast.Name) and target.id == "session" and node.func.attr in SQL_CALLS:
                    found.append(f"{module.name}: session.{node.func.attr}")
            else:
                continue
            found += [f"{module.name}: import {name}" for name in names if name.split(".")[0] == "sqlalchemy"]
    return found


def test_pages_ask_the_store_and_write_no_sql():
    assert pages_with_sql(ROOT / "ffmem" / "web" / "pages") == []


def test_sql_in_a_page_is_caught(tmp_path):
    pages = tmp_path / "pages"
    shutil.copytree(ROOT / "ffmem" / "web" / "pages", pages, ignore=shutil.ignore_patterns("__pycache__"))
    (pages / "planted.py").write_text(
        "from sqlalchemy.orm import Session\n"
        "import sqlalchemy as sa\n\n\n"
        "def rows(session: Session):\n"
        "    return session.execute(sa.text('SELECT 1')), session.scalars(None)\n"
    )
    assert pages_with_sql(pages) == [
        "planted.py: import sqlalchemy.orm",
        "planted.py: import sqlalchemy",
        "planted.py: session.execute",
        "planted.py: session.scalars",
    ]
