"""What the key page's shaded sentences and band samples cost (issue 15), on an index of the default model.

- the shading pass — after mining, one forward pass over the union of the sentences of every key's first
  `shaded_triggers` triggers per sign and its band samples (ffmem.engine.sentence_coefficients) — as a
  ratio of the mining pass, and how many sentences that union holds;
- storage per key: the `key_examples` table (SQLite's dbstat) and the whole database, each divided by the
  number of keys; the band samples per key.

Builds `--sentences` of the default corpus into a fresh SQLite database (`--db`, kept for bench/web.py and
bench/search.py: run them with FFMEM_DATABASE_URL set to it). Figures go into bench-results.json under
"examples".
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from sqlalchemy import func, select, text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from results import record  # noqa: E402

from ffmem.config import get_settings  # noqa: E402
from ffmem.store.db import make_engine, make_sessionmaker, upgrade  # noqa: E402
from ffmem.store.models import KeyExamples, Trigger  # noqa: E402
from ffmem.worker.index import IndexOptions, build_index  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=2000)
    parser.add_argument("--db", default=str(ROOT / "data" / "bench-examples.db"))
    args = parser.parse_args()
    path = Path(args.db)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    url = f"sqlite:///{path}"
    upgrade(url)
    engine = make_engine(url)
    sessions = make_sessionmaker(engine)
    settings = get_settings()
    options = IndexOptions.from_settings(settings, sentences=args.sentences)
    summary = build_index(options, sessions)
    keys = summary.layers * summary.keys
    with sessions() as session:
        run_id = summary.run_id
        shaded = {
            int(i)
            for i in session.scalars(
                select(Trigger.sentence_index).where(
                    Trigger.run_id == run_id, Trigger.rank < options.shaded_triggers
                )
            )
        }
        samples = 0
        for (listed,) in session.execute(select(KeyExamples.samples).where(KeyExamples.run_id == run_id)):
            shaded.update(int(s[1]) for s in listed)
            samples += len(listed)
        shading_bytes = session.scalar(
            select(func.sum(func.length(KeyExamples.shading))).where(KeyExamples.run_id == run_id)
        )
        pages = dict(session.execute(text("SELECT name, sum(pgsize) FROM dbstat GROUP BY name")).all())
    engine.dispose()
    table = {name: round(size / keys) for name, size in sorted(pages.items(), key=lambda p: -p[1])[:12]}
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
        "key_examples_bytes_per_key": round(pages.get("key_examples", 0) / keys),
        "shading_float16_bytes_per_key": round((shading_bytes or 0) / keys),
        "database_bytes_per_key": round(os.path.getsize(path) / keys),
        "bytes_per_key_by_table": table,
        "target_bytes_per_key": 8192,
    }
    for name, value in figures.items():
        print(f"{name}: {value}")
    record("examples", figures)


if __name__ == "__main__":
    main()
