"""`ffmem export`: one finished index run, whole — every table it fills, with its model, vocabulary,
corpus and the model's labels — as files another database imports (ffmem.store.imports).

    manifest.json      what the folder holds: the format and its version, the run it came from, and per
                       file its rows, bytes and sha256 (the import checks them all before it writes)
    <table>.parquet    one file a table (or .jsonl): its rows as stored, ordered by primary key, without
                       the ids that tie them to this database (the run's, model's and corpus's), which the
                       import assigns anew; packed lists stay packed (binary in Parquet, base64 in JSON
                       Lines), JSON columns are JSON text (Parquet) or JSON values (JSON Lines)

The tables (`TABLES`): the model (`language_models`, `tokens`, `labels`), the corpus (`corpora`,
`sentences`), the run (`runs`) and its results: triggers and value tokens (`memory_lists`), statistics
(`key_stats`) and the layer table's stored orders (`key_orders`), band samples, shading and quadrant
examples (`key_examples`), value histograms, the token → memories table (`token_memories`), each
sentence's triggers (`sentence_triggers`), neighbours and their baselines, the weight graph
(`memory_links`), explanations with their token tables, the sampled memories' TokenChange
(`token_changes`), and the paper's analyses. Not exported:
comparisons (they join two runs), jobs, shards and mined layers (how it was built).

Rows stream from the database in chunks, so a full index exports in bounded memory. Parquet (zstd) needs
pyarrow (`pip install 'ffmem[parquet]'`); a decoded view of the memories for notebooks is ffmem.api.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import JSON, Boolean, DateTime, Float, Integer, LargeBinary, SmallInteger, Table, select
from sqlalchemy.orm import Session

from ffmem.engine.errors import FfmemError
from ffmem.engine.mining.text_files import sha256
from ffmem.store.db import json_dumps
from ffmem.store.models import (
    Analysis,
    Corpus,
    Explanation,
    KeyExamples,
    KeyOrder,
    KeyStats,
    Label,
    LanguageModel,
    MemoryLinks,
    MemoryList,
    NeighbourBaseline,
    Neighbours,
    Run,
    RunStatus,
    Sentence,
    SentenceTriggers,
    Token,
    TokenChangeRow,
    TokenMemoryList,
    ValueHistogram,
)

FORMAT = "ffmem-export"
VERSION = 1  # the layout's version: an import refuses a newer one
FORMATS = ("jsonl", "parquet")
CHUNK = 50_000
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class ExportedTable:
    """A table as exported: `owner`, the column that ties its rows to the run, model or corpus (left out of
    the file, set by the import), and `dropped`, the other columns the target database assigns."""

    table: Table
    owner: str | None  # run_id | model_id | corpus_id; None: the row is the owner itself
    dropped: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.table.name

    @property
    def columns(self) -> list[str]:
        skip = {self.owner, *self.dropped}
        return [column.name for column in self.table.columns if column.name not in skip]


def _run_table(model) -> ExportedTable:
    return ExportedTable(model.__table__, "run_id")


# In the order an import writes them: owners first.
TABLES = (
    ExportedTable(LanguageModel.__table__, None, ("id",)),
    ExportedTable(Token.__table__, "model_id"),
    ExportedTable(Label.__table__, "model_id", ("id",)),
    ExportedTable(Corpus.__table__, None, ("id",)),
    ExportedTable(Sentence.__table__, "corpus_id"),
    ExportedTable(Run.__table__, None, ("id", "model_id", "corpus_id")),
    *(
        _run_table(model)
        for model in (
            MemoryList, KeyStats, KeyOrder, KeyExamples, ValueHistogram, TokenMemoryList, SentenceTriggers,
            Neighbours, NeighbourBaseline, MemoryLinks, Explanation, TokenChangeRow, Analysis,
        )
    ),
)  # fmt: skip
OWNERS = {"run_id": Run, "model_id": LanguageModel, "corpus_id": Corpus}


def export_run(*, session: Session, run_id: int, folder: Path, fmt: str) -> dict[str, int]:
    """Write run `run_id` whole into `folder` (every table of `TABLES`, then the manifest); rows per table."""
    if fmt not in FORMATS:
        raise FfmemError(f"unknown export format {fmt!r}; choose {' or '.join(FORMATS)}")
    run = session.get(Run, run_id)
    if run is None:
        raise FfmemError(f"there is no run {run_id}")
    if run.status != RunStatus.done:
        raise FfmemError(f"run {run_id} is {run.status.value}: only a finished run exports")
    if fmt == "parquet":
        require_pyarrow()
    folder.mkdir(parents=True, exist_ok=True)
    ids = {"run_id": run.id, "model_id": run.model_id, "corpus_id": run.corpus_id}
    files, written = {}, {}
    for exported in TABLES:
        table = exported.table
        owner_id = ids[exported.owner] if exported.owner else ids[_own_id(exported)]
        where = table.c[exported.owner or "id"] == owner_id
        query = select(*(table.c[name] for name in exported.columns)).where(where)
        query = query.order_by(*table.primary_key.columns)
        rows = _stream(session, query)
        path = folder / f"{exported.name}.{fmt}"
        count = (write_jsonl if fmt == "jsonl" else write_parquet)(path, exported, rows)
        written[exported.name] = count
        files[path.name] = {"rows": count, "bytes": path.stat().st_size, "sha256": sha256(path)}
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "encoding": fmt,
        "run": {
            "id": run.id,
            "model": run.model.slug,
            "revision": run.model.revision,
            "corpus": run.corpus.name,
            "corpus_fingerprint": run.corpus.fingerprint,
            "started_at": utc(run.started_at).isoformat(),
        },
        "files": files,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return written


def _own_id(exported: ExportedTable) -> str:
    """The ids key of a table that is an owner itself (its `id` column)."""
    return next(key for key, model in OWNERS.items() if model.__table__ is exported.table)


def utc(moment: datetime) -> datetime:
    """A timestamp as an aware UTC datetime (SQLite gives back naive UTC ones, Postgres aware ones)."""
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


def require_pyarrow() -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise FfmemError("Parquet needs pyarrow: pip install pyarrow (or --format jsonl)") from None


def _stream(session: Session, query) -> Iterator[tuple]:
    """Rows of `query`, fetched CHUNK at a time."""
    yield from session.execute(query.execution_options(yield_per=CHUNK))


def write_jsonl(path: Path, exported: ExportedTable, rows: Iterator[tuple]) -> int:
    """Rows as JSON Lines: binary columns base64, timestamps ISO 8601, JSON columns as JSON values."""
    names = exported.columns
    encoders = [_jsonl_encoder(exported.table.c[name].type) for name in names]
    count = 0
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            record = {name: encode(value) for name, encode, value in zip(names, encoders, row, strict=True)}
            out.write(json_dumps(record) + "\n")
            count += 1
    return count


def _jsonl_encoder(kind):
    if isinstance(kind, LargeBinary):
        return lambda value: None if value is None else base64.b64encode(value).decode("ascii")
    if isinstance(kind, DateTime):
        return lambda value: None if value is None else utc(value).isoformat()
    if hasattr(kind, "enums"):  # a status stored as text
        return lambda value: None if value is None else str(value.value if hasattr(value, "value") else value)
    return lambda value: value


def arrow_schema(exported: ExportedTable):
    """The Parquet schema of a table, from its SQLAlchemy types (JSON as text, binary as binary)."""
    import pyarrow as pa

    def arrow_type(kind):
        if isinstance(kind, SmallInteger):
            return pa.int16()
        if isinstance(kind, Integer):
            return pa.int64()
        if isinstance(kind, Float):
            return pa.float64()
        if isinstance(kind, Boolean):
            return pa.bool_()
        if isinstance(kind, LargeBinary):
            return pa.binary()
        if isinstance(kind, DateTime):
            return pa.timestamp("us", tz="UTC")
        return pa.string()  # text, enums, JSON

    return pa.schema([(name, arrow_type(exported.table.c[name].type)) for name in exported.columns])


def write_parquet(path: Path, exported: ExportedTable, rows: Iterator[tuple]) -> int:
    """Rows as Parquet (zstd), CHUNK rows a row group."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = arrow_schema(exported)
    names = exported.columns
    json_columns = [i for i, name in enumerate(names) if isinstance(exported.table.c[name].type, JSON)]
    enums = [i for i, name in enumerate(names) if hasattr(exported.table.c[name].type, "enums")]
    count = 0
    with pq.ParquetWriter(path, schema, compression="zstd") as writer:
        batch: list[tuple] = []

        def flush():
            columns = list(zip(*batch, strict=True))
            for i in json_columns:
                columns[i] = [None if value is None else json_dumps(value) for value in columns[i]]
            for i in enums:
                columns[i] = [None if value is None else str(value.value) for value in columns[i]]
            writer.write_table(
                pa.Table.from_arrays(list(map(pa.array, columns, schema.types)), schema=schema)
            )
            batch.clear()

        for row in rows:
            batch.append(tuple(row))
            count += 1
            if len(batch) >= CHUNK:
                flush()
        if batch:
            flush()
    return count


