"""Round trips of a whole index (a benchmark, not a test): a synthetic finished run of the default model's
shape (SmolLM2-135M: 30 layers × 1,536 memories, 49,152 tokens; the default corpus's ~36.5K sentences, top-T
50, 30 value tokens; bench/synthetic_index.py fills every table) in SQLite, exported (Parquet and JSON Lines),
imported into Postgres, exported again and imported into a second SQLite: each step timed, the sizes beside
the SQLite database, every table compared after SQLite → Postgres → SQLite, and a key read through the Python
API (ffmem.open: triggers with shading, value tokens, statistics, quadrants, neighbours, explanation, label)
timed, p50 over 200 random keys.

    .venv/bin/python -m bench.transfer [--sentences 36500] [--folder /tmp/ffmem-transfer]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import time
from pathlib import Path

from bench import harness
from bench.synthetic_index import Shape, write_run
from ffmem.store.db import make_engine, make_sessionmaker, upgrade
from ffmem.store.export import export_run
from ffmem.store.imports import import_run

SCHEMA = "ffmem_transfer"


def _timed(action) -> tuple[object, float]:
    start = time.perf_counter()
    result = action()
    return result, time.perf_counter() - start


def _export(url: str, run_id: int, folder: Path, fmt: str) -> tuple[dict, float]:
    shutil.rmtree(folder, ignore_errors=True)
    engine = make_engine(url)
    with make_sessionmaker(engine)() as session:
        _, seconds = _timed(lambda: export_run(session=session, run_id=run_id, folder=folder, fmt=fmt))
    engine.dispose()
    return json.loads((folder / "manifest.json").read_text()), seconds


def _import(url: str, folder: Path) -> tuple[int, float]:
    engine = make_engine(url)
    with make_sessionmaker(engine)() as session, session.begin():
        imported, seconds = _timed(lambda: import_run(session=session, folder=folder))
    engine.dispose()
    return imported.run_id, seconds


def _size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=int, default=36_500)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/ffmem-transfer"))
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--api-only", action="store_true", help="Only time the API on the built source.")
    options = parser.parse_args()
    folder = options.folder
    folder.mkdir(parents=True, exist_ok=True)
    figures: dict[str, object] = {}
    source = folder / "source.db"
    shape = Shape(
        slug="synthetic-smollm2-135m", n_layers=30, n_keys=1536, vocab_size=49_152, d_model=576,
        sentences=options.sentences,
    )  # fmt: skip
    if not source.exists():
        url = f"sqlite:///{source}.partial"
        Path(f"{source}.partial").unlink(missing_ok=True)
        upgrade(url)
        engine = make_engine(url)
        with make_sessionmaker(engine)() as session:
            _, figures["build_s"] = _timed(lambda: write_run(session, shape))
        engine.dispose()
        Path(f"{source}.partial").rename(source)
    sqlite_url = f"sqlite:///{source}"
    if options.api_only:
        print(json.dumps({"api_key_read_ms": _api_p50(sqlite_url, shape, options.keys)}, indent=2))
        return
    figures["sqlite_bytes"] = source.stat().st_size
    first, figures["export_parquet_s"] = _export(sqlite_url, 1, folder / "first", "parquet")
    figures["parquet_bytes"] = _size(folder / "first")
    _, figures["export_jsonl_s"] = _export(sqlite_url, 1, folder / "jsonl", "jsonl")
    figures["jsonl_bytes"] = _size(folder / "jsonl")
    postgres_url = harness.postgres_schema(SCHEMA)
    upgrade(postgres_url)
    run_id, figures["import_postgres_s"] = _import(postgres_url, folder / "first")
    second, figures["export_postgres_s"] = _export(postgres_url, run_id, folder / "second", "parquet")
    back = folder / "back.db"
    back.unlink(missing_ok=True)
    upgrade(f"sqlite:///{back}")
    run_id, figures["import_sqlite_s"] = _import(f"sqlite:///{back}", folder / "second")
    third, _ = _export(f"sqlite:///{back}", run_id, folder / "third", "parquet")
    figures["tables"] = len(first["files"])
    figures["identical_after_postgres"] = second["files"] == third["files"]
    figures["identical_before_and_after"] = sorted(
        name for name in first["files"] if first["files"][name]["sha256"] == third["files"][name]["sha256"]
    )
    # key_stats: SQLite's 8-byte floats rounded to Postgres's 4-byte reals on the way; equal as float32.
    figures["key_stats_equal_as_float32"] = _float32_rows(folder / "first") == _float32_rows(folder / "third")
    figures["rows"] = sum(f["rows"] for f in first["files"].values())
    figures["api_key_read_ms"] = _api_p50(sqlite_url, shape, options.keys)
    figures["api_key_read_postgres_ms"] = _api_p50(postgres_url, shape, options.keys)
    print(json.dumps(figures, indent=2))


def _float32_rows(folder: Path) -> list[tuple]:
    import numpy as np
    import pyarrow.parquet as pq

    table = pq.read_table(folder / "key_stats.parquet").to_pylist()
    return [
        tuple(float(np.float32(v)) if isinstance(v, float) else str(v) for v in row.values()) for row in table
    ]


def _api_p50(url: str, shape: Shape, n: int) -> dict[str, float]:
    """A key read whole through ffmem.open, cold per key (a new Key each time), over `n` random keys: wall
    time, and this process's CPU time (SQLite runs in the process: its CPU time is the read's cost on a quiet
    machine; on a loaded one the wall time waits for a core)."""
    import ffmem

    rng = random.Random(0)
    with ffmem.open(url) as index:
        run = index.model().run()
        _ = run.key(0, 0).triggers  # the vocabulary, read once a process (the explorer's cache)
        wall, cpu = [], []
        for _ in range(n):
            key = run.key(rng.randrange(shape.n_layers), rng.randrange(shape.n_keys))
            start, start_cpu = time.perf_counter(), time.process_time()
            key.triggers, key.negative_triggers, key.value_tokens, key.stats  # noqa: B018
            key.quadrants, key.neighbours, key.explanation, key.label  # noqa: B018
            wall.append(1000 * (time.perf_counter() - start))
            cpu.append(1000 * (time.process_time() - start_cpu))
    return {
        "wall_p50": round(statistics.median(wall), 2),
        "wall_p90": round(statistics.quantiles(wall, n=10)[-1], 2),
        "cpu_p50": round(statistics.median(cpu), 2),
    }


if __name__ == "__main__":
    main()
