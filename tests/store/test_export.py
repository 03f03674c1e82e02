"""`ffmem export RUN`: a run whole — every table it fills, with its model, vocabulary, corpus and labels — as
JSON Lines or Parquet, with a manifest of rows and checksums; equal to the database, row for row."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from ffmem.cli import cli
from ffmem.store.export import TABLES as EXPORTED
from ffmem.store.models import Base, Label, MemoryList, Run, Sentence, Token

# Both backends: the export reads every table as the backend stores it (float32 on Postgres).
pytestmark = pytest.mark.backends("sqlite", "postgres")

TABLES = {
    "language_models", "tokens", "labels", "corpora", "sentences", "runs", "memory_lists", "key_stats",
    "key_orders", "key_examples", "value_histograms", "token_memories", "sentence_triggers", "neighbours",
    "neighbour_baselines", "memory_links", "explanations", "token_changes", "analyses",
}  # fmt: skip


# How a run was built, or two runs joined: not part of a run's export.
NOT_EXPORTED = {"jobs", "shards", "mined_layers", "comparisons", "key_changes"}


def test_every_table_of_a_run_model_or_corpus_is_exported_or_named_as_not():
    """A table added later (with a run, model or corpus column) is exported, or listed here with why not."""
    owned = {
        name
        for name, table in Base.metadata.tables.items()
        if {"run_id", "model_id", "corpus_id"} & set(table.columns.keys()) or name in TABLES
    }
    assert {exported.name for exported in EXPORTED} == owned - NOT_EXPORTED | {"language_models", "corpora"}
    assert TABLES == {exported.name for exported in EXPORTED}


def _read(path) -> list[dict]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_export_writes_every_table_with_a_manifest(explorer_db, db, tmp_path, fmt):
    run = db.scalars(select(Run)).one()
    for pattern, author in (("a city", "ada"), ("capitals", "bob")):
        db.add(
            Label(
                model_id=run.model_id, layer=1, key=4, pattern=pattern, tag="semantic", author=author,
                created_at=run.started_at,
            )
        )  # fmt: skip
    db.commit()
    try:
        out = tmp_path / "out"
        result = CliRunner().invoke(
            cli, ["export", str(run.id), "--format", fmt, "--out", str(out), "--db", explorer_db]
        )
        assert result.exit_code == 0, result.output
        manifest = json.loads((out / "manifest.json").read_text())
        assert (manifest["format"], manifest["version"], manifest["encoding"]) == ("ffmem-export", 1, fmt)
        assert manifest["run"]["id"] == run.id and manifest["run"]["model"] == run.model.slug
        assert set(manifest["files"]) == {f"{name}.{fmt}" for name in TABLES}
        for name, listed in manifest["files"].items():
            data = (out / name).read_bytes()
            assert listed["sha256"] == hashlib.sha256(data).hexdigest() and listed["bytes"] == len(data)
            assert listed["rows"] == len(_read(out / name)), name
        rows = {name: manifest["files"][f"{name}.{fmt}"]["rows"] for name in TABLES}
        assert rows["language_models"] == rows["corpora"] == rows["runs"] == 1
        assert rows["tokens"] == db.scalar(select(func.count()).select_from(Token)) == run.model.vocab_size
        assert rows["sentences"] == run.corpus.n_sentences  # held-out ones too
        n_memories = run.model.n_layers * run.model.n_keys
        for name in ("key_stats", "key_examples", "value_histograms", "neighbours", "memory_links"):
            assert rows[name] == n_memories, name
        assert rows["memory_lists"] == 6 * n_memories  # triggers ± and both readouts' values ±
        # The packed lists as stored, bytes for bytes (base64 in JSON Lines), without the run's id.
        lists = _read(out / f"memory_lists.{fmt}")
        assert set(lists[0]) == {"kind", "sign", "layer", "key", "data"}
        first = lists[0]
        stored = db.get(MemoryList, (run.id, first["kind"], first["sign"], first["layer"], first["key"])).data
        assert (base64.b64decode(first["data"]) if fmt == "jsonl" else first["data"]) == stored
        sentence = _read(out / f"sentences.{fmt}")[3]
        token_ids = sentence["token_ids"] if fmt == "jsonl" else json.loads(sentence["token_ids"])
        assert token_ids == db.get(Sentence, (run.corpus_id, 3)).token_ids
        labels = _read(out / f"labels.{fmt}")
        assert [(label["pattern"], label["author"]) for label in labels] == [
            ("a city", "ada"),
            ("capitals", "bob"),
        ]
        assert "id" not in labels[0] and "model_id" not in labels[0]
        assert f"wrote run {run.id} to {out}/ ({fmt}): language_models 1, tokens " in result.output
    finally:
        db.execute(Label.__table__.delete())
        db.commit()


def test_export_refuses_bad_input_in_one_line(explorer_db, tmp_path):
    result = CliRunner().invoke(cli, ["export", "99", "--db", explorer_db, "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "error: there is no run 99" in result.output
    result = CliRunner().invoke(
        cli, ["export", "1", "--format", "csv", "--db", explorer_db, "--out", str(tmp_path / "x")]
    )
    assert (
        result.exit_code == 2
        and "unknown export format 'csv'; choose jsonl, parquet or neuronpedia" in result.output
    )
