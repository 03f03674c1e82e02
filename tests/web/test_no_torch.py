"""The web process never imports torch: it reads the database only (numpy serves provisional results)."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

import pytest


def test_the_web_app_and_its_pages_do_not_import_torch():
    probe = (
        "import sys; from ffmem.web.main import create_app; from ffmem.config import Settings; "
        "import ffmem.web.pages, ffmem.store.results, ffmem.store.jobs, ffmem.web.routes.jobs; "
        "create_app(Settings(database_url='sqlite:///:memory:')); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    found = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]", found.stdout + found.stderr


# Imported by a runtime dependency only when installed, never needed: tenacity loads tornado (its tornado
# retries) where the dev tools installed it (ipykernel, for the example notebook's test).
OPTIONAL_IMPORTS = {"tornado"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=\[ ;(!~]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _with_requirements(names: set[str]) -> set[str]:
    """`names` and everything they require (not their extras), as installed."""
    seen, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [_name(r) for r in requires(name) or [] if "extra ==" not in r]
        except PackageNotFoundError:
            pass  # a requirement for another platform or Python
    return seen


def test_what_the_web_process_imports_is_a_runtime_dependency():
    """Every third-party package the web process and the CLI load is a runtime dependency (or one of
    theirs), not only in an extra: the Docker image installs `.[postgres]`, not the dev tools."""
    tomllib = pytest.importorskip("tomllib")  # Python ≥ 3.11
    root = Path(__file__).resolve().parents[2]
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    probe = (
        "import sys; from ffmem.web.main import create_app; from ffmem.config import Settings; "
        "import ffmem.cli; "
        "create_app(Settings(database_url='sqlite:///:memory:')); print(' '.join(sorted(sys.modules)))"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    owners = packages_distributions()
    used = {_name(dist) for module in run.stdout.split() for dist in owners.get(module.split(".")[0], [])}
    missing = used - _with_requirements({_name(r) for r in declared}) - {"ffmem"} - OPTIONAL_IMPORTS
    assert not missing, f"imported but not a runtime dependency: {sorted(missing)}"
