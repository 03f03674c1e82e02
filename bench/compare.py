"""Two runs side by side at the default model's size (a benchmark, not a test): `make bench` runs it.

The page reads only what the comparison job stored (`comparisons`, `key_changes`: one row per memory),
so its speed depends on the shape, not on how the runs were built. This script stores a comparison of
two runs of SmolLM2-135M's shape (30 layers × 1,536 memories = 46,080 rows, gated, hidden size 576)
through the worker's own write path (ffmem.store.comparison.store_comparison, seeded random figures) in
a scratch database (SQLite, and a private schema of the test Postgres when it answers), serves it with
`ffmem serve`, and measures server time (the Server-Timing header) and wall time, sequentially, p50 and
p95, of:
- the pair's page (default sort, then every other sort, then one layer) and its JSON twin;
- the page that offers the runs to compare with (no b).
It also times the job's arithmetic at that size: the weight cosines of two random models of that shape
(ffmem.engine.relations.comparison.weight_cosines) and the trigger overlaps of 46,080 × 2 sets of 50 (the
job's Python loop), and the store. Figures go into bench-results.json under "compare".
"""

from __future__ import annotations

import random
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

from bench import harness
from ffmem.engine.relations.comparison import MemoryWeights, overlap, weight_cosines
from ffmem.store import comparison
from ffmem.store.db import make_engine, make_sessionmaker, upgrade
from ffmem.store.models import Corpus, LanguageModel, Run

LAYERS, KEYS, D, TOP_T = 30, 1536, 576, 50


def two_runs(url: str) -> tuple[str, int, int]:
    """A model of the default shape, one corpus and two finished runs of it: (slug, run a, run b)."""
    upgrade(url)
    moment = datetime.now(timezone.utc)
    with make_sessionmaker(make_engine(url))() as session:
        model = LanguageModel(
            slug="bench-smollm2-shape", source="bench", revision=None, architecture="LlamaForCausalLM",
            family="llama", n_layers=LAYERS, n_keys=KEYS, d_model=D, vocab_size=49152, activation="silu",
            gated=True, created_at=moment,
        )  # fmt: skip
        corpus = Corpus(
            name="bench", source="bench", source_sha256="0" * 64, fingerprint=f"bench-{time.time()}",
            tokenizer="bench", max_tokens=64, n_sentences=2000, n_tokens=60000, skipped={}, created_at=moment,
        )  # fmt: skip
        session.add_all([model, corpus])
        session.flush()
        runs = [
            Run(
                model_id=model.id,
                corpus_id=corpus.id,
                status="done",
                top_k=TOP_T,
                n_value_tokens=10,
                n_sentences=2000,
                n_tokens=60000,
                dtype="float32",
                device="cpu",
                package_version="bench",
                provenance={"weights_sha256": f"{i}" * 64},
                histogram_edges=[],
                error=None,
                started_at=moment,
                finished_at=moment,
            )  # fmt: skip
            for i in range(2)
        ]
        session.add_all(runs)
        session.commit()
        return model.slug, runs[0].id, runs[1].id


def stored_comparison(url: str, run_a: int, run_b: int, rng: np.random.Generator) -> float:
    """Store a comparison of that shape as the worker does; the seconds the store took."""
    shape = (LAYERS, KEYS)
    cosines = {name: np.clip(1 - rng.exponential(0.05, shape), -1, 1) for name in ("gate", "up", "value")}
    changes = {
        "overlap": rng.integers(0, TOP_T + 1, shape) / TOP_T,
        "negative_overlap": rng.integers(0, TOP_T + 1, shape) / TOP_T,
        "key_cosine": cosines["gate"] * cosines["up"],
        "gate_cosine": cosines["gate"],
        "up_cosine": cosines["up"],
        "value_cosine": cosines["value"],
        **{f"d_{name}": rng.normal(0, 0.1, shape) for name in comparison.STATISTICS},
    }
    changes["moved"] = 1 - np.minimum(changes["key_cosine"], changes["value_cosine"])
    layers = [
        {"layer": layer}
        | {f"mean_{name}": float(changes[name][layer].mean()) for name in ("overlap", "negative_overlap")}
        | {f"mean_{name}": float(changes[name][layer].mean()) for name in ("key_cosine", "value_cosine")}
        | {"triggers_changed": int((changes["overlap"][layer] < 1).sum())}
        for layer in range(LAYERS)
    ]
    details = {"keys": "gate and up rows", "values": "value rows", "same_weights": False, "seconds": {}}
    start = time.perf_counter()
    with make_sessionmaker(make_engine(url))() as session:
        comparison.store_comparison(
            session=session, run_a=run_a, run_b=run_b, basis="sentences", top_t=TOP_T, layers=layers,
            details=details, seconds=0.0, changes=changes,
        )  # fmt: skip
        session.commit()
    return time.perf_counter() - start


