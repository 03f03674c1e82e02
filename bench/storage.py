"""Measure bulk-insert speed of the index writes (triggers, value tokens) on one database.

    .venv/bin/python -m bench.storage --db sqlite:///data/bench.db --layers 30
    .venv/bin/python -m bench.storage --db postgresql+psycopg://postgres@127.0.0.1:5432/test --layers 30

The defaults mimic SmolLM2-135M: 1536 keys, T = 50 triggers per sign, 30 value tokens × 2 directions
× 2 readouts. The database is upgraded first; the benchmark run is deleted at the end.
"""

from __future__ import annotations

import time

import numpy as np

from bench import harness
from ffmem.store import corpora, memory_writes, runs
from ffmem.store.db import make_engine, make_sessionmaker, upgrade


def main() -> None:
    parser = harness.parser(__doc__, db=True, record=False)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--keys", type=int, default=1536)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--value-tokens", type=int, default=30)
    args = parser.parse_args()
    url = harness.database_url(args)
    upgrade(url)
    engine = make_engine(url)
    rng = np.random.default_rng(0)
    n, k, v = args.keys, args.top_k, args.value_tokens
    with make_sessionmaker(engine)() as session:
        model = runs.upsert_model(
            session=session,
            slug="bench",
            source="bench",
            revision=None,
            architecture="Bench",
            family="bench",
            n_layers=args.layers,
            n_keys=n,
            d_model=8,
            vocab_size=50_000,
            activation="silu",
            gated=True,
        )
        corpus = corpora.find_corpus(session=session, fingerprint="bench") or corpora.store_corpus(
            session=session,
            name="bench",
            source="bench",
            source_sha256="0" * 64,
            fingerprint="bench",
            tokenizer="bench",
            max_tokens=128,
            skipped={},
            sentences=[("a", [1], [(0, 1)], 0)],
        )
        run = runs.create_run(
            session=session,
            model_id=model.id,
            corpus_id=corpus.id,
            top_k=k,
            n_value_tokens=v,
            n_sentences=2000,
            dtype="float32",
            device="cpu",
            package_version="0",
            provenance={},
            histogram_edges=[0.0, 1.0],
        )
        session.commit()
        trigger_rows = value_rows = 0
        trigger_s = value_s = 0.0
        for layer in range(args.layers):
            t0 = time.perf_counter()
            for sign in (1, -1):
                trigger_rows += memory_writes.store_triggers(
                    session=session,
                    run_id=run.id,
                    layer=layer,
                    sign=sign,
                    coefficients=rng.standard_normal((n, k), dtype=np.float32),
                    sentence_index=rng.integers(0, 2000, (n, k)),
                    position=rng.integers(0, 128, (n, k)),
                )
            session.commit()
            t1 = time.perf_counter()
            for readout in ("raw", "norm"):
                for direction in (1, -1):
                    value_rows += memory_writes.store_value_tokens(
                        session=session,
                        run_id=run.id,
                        layer=layer,
                        readout=readout,
                        direction=direction,
                        token_ids=rng.integers(0, 50_000, (n, v)),
                        logits=rng.standard_normal((n, v), dtype=np.float32),
                        log_z=rng.standard_normal(n, dtype=np.float32),
                    )
            session.commit()
            trigger_s += t1 - t0
            value_s += time.perf_counter() - t1
        print(
            f"{engine.dialect.name}: triggers {trigger_rows:,} rows in {trigger_s:.1f} s = "
            f"{trigger_rows / trigger_s:,.0f} rows/s; value tokens {value_rows:,} rows in {value_s:.1f} s "
            f"= {value_rows / value_s:,.0f} rows/s (commit included)"
        )
        runs.delete_run(session=session, run_id=run.id)
        session.commit()
    engine.dispose()


if __name__ == "__main__":
    main()
