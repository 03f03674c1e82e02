"""The rooms' imports run one way (engine -> config -> store -> worker | web -> cli) and the web process
and the store never import torch: import-linter checks the contracts in pyproject.toml."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_imports_run_one_way_and_keep_torch_out_of_the_web_process():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    run = subprocess.run([lint], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "2 kept, 0 broken" in run.stdout, run.stdout


def test_a_reversed_import_is_caught(tmp_path):
    """The contract can fail: an import from the store into the web room breaks it."""
    tree = tmp_path / "tree"
    skip = shutil.ignore_patterns("static", "templates", "__pycache__")
    shutil.copytree(ROOT / "ffmem", tree / "ffmem", ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    runs = tree / "ffmem" / "store" / "runs.py"
    runs.write_text(runs.read_text() + "\nfrom ffmem.web import urls  # noqa\n")
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    alone = {"PYTHONPATH": str(tree), "PATH": ""}
    run = subprocess.run([lint], cwd=tree, capture_output=True, text=True, env=alone)
    assert run.returncode != 0, run.stdout
    assert "ffmem.store.runs -> ffmem.web.urls" in run.stdout, run.stdout
