"""Moving a run: `export` (a run whole as files, or Neuronpedia's bulk layout) and `import` (an export
into this database)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ffmem.cli.common import DbOption, fail_cleanly
from ffmem.config import get_settings
from ffmem.engine.errors import FfmemError


def export(
    run: Annotated[int, typer.Argument(min=1, help="The index run to export.")],
    format: Annotated[
        str, typer.Option("--format", help="jsonl, parquet (needs pyarrow) or neuronpedia.")
    ] = "parquet",
    out: Annotated[Path | None, typer.Option(help="Folder to write (default: export-run-RUN).")] = None,
    db: DbOption = None,
) -> None:
    """Write a run whole (its model, vocabulary, corpus, every result table, analyses and labels, with a
    manifest of checksums) for `ffmem import`; or, with --format neuronpedia, Neuronpedia's bulk layout."""
    url = db or get_settings().database_url
    folder = out or Path(f"export-run-{run}")

    def work():
        from ffmem.store.db import make_engine, make_sessionmaker, upgrade
        from ffmem.store.export import FORMATS, export_run

        if format not in (*FORMATS, "neuronpedia"):
            raise FfmemError(f"unknown export format {format!r}; choose jsonl, parquet or neuronpedia")
        upgrade(url)  # a database of an older ffmem reads as this one writes
        if format == "neuronpedia":
            from ffmem.neuronpedia import export_neuronpedia

            return export_neuronpedia(url=url, run_id=run, folder=folder)

        engine = make_engine(url)
        try:
            with make_sessionmaker(engine)() as session:
                return export_run(session=session, run_id=run, folder=folder, fmt=format)
        finally:
            engine.dispose()

    written = fail_cleanly(work)
    rows = ", ".join(f"{name} {count:,}" for name, count in written.items())
    typer.echo(f"wrote run {run} to {folder}/ ({format}): {rows}")


def import_(
    folder: Annotated[Path, typer.Argument(help="A folder written by `ffmem export` (jsonl or parquet).")],
    db: DbOption = None,
) -> None:
    """Load an exported run into this database (SQLite or Postgres) in one transaction: its model (unless
    here with the same weights), vocabulary, corpus, every result table, analyses and labels."""
    url = db or get_settings().database_url

    def work():
        from ffmem.store.db import make_engine, make_sessionmaker, upgrade
        from ffmem.store.imports import import_run

        upgrade(url)  # a new database gets its tables first
        engine = make_engine(url)
        try:
            with make_sessionmaker(engine)() as session, session.begin():
                return import_run(session=session, folder=folder)
        finally:
            engine.dispose()

    imported = fail_cleanly(work)
    kept = [what for what, new in (("model", imported.new_model), ("corpus", imported.new_corpus)) if not new]
    note = f" (the {' and '.join(kept)} already here)" if kept else ""
    total = sum(imported.rows.values())
    typer.echo(f"imported {folder} as run {imported.run_id} of {imported.model}{note}: {total:,} rows")
