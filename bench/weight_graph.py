"""The weight graph: its cost on the default model, and whether its scores mean something (a benchmark
and a validation on the real model, not a test): `make bench` runs it.

1. Time and storage: the weight graph of all memories of the default model (30 × 1,536 = 46,080 on
   SmolLM2-135M), computed and stored for the default index run as a finished run stores it
   (ffmem.worker.composition.store_weight_graph); the bytes its table takes (SQLite's dbstat).
2. Validation by ablation: for `--keys` keys sampled uniformly (layer ≥ 1), the pair (its top inbound
   memory j → the key i) and a random pair (a uniformly drawn memory of an earlier layer → the same
   key). On each of the key's top `--triggers` trigger prefixes from the index, memory j is switched
   off (m_j = 0 at every position, ffmem.engine.live.edited_forward) and the change of m_i at the trigger
   token is compared with the score's prediction: switching j off removes m_j·v_j, so m_i should move
   by the sign of −m_j·score (m_j read at the same position in the clean pass). The rate of agreement
   for the graph's pairs against that for random pairs (which a meaningless score would put at 50%
   both), and how large the change is (|Δm_i| / |m_i|, medians).
Figures go into bench-results.json under "weight_graph".
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from bench import harness
from ffmem.config import get_settings
from ffmem.engine.live.edited_forward import intervene
from ffmem.engine.live.interventions import Intervention
from ffmem.engine.model.hooks import capture
from ffmem.engine.model.loading import load_model
from ffmem.engine.relations.weight_graph import read_vectors, value_vectors
from ffmem.store import composition, corpora, memory_reads, runs
from ffmem.store.db import make_engine, make_sessionmaker
from ffmem.worker.composition import store_weight_graph


def table_bytes(url: str, table: str) -> int | None:
    """Bytes a table and its indexes take in a SQLite file (None on another backend)."""
    if not url.startswith("sqlite"):
        return None
    engine = make_engine(url)
    with engine.connect() as connection:
        names = [table] + [
            row[0]
            for row in connection.exec_driver_sql(
                "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ?", (table,)
            )
        ]
        marks = ", ".join("?" * len(names))
        found = connection.exec_driver_sql(
            f"SELECT SUM(pgsize) FROM dbstat WHERE name IN ({marks})", tuple(names)
        )
        return int(found.scalar() or 0)


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def validate(sessions, run_id: int, loaded, keys: int, triggers: int, seed: int) -> dict:
    rng = random.Random(seed)
    n_layers, d_ff = loaded.n_layers, loaded.n_keys
    model, adapter = loaded.model, loaded.adapter
    sample = [(rng.randrange(1, n_layers), rng.randrange(d_ff)) for _ in range(keys)]
    values = [value_vectors(loaded, layer) for layer in range(n_layers)]  # [d_ff, d] each
    outcomes = {"graph": [], "random": []}  # (agrees, |Δm_i| / |m_i|)
    with sessions() as session, torch.inference_mode():
        run = runs.get_run(session=session, run_id=run_id)
        for layer, key in sample:
            inbound = composition.get_links(session=session, run_id=run_id, layer=layer, key=key)["in"]
            read = read_vectors(loaded, layer)[key]  # [d]
            writer = (rng.randrange(layer), rng.randrange(d_ff))
            pairs = {
                "graph": (inbound[0].layer, inbound[0].key, inbound[0].score),
                "random": (*writer, float(values[writer[0]][writer[1]] @ read)),
            }
            found = memory_reads.get_triggers(
                session=session, run_id=run_id, layer=layer, key=key, sign=1, limit=triggers
            )
            sentences = corpora.get_sentences(
                session=session, corpus_id=run.corpus_id, indices=[t.sentence_index for t in found]
            )
            for trigger in found:
                ids = torch.tensor([sentences[trigger.sentence_index].token_ids[: trigger.position + 1]])
                watched = {layer, *(p[0] for p in pairs.values())}
                with (
                    torch.inference_mode(),
                    capture(model, adapter, layers=watched, fields=("coefficients",)) as c,
                ):
                    model.base_model(input_ids=ids, use_cache=False)
                    clean = {lay: m[0, -1].clone() for lay, m in c.coefficients.items()}  # [d_ff] each
                m_i = clean[layer][key].item()
                for name, (w_layer, w_key, score) in pairs.items():
                    off = [Intervention(w_layer, w_key, "off")]
                    with (
                        intervene(loaded, off),
                        capture(model, adapter, layers=[layer], fields=("coefficients",)) as c,
                    ):
                        model.base_model(input_ids=ids, use_cache=False)
                        delta = c.coefficients[layer][0, -1, key].item() - m_i
                    predicted = -_sign(clean[w_layer][w_key].item() * score)
                    outcomes[name].append((_sign(delta) == predicted != 0, abs(delta) / max(abs(m_i), 1e-9)))
    summary = {}
    for name, found in outcomes.items():
        summary[name] = {
            "pairs": len(found),
            "direction_agrees": round(sum(a for a, _ in found) / max(1, len(found)), 4),
            "median_relative_change": round(statistics.median(r for _, r in found), 5) if found else None,
        }
    return summary


def main() -> None:
    parser = harness.parser(__doc__, db=True)
    parser.add_argument("--keys", type=int, default=100, help="keys sampled for the validation")
    parser.add_argument("--triggers", type=int, default=5, help="top trigger prefixes per key")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    settings = get_settings()
    url = harness.database_url(args)
    run_id = harness.default_run(url).id
    sessions = make_sessionmaker(make_engine(url))
    loaded = load_model(settings.model, device="cpu", dtype="float32", cache_dir=settings.cache_dir)
    start = time.perf_counter()
    stored = store_weight_graph(sessions, run_id, loaded)
    seconds = time.perf_counter() - start
    results = {
        "memories": loaded.n_layers * loaded.n_keys,
        "threads": torch.get_num_threads(),
        "seconds": round(seconds, 1),
        "compute_seconds": round(stored["compute_seconds"], 1),
        "store_seconds": round(stored["store_seconds"], 1),
        "rows": stored["rows"],
        "storage_bytes": table_bytes(url, "memory_links"),
        "target_seconds": 120,
    }
    print(results, flush=True)
    start = time.perf_counter()
    results["validation"] = validate(sessions, run_id, loaded, args.keys, args.triggers, args.seed) | {
        "keys": args.keys,
        "triggers": args.triggers,
        "seed": args.seed,
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(results["validation"], flush=True)
    harness.record(args, "weight_graph", results)


if __name__ == "__main__":
    main()
