"""`ffmem import`: a run exported by `ffmem export` (ffmem.store.export, either encoding) loaded into this
database, SQLite or Postgres, in the session's one transaction: every check comes before the first write
and any failure rolls back, so nothing half-written stays.

Refused, with the file and the reason: a folder without a manifest, a file it lists that is missing or whose
sha256 differs (truncated or changed), a format version newer than this ffmem reads, a model of the same
name already here with other weights (its revision, or the weights' checksum its runs recorded), the same
run imported before ("already imported": nothing is added). A model already here (same weights) gets a run
more, its vocabulary kept and the export's labels added where it lacks them; a corpus already here (same
fingerprint: the same sentences, tokenized alike) is shared.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from ffmem.engine.errors import FfmemError
from ffmem.store import bulk, runs
from ffmem.store.export import (
    FORMAT,
    FORMATS,
    MANIFEST,
    TABLES,
    VERSION,
    ExportedTable,
    read_rows,
    require_pyarrow,
    sha256,
    utc,
)
from ffmem.store.models import Corpus, Label, LanguageModel, Run


@dataclass(frozen=True)
class Imported:
    """What an import added: the new run's id, its model's slug, whether the model and corpus were new,
    and the rows written per table (0 for a model's or corpus's tables that were already here)."""

    run_id: int
    model: str
    new_model: bool
    new_corpus: bool
    rows: dict[str, int]


def read_manifest(folder: Path) -> dict:
    """The export's manifest, its format and version checked, every file it lists present and unchanged."""
    path = folder / MANIFEST
    if not path.is_file():
        raise FfmemError(f"{path}: missing; not an ffmem export folder")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise FfmemError(f"{path}: not JSON ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FfmemError(f"{path}: not an ffmem export (format {manifest.get('format')!r})")
    version = manifest.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise FfmemError(
            f"{path}: export format version {version} is newer than this ffmem reads "
            f"({VERSION}); upgrade ffmem"
        )
    fmt = manifest.get("encoding")
    if fmt == "parquet":
        require_pyarrow()
    if fmt not in FORMATS:
        raise FfmemError(f"{path}: unknown encoding {fmt!r}")
    files = manifest.get("files")
    for exported in TABLES:
        name = f"{exported.name}.{fmt}"
        listed = files.get(name) if isinstance(files, dict) else None
        if not isinstance(listed, dict) or not isinstance(listed.get("sha256"), str):
            raise FfmemError(f"{path}: lists no {name}")
        if not (folder / name).is_file():
            raise FfmemError(f"{folder / name}: missing")
        if sha256(folder / name) != listed["sha256"]:
            raise FfmemError(f"{folder / name}: checksum differs from the manifest's (truncated or changed)")
    return manifest


def import_run(*, session: Session, folder: Path) -> Imported:
    """Load the export in `folder` into the session's database; commit is the caller's (one transaction)."""
    manifest = read_manifest(folder)
    fmt = manifest["encoding"]
    by_name = {exported.name: exported for exported in TABLES}

    def rows(name: str):
        exported = by_name[name]
        return read_rows(folder / f"{name}.{fmt}", exported, fmt)

    def one(name: str) -> dict:
        found = list(rows(name))
        if len(found) != 1:
            raise FfmemError(f"{folder / name}.{fmt}: {len(found)} rows, not one")
        return dict(zip(by_name[name].columns, found[0], strict=True))

    model_row, corpus_row, run_row = one("language_models"), one("corpora"), one("runs")
    model = session.scalars(
        select(LanguageModel).where(LanguageModel.slug == model_row["slug"])
    ).one_or_none()
    if model is not None:
        _same_weights(session, model, model_row["revision"], run_row["provenance"].get("weights_sha256"))
    corpus_query = select(Corpus).where(Corpus.fingerprint == corpus_row["fingerprint"])
    corpus = session.scalars(corpus_query).one_or_none()
    if model is not None and corpus is not None:
        twin = _same_run(session, model.id, corpus.id, run_row)
        if twin is not None:
            raise FfmemError(f"already imported: run {twin} of this database is this run; nothing added")
    written = {exported.name: 0 for exported in TABLES}
    new_model, new_corpus = model is None, corpus is None

    def owner(name: str, row: dict, contents: str) -> int:
        """Insert a model or corpus row and its rows (vocabulary, sentences): its new id."""
        owner_id = _insert_owner(session, by_name[name], row)
        written[name], written[contents] = 1, _bulk(session, by_name[contents], rows(contents), owner_id)
        return owner_id

    model_id = owner("language_models", model_row, "tokens") if new_model else model.id
    written["labels"] = _labels(session, by_name["labels"], rows("labels"), model_id)
    corpus_id = owner("corpora", corpus_row, "sentences") if new_corpus else corpus.id
    run_id = _insert_owner(
        session, by_name["runs"], {**run_row, "model_id": model_id, "corpus_id": corpus_id}
    )
    written["runs"] = 1
    for exported in TABLES:
        if exported.owner == "run_id":
            written[exported.name] = _bulk(session, exported, rows(exported.name), run_id)
    for name, count in written.items():
        expected = manifest["files"][f"{name}.{fmt}"]["rows"]
        if count and count != expected:
            raise FfmemError(f"{folder / name}.{fmt}: {count} rows read, the manifest says {expected}")
    session.flush()
    runs._gather_statistics(session)
    return Imported(run_id, model_row["slug"], new_model, new_corpus, written)


def _same_weights(session: Session, model: LanguageModel, revision: str | None, weights: str | None) -> None:
    """Refuse a model here under the export's name whose weights differ: its revision (a commit hash or the
    file's sha256), or the weights' checksum its runs recorded (their provenance's weights_sha256)."""
    here = {
        provenance.get("weights_sha256")
        for provenance in session.scalars(select(Run.provenance).where(Run.model_id == model.id))
    } - {None}
    if model.revision != revision:
        differ = f"revision {model.revision} here, {revision} in the export"
    elif weights and here and weights not in here:
        differ = f"weights sha256 {', '.join(sorted(here))} here, {weights} in the export"
    else:
        return
    raise FfmemError(
        f"model {model.slug} is already here with other weights ({differ}); import into another database"
    )


def _same_run(session: Session, model_id: int, corpus_id: int, run_row: dict) -> int | None:
    """The id of a run of this model and corpus started at the same instant with the same provenance."""
    query = select(Run.id, Run.started_at, Run.provenance).where(
        Run.model_id == model_id, Run.corpus_id == corpus_id
    )
    started = utc(run_row["started_at"])
    for run_id, started_at, provenance in session.execute(query):
        if utc(started_at) == started and provenance == run_row["provenance"]:
            return run_id
    return None


def _insert_owner(session: Session, exported: ExportedTable, row: dict) -> int:
    """Insert a model, corpus or run row (a few columns: Core's insert, types as the ORM writes them)."""
    table = exported.table
    return session.execute(insert(table).values(**row).returning(table.c.id)).scalar_one()


def _bulk(session: Session, exported: ExportedTable, rows, owner_id: int) -> int:
    """Bulk-insert a table's rows under `owner_id` (ffmem.store.bulk: COPY on Postgres); rows written."""
    count = 0

    def owned():
        nonlocal count
        for row in rows:
            count += 1
            yield (owner_id, *row)

    bulk.bulk_insert(session, exported.table, [exported.owner, *exported.columns], owned())
    return count


def _labels(session: Session, exported: ExportedTable, rows, model_id: int) -> int:
    """Add the export's labels the model lacks (same memory, text, tag, author and time), oldest first."""
    fields = ("layer", "key", "pattern", "tag", "author", "created_at")
    have = {
        (*row[:5], utc(row[5]))
        for row in session.execute(
            select(*(Label.__table__.c[f] for f in fields)).where(Label.model_id == model_id)
        )
    }
    added = 0
    for row in rows:
        label = dict(zip(exported.columns, row, strict=True))
        mark = (*(label[f] for f in fields[:5]), utc(label["created_at"]))
        if mark not in have:
            session.execute(insert(Label.__table__).values(model_id=model_id, **label))
            have.add(mark)
            added += 1
    return added
