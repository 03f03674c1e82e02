"""What the key page's shaded sentences and band samples cost (issue 15), on an index of the default model.

- the shading pass — after mining, one forward pass over the union of the sentences of every key's first
  `shaded_triggers` triggers per sign and its band samples (ffmem.engine.mining.sentence_coefficients) — as a
  ratio of the mining pass, and how many sentences that union holds;
- storage per key (issue 15's target: ≤ 8 KB): `run_tables_bytes_per_key`, every table of the run with its
  indexes (SQLite's dbstat pages: the tables with a run_id, so not the corpus's sentences or the model's
  vocabulary, which runs share) divided by the number of keys, in all and per table; the whole database
  file per key; the band samples per key.

Builds `--sentences` of the default corpus into a fresh SQLite file (`--file`, kept for bench.web and
bench.search: run them with `--db sqlite:///` and that file). Figures go into bench-results.json under
"examples".
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import func, select, text
from sqlalchemy.engine import Connection

from bench import harness
from ffmem.config import get_settings
from ffmem.store import key_examples, memory_lists
from ffmem.store.db import make_engine, make_sessionmaker, upgrade
from ffmem.store.models import Base, KeyExamples, MemoryList
from ffmem.worker.index import IndexOptions
from ffmem.worker.loop import build_index


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--sentences", type=int, default=2000, help="0: the whole corpus (the default index)")
    parser.add_argument(
        "--file", default=str(harness.ROOT / "data" / "bench-examples.db"), help="the SQLite file built"
    )
    args = parser.parse_args()
    path = Path(args.file)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    url = f"sqlite:///{path}"
    upgrade(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    settings = get_settings()
    options = IndexOptions.from_settings(settings, sentences=args.sentences or None)
    summary = build_index(options, sessions)
    keys = summary.layers * summary.keys
    with sessions() as session:
        run_id = summary.run_id
        triggers = select(MemoryList.data).where(MemoryList.run_id == run_id, MemoryList.kind == "triggers")
        shaded = {
            int(i)
            for (data,) in session.execute(triggers)
            for i in memory_lists.decode_triggers(data)["sentence_index"][: options.spec.shaded_triggers]
        }
        samples = 0
        for (data,) in session.execute(select(KeyExamples.bands).where(KeyExamples.run_id == run_id)):
            found = key_examples.decode_bands(data)
            shaded.update(s.sentence_index for s in found)
            samples += len(found)
        shading_bytes = session.scalar(
            select(func.sum(func.length(KeyExamples.shading))).where(KeyExamples.run_id == run_id)
        )
        tables = run_table_bytes(session.connection())
    engine.dispose()
    run_total = sum(tables.values())
    figures = {
        "sentences": summary.sentences,
        "tokens": summary.tokens,
        "keys": keys,
        "mining_seconds": round(summary.mining_seconds, 1),
        "shading_seconds": round(summary.shading_seconds, 1),
        "shading_over_mining": round(summary.shading_seconds / summary.mining_seconds, 3),
        "shaded_sentences": len(shaded),
        "shaded_share_of_mined": round(len(shaded) / summary.sentences, 3),
        "band_samples_per_key": round(samples / keys, 1),
        "run_tables_bytes_per_key": round(run_total / keys),
        "run_tables_bytes_per_key_by_table": {
            name: round(size / keys) for name, size in tables.items() if round(size / keys)
        },
        "shading_bytes_per_key": round((shading_bytes or 0) / keys),
        "database_bytes_per_key": round(os.path.getsize(path) / keys),
        "target_bytes_per_key": 8192,
    }
    for name, value in figures.items():
        print(f"{name}: {value}")
    harness.record(args, "examples", figures)


def run_table_bytes(connection: Connection) -> dict[str, int]:
    """Bytes of the pages (SQLite's dbstat) of each table that holds a run's rows, with its indexes'
    (the primary key's included), the largest first: the whole database must hold one run."""
    run_tables = {table.name for table in Base.metadata.sorted_tables if "run_id" in table.c} | {"runs"}
    owner = dict(connection.execute(text("SELECT name, tbl_name FROM sqlite_master")).all())
    found: dict[str, int] = {}
    for name, size in connection.execute(text("SELECT name, sum(pgsize) FROM dbstat GROUP BY name")):
        table = owner.get(name, name)
        if table in run_tables:
            found[table] = found.get(table, 0) + size
    return dict(sorted(found.items(), key=lambda item: -item[1]))


if __name__ == "__main__":
    main()
