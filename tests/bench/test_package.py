"""bench/ is a package run as `python -m bench.NAME`: every module imports and answers `--help` without
editing sys.path; no bench file edits sys.path or imports tests/; the commands that run the benchmarks
(Makefile, README, docs, bench/device/*.sh) name them as modules."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in BENCH.rglob("*.py")
    if path.name != "__init__.py"
)
SCRIPTS = [
    name
    for name in MODULES
    if 'if __name__ == "__main__":' in (ROOT / f"{name.replace('.', '/')}.py").read_text()
]
LIBRARIES = {
    "bench.compiled_reads",
    "bench.harness",
    "bench.synthetic_index",
    "bench.tiny_tokenizer",
}  # imported, never run


def test_every_module_is_a_script_or_a_named_library():
    assert set(MODULES) - set(SCRIPTS) == LIBRARIES
    assert "bench.live_trace" in SCRIPTS and "bench.trace" not in MODULES  # no shadow of the stdlib's trace


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_imports_and_answers_help(name, monkeypatch, capsys):
    module = importlib.import_module(name)
    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ")
    described = (module.__doc__ or "").strip().splitlines()[0]
    assert "".join(described.split()) in "".join(out.split())  # argparse wraps it, at hyphens too


def test_a_script_runs_as_a_module_from_the_repository_root():
    """As the Makefile runs them: `python -m bench.NAME` in the root, no PYTHONPATH given."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    for name in ("bench.live_trace", "bench.device.run_index"):
        done = subprocess.run(
            [sys.executable, "-m", name, "--help"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("usage: ")


def imports_of(path: Path) -> list[str]:
    """The modules a file imports (`from . import` relative to its package)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append("." * node.level + (node.module or ""))
    return found


def sys_path_uses(path: Path) -> list[int]:
    """Lines where a file reads or changes `sys.path` (or `sys.path_hooks`, `site.addsitedir`)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in {("sys", "path"), ("sys", "path_hooks"), ("site", "addsitedir")}:
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("path", sorted(BENCH.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_bench_file_edits_sys_path_or_imports_tests(path):
    assert sys_path_uses(path) == [], f"{path.name} touches sys.path"
    siblings = {name.rsplit(".", 1)[-1] for name in MODULES} - {"bench"}
    for module in imports_of(path):
        top = module.split(".")[0]
        assert top != "tests", f"{path.name} imports {module}: what bench needs lives in bench/ or ffmem/"
        assert top not in siblings or module.startswith("bench."), f"{path.name}: import bench.{module}"


def test_the_checks_above_catch_what_they_forbid(tmp_path):
    """A file that does what the bench files must not is caught (the checks can fail)."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import sys\nsys.path.insert(0, '.')\nfrom tests.tiny_models import tiny\nfrom web import serve\n"
    )
    assert sys_path_uses(bad) == [2]
    assert imports_of(bad) == ["sys", "tests.tiny_models", "web"]


COMMAND_FILES = [ROOT / "Makefile", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
                 *sorted((BENCH / "device").glob("*.sh"))]  # fmt: skip


@pytest.mark.parametrize("path", COMMAND_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_name_the_benchmarks_as_modules(path):
    """No `python bench/x.py` (or `$(PY) bench/…`, `"$PYTHON" bench/…`): they run as `-m bench.x`, and
    every `-m bench.x` named is a module that exists."""
    text = path.read_text()
    assert not re.findall(r"(?:python3?|\$\(PY\)|\$PYTHON\"?)\s+bench/\S+\.py", text)
    for name in re.findall(r"-m (bench(?:\.[a-z_]+)+)\b", text):  # not bench.NAME
        assert name in SCRIPTS, f"{path.name} runs {name}, which is not a bench script"
