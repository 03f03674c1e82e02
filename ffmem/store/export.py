"""`ffmem export`: one index run as files a notebook reads — JSON Lines or Parquet, a file per table.

    run.json            the run, its model and corpus, with provenance
    sentences.*         index, text (the triggers point into it)
    triggers.*          layer, key, sign, rank, sentence_index, position, coefficient
    value_tokens.*      layer, key, readout, direction, rank, token_id, token, logit, prob
    value_histograms.*  layer, key, readout, low, high, counts (a value's logits over the vocabulary, binned)
    key_stats.*         layer, key and every statistic (the histogram as a list)
    analyses.*          name, options, data (JSON text), seconds
    labels.*            layer, key, pattern, tag, author, created_at, current (the history too)

Rows are streamed from the database in chunks, so a full index (millions of triggers) exports in
bounded memory. Parquet needs pyarrow (`pip install pyarrow`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy import Integer, func, select
from sqlalchemy.orm import Session

from ffmem.engine.errors import FfmemError
from ffmem.store import memory_reads, value_histograms
from ffmem.store.models import Analysis, KeyStats, Label, Run, Sentence, Token

FORMATS = ("jsonl", "parquet")
CHUNK = 50_000


def export_run(*, session: Session, run_id: int, folder: Path, fmt: str) -> dict[str, int]:
    """Write run `run_id` into `folder`; rows written per table."""
    if fmt not in FORMATS:
        raise FfmemError(f"unknown export format {fmt!r}; choose {' or '.join(FORMATS)}")
    run = session.get(Run, run_id)
    if run is None:
        raise FfmemError(f"there is no run {run_id}")
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise FfmemError(
                "Parquet needs pyarrow: pip install pyarrow (or export --format jsonl)"
            ) from None
    folder.mkdir(parents=True, exist_ok=True)
    model = run.model
    (folder / "run.json").write_text(
        json.dumps(
            {
                "run": run.id,
                "status": run.status,
                "model": {"slug": model.slug, "source": model.source, "revision": model.revision},
                "corpus": {"name": run.corpus.name, "sha256": run.corpus.source_sha256},
                "n_sentences": run.n_sentences,
                "n_tokens": run.n_tokens,
                "top_k": run.top_k,
                "provenance": run.provenance,
                "histogram_edges": run.histogram_edges,
            },
            indent=2,
        )
    )
    texts = dict(session.execute(select(Token.token_id, Token.text).where(Token.model_id == model.id)).all())
    newest = select(func.max(Label.id)).where(Label.model_id == model.id).group_by(Label.layer, Label.key)
    current = set(session.scalars(newest))
    tables = {
        "sentences": (
            select(Sentence.index, Sentence.text)
            .where(Sentence.corpus_id == run.corpus_id)
            .order_by(Sentence.index),
            lambda row: {"index": row.index, "text": row.text},
        ),
        "triggers": (
            memory_reads.iter_triggers(session=session, run_id=run.id),
            lambda t: {
                "layer": t.layer,
                "key": t.key,
                "sign": t.sign,
                "rank": t.rank,
                "sentence_index": t.sentence_index,
                "position": t.position,
                "coefficient": t.coefficient,
            },
        ),
        "value_tokens": (
            memory_reads.iter_value_tokens(session=session, run_id=run.id),
            lambda v: {
                "layer": v.layer,
                "key": v.key,
                "readout": v.readout,
                "direction": v.direction,
                "rank": v.rank,
                "token_id": v.token_id,
                "token": texts.get(v.token_id, ""),
                "logit": v.logit,
                "prob": v.prob,
            },
        ),
        "value_histograms": (
            value_histograms.iter_value_histograms(session=session, run_id=run.id),
            lambda row: {
                "layer": row[0],
                "key": row[1],
                "readout": row[2],
                "low": row[3].low,
                "high": row[3].high,
                "counts": row[3].counts,
            },
        ),
        "key_stats": (
            select(KeyStats).where(KeyStats.run_id == run.id).order_by(KeyStats.layer, KeyStats.key),
            lambda s: {
                column.name: getattr(s, column.name)
                for column in KeyStats.__table__.columns
                if column.name != "run_id"
            },
        ),
        "analyses": (
            select(Analysis).where(Analysis.run_id == run.id).order_by(Analysis.name),
            lambda a: {
                "name": a.name,
                "options": json.dumps(a.options),
                "data": json.dumps(a.data),
                "seconds": a.seconds,
            },
        ),
        "labels": (
            select(Label).where(Label.model_id == model.id).order_by(Label.layer, Label.key, Label.id),
            lambda label: {
                "layer": label.layer,
                "key": label.key,
                "pattern": label.pattern,
                "tag": label.tag,
                "author": label.author,
                "created_at": label.created_at.isoformat(),
                "current": label.id in current,
            },
        ),
    }
    written = {}
    for name, (query, to_dict) in tables.items():
        found = query if isinstance(query, Iterator) else _stream(session, query)  # memory lists: decoded
        rows = (to_dict(row) for row in found)
        written[name] = (_write_jsonl if fmt == "jsonl" else _write_parquet)(folder / f"{name}.{fmt}", rows)
    return written


def _stream(session: Session, query) -> Iterator:
    """Rows (or ORM objects) of `query`, fetched CHUNK at a time."""
    result = session.execute(query.execution_options(yield_per=CHUNK))
    for row in result:
        yield row[0] if len(row) == 1 else row


def _write_jsonl(path: Path, rows: Iterator[dict]) -> int:
    count = 0
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    return count


def _write_parquet(path: Path, rows: Iterator[dict]) -> int:
    """Rows as Parquet, CHUNK at a time. The schema is the first chunk's, with its all-null columns
    typed as the model says (Integer columns int64, the rest float64: every nullable column we export
    is a number); later chunks are cast to it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer, count, batch = None, 0, []
    integers = {column.name for column in KeyStats.__table__.columns if isinstance(column.type, Integer)}

    def flush():
        nonlocal writer
        if writer is None:
            inferred = pa.Table.from_pylist(batch).schema
            schema = pa.schema(
                [
                    field.with_type(pa.int64() if field.name in integers else pa.float64())
                    if pa.types.is_null(field.type)
                    else field
                    for field in inferred
                ]
            )
            writer = pq.ParquetWriter(path, schema)
        writer.write_table(pa.Table.from_pylist(batch, schema=writer.schema))
        batch.clear()

    for row in rows:
        batch.append(row)
        count += 1
        if len(batch) >= CHUNK:
            flush()
    if batch:
        flush()
    if writer is None:  # no rows: an empty file with no columns
        pq.write_table(pa.table({}), path)
    else:
        writer.close()
    return count