def read_rows(path: Path, exported: ExportedTable, fmt: str) -> Iterator[tuple]:
    """The rows of an exported file as tuples of `exported.columns`, decoded as the database takes them
    (bytes, datetimes, JSON values), CHUNK rows at a time."""
    names = exported.columns
    kinds = [exported.table.c[name].type for name in names]
    if fmt == "jsonl":
        decoders = [_jsonl_decoder(kind) for kind in kinds]
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                record = json.loads(line)
                yield tuple(decode(record[name]) for name, decode in zip(names, decoders, strict=True))
        return
    import pyarrow.parquet as pq

    json_columns = [i for i, kind in enumerate(kinds) if isinstance(kind, JSON)]
    parquet = pq.ParquetFile(path)
    if parquet.schema_arrow.names != names:
        raise FfmemError(f"{path.name}: columns {parquet.schema_arrow.names} are not {names}")
    for batch in parquet.iter_batches(batch_size=CHUNK):
        columns = [column.to_pylist() for column in batch.columns]
        for i in json_columns:
            columns[i] = [None if value is None else json.loads(value) for value in columns[i]]
        yield from zip(*columns, strict=True)


def _jsonl_decoder(kind):
    if isinstance(kind, LargeBinary):
        return lambda value: None if value is None else base64.b64decode(value)
    if isinstance(kind, DateTime):
        return lambda value: None if value is None else datetime.fromisoformat(value)
    return lambda value: value