def arithmetic(rng: np.random.Generator) -> dict:
    """The job's own work at the default size, on random inputs."""

    def model() -> MemoryWeights:
        rows = (LAYERS, KEYS, D)
        return MemoryWeights(
            keys=rng.standard_normal(rows, dtype=np.float32),
            gates=rng.standard_normal(rows, dtype=np.float32),
            values=rng.standard_normal(rows, dtype=np.float32),
        )

    a, b = model(), model()
    start = time.perf_counter()
    weight_cosines(a, b)
    cosines = time.perf_counter() - start
    pick = random.Random(0)
    sets = [[pick.sample(range(2000), TOP_T) for _ in range(2)] for _ in range(LAYERS * KEYS * 2)]
    start = time.perf_counter()
    for first, second in sets:
        overlap(first, second)
    return {
        "weight_cosines_s": round(cosines, 2),
        "trigger_overlaps_s": round(time.perf_counter() - start, 2),
    }


def measure(url: str, slug: str, run_a: int, run_b: int, samples: int) -> dict:
    pick = random.Random(0)
    base_query = f"a={run_a}&b={run_b}"
    kinds = {
        "page": [f"/m/{slug}/compare?{base_query}"] * samples,
        "json": [f"/m/{slug}/compare.json?{base_query}"] * samples,
        "other_sorts": [
            f"/m/{slug}/compare?{base_query}&sort={pick.choice(list(comparison.SORTS))}"
            for _ in range(samples)
        ],
        "one_layer": [
            f"/m/{slug}/compare?{base_query}&layer={pick.randrange(LAYERS)}&sort={pick.choice(list(comparison.SORTS))}"
            for _ in range(samples)
        ],
        "pick": [f"/m/{slug}/compare?a={run_a}"] * samples,
    }
    found = {}
    with harness.served(url) as explorer, httpx.Client(base_url=explorer.base, timeout=30) as client:
        for paths in kinds.values():  # warm the database pages
            for path in paths[:5]:
                client.get(path).raise_for_status()
        for kind, paths in kinds.items():
            found[kind] = harness.sequential(client, paths)
            print(f"  {kind}: server p50 {found[kind]['server']['p50_ms']} ms", flush=True)
    return found


def main() -> None:
    parser = harness.parser(__doc__)
    parser.add_argument("--samples", type=int, default=200, help="Requests per kind of page.")
    parser.add_argument(
        "--no-postgres", action="store_true", help="SQLite only (default: the test Postgres too)"
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results = {"memories": LAYERS * KEYS, "shape": f"{LAYERS} layers × {KEYS} keys, d {D}, gated"}
    print("the job's arithmetic at the default size", flush=True)
    results["job"] = arithmetic(rng)
    print(f"  {results['job']}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        backends = ["sqlite"] + ([] if args.no_postgres else ["postgres"])
        for backend in backends:
            try:
                if backend == "postgres":
                    url = harness.postgres_schema("ffmem_bench_compare")
                else:
                    url = f"sqlite:///{Path(folder) / 'compare.db'}"
                slug, run_a, run_b = two_runs(url)
            except Exception as error:  # noqa: BLE001 - a backend that is not there is skipped, said so
                print(f"{backend}: skipped ({str(error).splitlines()[0]})", flush=True)
                continue
            print(f"{backend}: storing a comparison of {LAYERS * KEYS:,} memories", flush=True)
            store = stored_comparison(url, run_a, run_b, rng)
            results[backend] = {"store_s": round(store, 2)} | measure(url, slug, run_a, run_b, args.samples)
    harness.record(args, "compare", results)


if __name__ == "__main__":
    main()
