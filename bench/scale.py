"""The explorer at the scale of real models (a benchmark, not a test): a synthetic finished run of a model's
shape (bench/synthetic_index.py: written through the store's own writers, no model needed), then its
storage and its pages' times.

- Build: seconds to write the run, by part (value tokens, value histograms, triggers, key statistics with
  their orders, key examples, neighbours, links, explanations, the token → memories table), and their sum,
  the store's time (`store_seconds`: the synthetic finished state's making, "generating", left out);
  `--runs 2` writes two runs of the shape (their bytes are counted over both runs' memories; the pages read
  the newest).
- Storage: bytes per memory, every table with its indexes (SQLite: dbstat; Postgres:
  pg_total_relation_size), the vocabulary and corpus included.
- Pages, with the app's own TestClient, sequentially (wall ms, p50 / p95 over REQUESTS each): the key page
  (random keys), its samples and related sections, the layer page (each sort, filtered by a token, a late
  page), token search (by prob and by logit, both readouts), free-text search, the model page, the JSON
  twins.
- 32 concurrent clients (httpx, asyncio) for 20 s on a mix of those pages (token search on every run),
  against `ffmem serve` in its own process: requests, errors (non-200 or failed), p50 / p95, and that
  process's peak and final resident memory (VmHWM, VmRSS).

    python -m bench.scale --shape smollm2 --backend sqlite [--runs 1] [--sentences 1000] [--no-record]
    python -m bench.scale --shape llama-3.3-70b --backend both --store-only     # the store's time and bytes
    python -m bench.scale --shape llama-3.3-70b --layers 4     # its width's pages, 4 of its 80 layers

Shapes: smollm2 (30 × 1,536), llama-1b (16 × 8,192), llama-8b (32 × 14,336), qwen3-32b (64 × 25,600,
151,936 tokens), llama-3.3-70b (80 × 28,672, 128,256 tokens).

SQLite: a fresh file under /tmp; Postgres: a private schema (ffmem_scale_<shape>) of FFMEM_TEST_POSTGRES_URL
or the local server's `test` database, dropped first. Figures go into bench-results.json under
"scale-<shape>-<db>" ("-store" with --store-only).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote

from fastapi.testclient import TestClient
from sqlalchemy import text

from bench import harness
from bench.synthetic_index import Shape, sentence_tokens, token_text, write_run
from ffmem.config import Settings
from ffmem.store.db import make_engine, make_sessionmaker, upgrade
from ffmem.store.layer_table import KEY_SORTS
from ffmem.web.main import create_app

SHAPES = {  # layers × keys (d_ff), vocabulary, d_model
    "smollm2": dict(slug="synthetic-smollm2-135m", n_layers=30, n_keys=1536, vocab_size=49_152, d_model=576),
    "llama-1b": dict(
        slug="synthetic-llama-3.2-1b", n_layers=16, n_keys=8192, vocab_size=128_256, d_model=2048
    ),
    "llama-8b": dict(
        slug="synthetic-llama-3.1-8b", n_layers=32, n_keys=14_336, vocab_size=128_256, d_model=4096
    ),
    "qwen3-32b": dict(
        slug="synthetic-qwen3-32b", n_layers=64, n_keys=25_600, vocab_size=151_936, d_model=5120
    ),
    "llama-3.3-70b": dict(
        slug="synthetic-llama-3.3-70b", n_layers=80, n_keys=28_672, vocab_size=128_256, d_model=8192
    ),
}
SCHEMA = "ffmem_scale"  # and the shape's slug: shapes measured at once keep their own
REQUESTS = 30  # per page kind


def database(kind: str, shape: Shape) -> str:
    """A fresh, migrated database of this kind: its URL."""
    if kind == "sqlite":
        path = Path(f"/tmp/ffmem-scale-{shape.slug}.db")
        path.unlink(missing_ok=True)
        url = f"sqlite:///{path}"
    else:
        url = harness.postgres_schema(f"{SCHEMA}_{shape.slug.replace('-', '_').replace('.', '_')}")
    upgrade(url)
    return url


def analyze(url: str) -> float | None:
    """On Postgres, VACUUM (ANALYZE) every table: what autovacuum does after a build (its insert-triggered
    vacuum, Postgres ≥ 13, sets the visibility map that lets a layer's count read the index alone; its
    analyze gives the planner statistics: unanalyzed tables get plans that scan a layer's every list). The
    local test server runs without autovacuum. Seconds."""
    engine = make_engine(url)
    if engine.dialect.name != "postgresql":
        return None
    start = time.perf_counter()
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        query = text("SELECT tablename FROM pg_tables WHERE schemaname = current_schema()")
        tables = ", ".join(f'"{table}"' for table in connection.scalars(query))
        connection.execute(text(f"VACUUM (ANALYZE) {tables}"))
    engine.dispose()
    return round(time.perf_counter() - start, 1)


def table_bytes(url: str) -> dict[str, int]:
    """Bytes of each table with its indexes (and TOAST on Postgres), largest first."""
    engine = make_engine(url)
    with engine.connect() as connection:
        if engine.dialect.name == "sqlite":
            query = text(
                "SELECT coalesce(m.tbl_name, s.name), sum(s.pgsize) FROM dbstat s "
                "LEFT JOIN sqlite_master m ON m.name = s.name GROUP BY 1"
            )
        else:
            query = text(
                "SELECT tablename, pg_total_relation_size(quote_ident(tablename)) FROM pg_tables "
                "WHERE schemaname = current_schema()"
            )
        sizes = {name: int(size) for name, size in connection.execute(query)}
    engine.dispose()
    return dict(sorted(sizes.items(), key=lambda item: -item[1]))


def timed(client: TestClient, paths: list[str]) -> dict:
    """Wall ms of each GET, sequentially; every answer must be a 200."""
    ms = []
    for path in paths:
        start = time.perf_counter()
        response = client.get(path)
        ms.append(1000 * (time.perf_counter() - start))
        if response.status_code != 200:
            raise SystemExit(f"{path}: {response.status_code} {response.text[:300]}")
    return harness.percentiles(ms)


def page_paths(shape: Shape, pick: random.Random) -> dict[str, list[str]]:
    """The paths of each page kind measured, REQUESTS each (random keys, layers, tokens, texts)."""
    m, n = f"/m/{shape.slug}", REQUESTS

    def memories() -> list[tuple[int, int]]:
        return [(pick.randrange(shape.n_layers), pick.randrange(shape.n_keys)) for _ in range(n)]

    def layers() -> list[int]:
        return [pick.randrange(shape.n_layers) for _ in range(n)]

    keys = [f"{m}/layers/{layer}/keys/{key}" for layer, key in memories()]
    late = shape.n_keys // 50  # the last page of 50
    sentences = sentence_tokens(shape)
    texts = []
    for _ in range(n):  # two tokens of a corpus sentence
        ids = pick.choice(sentences)
        at = pick.randrange(len(ids) - 1)
        texts.append(token_text(ids[at]) + token_text(ids[at + 1]))
    tokens = [token_text(pick.randrange(shape.vocab_size)).strip() for _ in range(n)]
    paths = {
        "key page": keys,
        "key page .json": [f"{p}.json" for p in keys],
        "key samples": [f"{p}/samples" for p in keys],
        "key related": [f"{p}/related" for p in keys],
    }
    for sort in KEY_SORTS:
        paths[f"layer by {sort}"] = [f"{m}/layers/{lay}?sort={sort}&order=desc" for lay in layers()]
    paths["layer late page"] = [f"{m}/layers/{lay}?sort=max_prob&order=desc&page={late}" for lay in layers()]
    paths["layer filtered"] = [f"{m}/layers/{lay}?token={t}" for lay, t in zip(layers(), tokens, strict=True)]
    paths["layer page .json"] = [f"{m}/layers/{lay}.json?sort=density&order=desc&page=3" for lay in layers()]
    for readout in ("raw", "norm"):
        for by in ("prob", "logit"):
            paths[f"token search {readout}/{by}"] = [
                f"{m}/search?q={quote(t)}&readout={readout}&by={by}" for t in tokens
            ]
    paths["token search .json"] = [f"{m}/search.json?q={quote(t)}" for t in tokens]
    paths["free-text search"] = [f"{m}/search?q={quote(t)}" for t in texts]
    paths["model page"] = [m] * n
    paths["model page .json"] = [f"{m}.json"] * n
    return paths


def under_load(url: str, paths: list[str]) -> dict:
    """32 clients for 20 s (harness.concurrent) against `ffmem serve` in its own process, and its
    resident memory."""
    with harness.served(url) as explorer:
        figures = asyncio.run(harness.concurrent(explorer.base, paths))
        status = Path(f"/proc/{explorer.process.pid}/status").read_text()
        memory = dict(
            line.split(":", 1) for line in status.splitlines() if line.startswith(("VmHWM", "VmRSS"))
        )
        figures |= {
            name.lower() + "_mb": round(int(value.split()[0]) / 1024) for name, value in memory.items()
        }
        return figures


def bench(shape: Shape, kind: str, n_runs: int = 1, store_only: bool = False) -> dict:
    url = database(kind, shape)
    print(f"{kind}: writing {n_runs} × {shape.slug} ({shape.memories:,} memories)", flush=True)
    start = time.perf_counter()
    with make_sessionmaker(make_engine(url))() as session:
        written = [
            write_run(session, shape, report=lambda line: print(f"  {line}", flush=True))
            for _ in range(n_runs)
        ]
    build = (time.perf_counter() - start) / n_runs
    analyzed = analyze(url)
    sizes = table_bytes(url)
    total = sum(sizes.values())
    parts = {name: round(s, 1) for name, s in written[-1].seconds.items()}
    stored = {
        "store_seconds": round(sum(s for name, s in written[-1].seconds.items() if name != "generating"), 1),
        # this process's CPU seconds storing (SQLite's work is in it, Postgres's server is not): on a
        # machine other processes load, wall time measures them too
        "store_cpu_seconds": round(
            sum(s for name, s in written[-1].cpu_seconds.items() if name != "generating"), 1
        ),
        "build_parts_cpu_seconds": {name: round(s, 1) for name, s in written[-1].cpu_seconds.items()},
        # Postgres's backend's CPU seconds (the server's side of the COPYs, its indexes), by part
        "store_server_cpu_seconds": round(
            sum(s for name, s in written[-1].server_cpu_seconds.items() if name != "generating"), 1
        ),
        "build_parts_server_cpu_seconds": {
            name: round(s, 1) for name, s in written[-1].server_cpu_seconds.items()
        },
        "build_seconds": round(build, 1),
        "build_parts_seconds": parts,
        "analyze_seconds": analyzed,
        "bytes": total,
        "bytes_per_memory": round(total / (n_runs * shape.memories)),
        "table_bytes_per_memory": {
            name: round(size / (n_runs * shape.memories)) for name, size in sizes.items()
        },
    }
    print(
        f"  stored in {stored['store_seconds']} s ({stored['store_cpu_seconds']} s of this process's CPU, "
        f"{stored['store_server_cpu_seconds']} s of the Postgres backend's; "
        f"generating the synthetic state apart: "
        f"{parts.get('generating')} s); {stored['bytes_per_memory']:,} B a memory",
        flush=True,
    )
    if store_only:
        return {
            "shape": {**vars(shape), "memories": shape.memories},
            "database": kind,
            "runs": n_runs,
            **stored,
        }
    paths = page_paths(shape, random.Random(0))
    pages = {}
    with TestClient(create_app(Settings(database_url=url))) as client:
        for path in [paths["key page"][0], paths["layer by key"][0], paths["model page"][0]]:
            client.get(path)  # the vocabulary and the first pages of the database
        start = time.perf_counter()
        client.get(paths["token search raw/prob"][0]).raise_for_status()
        first_search = 1000 * (time.perf_counter() - start)  # the token table's first rows read
        for name, kind_paths in paths.items():
            pages[name] = timed(client, kind_paths)
            print(
                f"  {name:<28} p50 {pages[name]['p50_ms']:>8.1f} ms  p95 {pages[name]['p95_ms']:>8.1f} ms",
                flush=True,
            )
    mix = [p for name, kind_paths in paths.items() if "search" not in name for p in kind_paths]
    mix += paths["token search raw/prob"][:5] + paths["free-text search"][:5]
    mix += [f"{p}&run={w.run_id}" for w in written for p in paths["token search norm/logit"][:5]]
    load = under_load(url, mix)
    return {
        "shape": {**vars(shape), "memories": shape.memories},
        "database": kind,
        "runs": n_runs,
        **stored,
        "first_token_search_ms": round(first_search, 1),
        "pages": pages,
        "concurrent": load,
        "cores": os.cpu_count(),
    }


def report(results: dict) -> None:
    print(
        f"\n{results['shape']['slug']} on {results['database']}: {results['shape']['memories']:,} memories, "
        f"stored in {results['store_seconds']} s (built in {results['build_seconds']} s with the synthetic "
        f"state's making); {results['bytes_per_memory']:,} B a memory ({results['bytes'] / 2**20:,.0f} MiB)"
    )
    cpu = results.get("build_parts_cpu_seconds", {})
    server = results.get("build_parts_server_cpu_seconds", {})
    for name, seconds in results["build_parts_seconds"].items():
        print(
            f"  {name:<28} {seconds:>8.1f} s  (CPU {cpu.get(name, 0):>6.1f} s, "
            f"the server's {server.get(name, 0):>6.1f} s)"
        )
    for name, size in results["table_bytes_per_memory"].items():
        if size:
            print(f"  {name:<22} {size:>8,} B/memory")
    if "pages" not in results:
        return
    print(f"  first token search {results['first_token_search_ms']} ms")
    print(f"  {'page':<28} {'p50 ms':>8} {'p95 ms':>8}")
    for name, figures in results["pages"].items():
        print(f"  {name:<28} {figures['p50_ms']:>8.1f} {figures['p95_ms']:>8.1f}")
    load = results["concurrent"]
    print(
        f"  {load['clients']} clients × {load['seconds']:g} s: {load['requests']} requests, "
        f"{load['errors']} errors {load['statuses']}, "
        f"p50 {load['latency']['p50_ms']} ms, p95 {load['latency']['p95_ms']} ms; "
        f"the web process's memory: peak {load.get('vmhwm_mb')} MB, at the end {load.get('vmrss_mb')} MB "
        f"({results['runs']} run(s))"
    )


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--backend", choices=("sqlite", "postgres", "both"), default="sqlite")
    parser.add_argument("--sentences", type=int, default=1000, help="Corpus sentences (default 1000).")
    parser.add_argument("--runs", type=int, default=1, help="Runs of the shape written (default 1).")
    parser.add_argument(
        "--store-only", action="store_true", help="Write the run and count its bytes; time no pages."
    )
    parser.add_argument(
        "--layers", type=int, help="Only this many of the shape's layers (its width and vocabulary kept)."
    )
    args = parser.parse_args()
    shape = Shape(**SHAPES[args.shape], sentences=args.sentences)
    if args.layers:
        shape = replace(shape, n_layers=args.layers, slug=f"{shape.slug}-{args.layers}-layers")
    for kind in ("sqlite", "postgres") if args.backend == "both" else (args.backend,):
        results = bench(shape, kind, args.runs, args.store_only)
        report(results)
        suffix = (f"-{args.runs}-runs" if args.runs > 1 else "") + ("-store" if args.store_only else "")
        suffix += f"-{args.layers}-layers" if args.layers else ""
        harness.record(args, f"scale-{args.shape}-{kind}{suffix}", results)


if __name__ == "__main__":
    main()
