"""`ffmem export RUN`: every table of the run, as JSON Lines and as Parquet, equal to the database."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from ffmem.cli import cli
from ffmem.store import memory_reads, runs, value_histograms
from ffmem.store.models import KeyStats, Label, Run

# Both backends: the export reads every table as the backend stores it (float32 on Postgres).
pytestmark = pytest.mark.backends("sqlite", "postgres")


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_export_writes_every_table(explorer_db, db, tmp_path, fmt):
    run = db.scalars(select(Run)).one()
    db.add(
        Label(
            model_id=run.model_id,
            layer=1,
            key=4,
            pattern="a city",
            tag="semantic",
            author="ada",
            created_at=run.started_at,
        )
    )
    db.add(
        Label(
            model_id=run.model_id,
            layer=1,
            key=4,
            pattern="capitals",
            tag="semantic",
            author="bob",
            created_at=run.started_at,
        )
    )
    db.commit()
    try:
        out = tmp_path / "out"
        result = CliRunner().invoke(
            cli, ["export", str(run.id), "--format", fmt, "--out", str(out), "--db", explorer_db]
        )
        assert result.exit_code == 0, result.output
        if fmt == "jsonl":
            read = _jsonl
        else:
            import pyarrow.parquet as pq

            def read(path):
                return pq.read_table(path).to_pylist()

        triggers = read(out / f"triggers.{fmt}")
        assert len(triggers) == runs.count_entries(session=db, run_id=run.id, kind="triggers")
        first = memory_reads.get_triggers(
            session=db,
            run_id=run.id,
            layer=triggers[0]["layer"],
            key=triggers[0]["key"],
            sign=triggers[0]["sign"],
        )[triggers[0]["rank"]]
        assert (triggers[0]["sentence_index"], triggers[0]["position"]) == (
            first.sentence_index,
            first.position,
        )
        assert triggers[0]["coefficient"] == pytest.approx(first.coefficient)
        values = read(out / f"value_tokens.{fmt}")
        assert len(values) == sum(
            runs.count_entries(session=db, run_id=run.id, kind=r) for r in ("raw", "norm")
        )
        assert [(v["layer"], v["key"], v["readout"], v["direction"], v["rank"]) for v in values] == sorted(
            (v["layer"], v["key"], v["readout"], v["direction"], v["rank"]) for v in values
        )
        listed = memory_reads.get_value_tokens(
            session=db, run_id=run.id, layer=0, key=0, readout="norm", direction=-1
        )
        assert [(v["token_id"], v["logit"]) for v in values[: len(listed)]] == [
            (v.token_id, v.logit) for v in listed
        ]
        assert values[0]["prob"] == pytest.approx(listed[0].prob)
        assert {"layer", "key", "readout", "direction", "rank", "token_id", "token", "logit", "prob"} == set(
            values[0]
        )
        histograms = read(out / f"value_histograms.{fmt}")
        assert len(histograms) == 2 * run.model.n_layers * run.model.n_keys  # both readouts of every value
        stored = value_histograms.value_histogram(session=db, run_id=run.id, layer=0, key=1)
        assert histograms[2:4] == [
            {"layer": 0, "key": 1, "readout": r, "low": h.low, "high": h.high, "counts": h.counts}
            for r, h in stored.items()
        ]
        stats = read(out / f"key_stats.{fmt}")
        assert len(stats) == db.scalar(
            select(func.count()).select_from(KeyStats).where(KeyStats.run_id == run.id)
        )
        assert len(read(out / f"sentences.{fmt}")) == run.corpus.n_sentences  # held-out ones too
        labels = read(out / f"labels.{fmt}")
        assert [(label["pattern"], label["current"]) for label in labels] == [
            ("a city", False),
            ("capitals", True),
        ]
        meta = json.loads((out / "run.json").read_text())
        assert meta["run"] == run.id and meta["n_sentences"] == run.n_sentences
        assert f"wrote run {run.id} to {out}/ ({fmt}): sentences {run.corpus.n_sentences}" in result.output
    finally:
        db.execute(Label.__table__.delete())
        db.commit()


def test_export_refuses_bad_input_in_one_line(explorer_db, tmp_path):
    result = CliRunner().invoke(cli, ["export", "99", "--db", explorer_db, "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "error: there is no run 99" in result.output
    result = CliRunner().invoke(
        cli, ["export", "1", "--format", "csv", "--db", explorer_db, "--out", str(tmp_path / "x")]
    )
    assert result.exit_code == 2 and "unknown export format 'csv'; choose jsonl or parquet" in result.output


def test_parquet_types_a_column_that_is_null_in_its_first_chunk(tmp_path, monkeypatch):
    """Only sampled keys have a shallowness: a first chunk of nulls must not fix the column's type."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ffmem.store import export

    monkeypatch.setattr(export, "CHUNK", 2)
    rows = [{"key": i, "shallowness": None, "next_token_rank": None} for i in range(2)]
    rows.append({"key": 2, "shallowness": 0.25, "next_token_rank": 7})
    assert export._write_parquet(tmp_path / "key_stats.parquet", iter(rows)) == 3
    table = pq.read_table(tmp_path / "key_stats.parquet")
    assert table.schema.field("shallowness").type == pa.float64()
    assert table.schema.field("next_token_rank").type == pa.int64()
    assert table.to_pylist() == rows
