"""The example notebook (examples/explore-an-index.ipynb) runs from top to bottom against the tiny index,
in a Jupyter kernel (nbclient), and shows what it says it shows."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).parents[1] / "examples" / "explore-an-index.ipynb"


def _text(cell) -> str:
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", ""))
        parts.append(output.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def test_the_example_notebook_runs_against_the_tiny_index(explorer_db, run, slug, monkeypatch):
    monkeypatch.setenv("FFMEM_INDEX", explorer_db)
    monkeypatch.setenv("PYTHONPATH", str(NOTEBOOK.parents[1]))  # the kernel imports this checkout's ffmem
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=120, kernel_name="python3").execute()  # raises on a failing cell
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert f"<Model {slug}: {run.model.n_layers} layers × {run.model.n_keys} keys>" in _text(code[0])
    n_keys = run.model.n_layers * run.model.n_keys
    assert f"<Run {run.id} of {slug} over {run.corpus.name} (done)> {n_keys} keys" in _text(code[1])
    assert "coefficient" in _text(code[2]) and "prefix" in _text(code[2])
    assert "next tokens among the raw top tokens:" in _text(code[3])
    assert "Explanation(text=" in _text(code[5])
